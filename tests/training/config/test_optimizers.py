"""The optimizer record is the one home of what the code reads about an update rule: every entry of OPTIMIZERS is a
name the schema takes, a type the DeepSpeed config gets, states the plan counts and, where the loop builds it, a
builder it resolves; and a record added to OPTIMIZERS alone reaches the DeepSpeed config, the plan, the loop, LoRA's
check and the layout table."""
import math
from typing import get_args

import pytest
from pydantic import ValidationError
from transformers import AutoConfig

from training.base.errors import ConfigError
from training.base.loader import load
from training.config.optimizers import OPTIMIZERS, SHAPED_RULES, OptimizerRecord
from training.config.recipe import load_recipe
from training.config.sections import OptimizerSection
from training.loop.optimizer import client_optimizer
from training.models.lora import check_lora
from training.parallel import support
from training.planning.ds_config import deepspeed_optimizer_keys, load_ds_config, resolve_ds_config
from training.planning.layout import ParallelDims
from training.planning.model_states import muon_staging_bytes
from training.planning.optimizer_states import optimizer_state_bytes
from training.planning.shape import model_shape

TINY = model_shape(AutoConfig.from_pretrained("recipes/tiny_llama/config.json"))
FAKE = OptimizerRecord("Fake", "fixed", 2.0, builder="training.loop.optimizer:lion", untaken_keys=("eps",),
                       lora_refused="not tried with adapters", refused_layouts={"tensor_parallel": "not built"})


def resolved(name: str, setting: str = "1") -> dict:
    recipe = load_recipe("tiny_llama", [f"optimizer.name={name}", f"deepspeed.config=zero{setting}"])
    raw, path = load_ds_config(recipe)
    return resolve_ds_config(raw, path, recipe, 64, 2, "fp32")


def test_the_schema_takes_exactly_the_records_names():
    assert get_args(OptimizerSection.model_fields["name"].annotation) == tuple(OPTIMIZERS)
    with pytest.raises(ValidationError, match="'adamw', 'adamw8bit', 'adafactor', 'lion' or 'muon'"):
        OptimizerSection(name="sgd")


def test_each_setting_of_the_section_is_one_records():
    owners = [name for record in OPTIMIZERS.values() for name in record.settings]
    assert sorted(owners) == sorted(set(OptimizerSection.model_fields) - {"name"})
    for name, record in OPTIMIZERS.items():
        for setting in record.settings:
            other = next(other for other in OPTIMIZERS if other != name)
            with pytest.raises(ValidationError, match=f"optimizer.{setting} applies to optimizer.name={name}, not "
                                                      f"{other}"):
                OptimizerSection(name=other, **{setting: 0.5})


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_record_reaches_the_deepspeed_config(name):
    record = OPTIMIZERS[name]
    config = resolved(name)
    params = config["optimizer"]["params"]
    assert config["optimizer"]["type"] == record.deepspeed_type
    assert not set(record.untaken_keys) & set(params)
    assert set(record.settings.values()) <= set(params)
    assert config.get("zero_allow_untested_optimizer", False) is record.client
    zero3 = resolved(name, "3")
    assert all(zero3[section][key] == value for dotted, value in record.zero3_keys.items()
               for section, key in [dotted.split(".")])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_plan_counts_each_records_states(name):
    record = OPTIMIZERS[name]
    assert record.state_rule in {"fixed", "layer_matrices", *SHAPED_RULES}
    for stage in range(4):
        state_bytes = optimizer_state_bytes(name, TINY, stage, 2)
        assert math.isfinite(state_bytes) and 0 < state_bytes <= 8
    if record.state_rule == "fixed":
        assert optimizer_state_bytes(name, TINY) == record.state_bytes
    staged = muon_staging_bytes(name, TINY, 2, 2)
    assert (staged > 0) is record.staged_momentum


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_loop_resolves_each_records_builder_and_check(name):
    record = OPTIMIZERS[name]
    for qualified in record.builder, record.check:
        if qualified is not None:
            assert qualified.startswith("training.loop.") and callable(load(qualified))
    built = client_optimizer(resolved(name))
    assert (built is not None) is record.client and (built is None or callable(built))


def test_a_record_added_alone_reaches_the_config_the_plan_the_loop_lora_and_the_layout_table(monkeypatch):
    monkeypatch.setitem(OPTIMIZERS, "fake", FAKE)
    recipe = load_recipe("tiny_llama", ["lora.enabled=true", "model.name_or_path=somewhere",
                                        "parallelism.tensor_parallel=2"])
    recipe = recipe.model_copy(update={"optimizer": recipe.optimizer.model_copy(update={"name": "fake"})})
    keys = deepspeed_optimizer_keys(recipe, "2_offload")
    assert keys["optimizer.type"] == ("optimizer.name", "Fake") and "optimizer.params.eps" not in keys
    assert keys["zero_force_ds_cpu_optimizer"] == ("optimizer.name=fake with ZeRO-Offload", False)
    assert optimizer_state_bytes("fake", TINY, 1, 2) == 2.0 and muon_staging_bytes("fake", TINY, 1, 2) == 0
    built = client_optimizer({"optimizer": {"type": "Fake", "params": {"lr": 1e-3, "betas": [0.9, 0.99],
                                                                        "weight_decay": 0.0}}})
    assert built.func.__name__ == "Lion"
    with pytest.raises(ConfigError, match=r"lora.enabled with optimizer.name=fake \(not tried with adapters\)"):
        check_lora(recipe, None, "fp32", for_gpus=False)
    monkeypatch.setattr(support, "TABLE", [*support.TABLE, support.optimizer_feature("fake")])
    assert "| optimizer.name=fake | yes | not built | yes | yes |\n" in support.render()
    lines = support.refusals(recipe, None, ParallelDims.of(recipe.parallelism, 4))
    assert "optimizer.name=fake with parallelism.tensor_parallel=2: not built; set parallelism.tensor_parallel=1, or "\
           "optimizer.name=adamw" in lines
