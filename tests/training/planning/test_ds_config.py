import json

import pytest

from training.base.errors import ConfigError
from training.config.recipe import load_recipe
from training.planning.ds_config import (
    DS_CONFIGS_DIR,
    available_ds_configs,
    ds_config_file,
    load_ds_config,
    resolve_ds_config,
)

SHIPPED = ["zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]


def resolve(name: str, precision: str = "bf16", ranks: int = 2, hidden: int = 256, *overrides: str) -> dict:
    recipe = load_recipe("tiny_llama", [f"deepspeed.config={name}", *overrides])
    raw, path = load_ds_config(recipe)
    return resolve_ds_config(raw, path, recipe, hidden, ranks, precision)


def test_the_shipped_configs_are_all_there():
    assert set(SHIPPED) <= set(available_ds_configs())


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("ranks, accumulation", [(1, 2), (2, 1)])
def test_every_shipped_config_resolves_with_no_auto_left(name, precision, ranks, accumulation):
    config = resolve(name, precision, ranks)
    assert '"auto"' not in json.dumps(config)
    # global 16 rows = 8 per micro-batch x accumulation x ranks
    assert config["train_micro_batch_size_per_gpu"] == 8
    assert config["gradient_accumulation_steps"] == accumulation
    assert config["train_batch_size"] == 16
    assert config["gradient_clipping"] == 1.0
    assert config["optimizer"]["params"] == {**config["optimizer"]["params"], "lr": 3.0e-3, "betas": [0.9, 0.95],
                                             "eps": 1e-8, "weight_decay": 0.1}


@pytest.mark.parametrize("name", SHIPPED)
def test_bucket_sizes_follow_the_hf_trainer_formulas(name):
    zero = resolve(name, "bf16", 2, 512)["zero_optimization"]
    assert zero.get("reduce_bucket_size", 512 * 512) == 512 * 512
    if zero["stage"] == 3:
        assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 512 * 512)
        assert zero["stage3_param_persistence_threshold"] == 10 * 512
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True


def test_indivisible_batch_names_the_numbers():
    with pytest.raises(ConfigError, match=r"global_batch_size=16 is not a multiple of training.micro_batch_size "
                                          r"\(8\) x data-parallel ranks \(3\) = 24"):
        resolve("zero1", "bf16", 3)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_bf16_with_zero_accumulates_gradients_in_fp32(name):
    config = resolve(name, "bf16")
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert config["data_types"]["grad_accum_dtype"] == "fp32"
    assert "torch_autocast" not in config


def test_bf16_without_zero_runs_as_torch_autocast():
    config = resolve("zero0", "bf16")
    assert config["bf16"]["enabled"] is False and config["fp16"]["enabled"] is False
    assert config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}


def test_fp32_enables_no_half_precision():
    config = resolve("zero2", "fp32")
    assert config["bf16"]["enabled"] is False and config["fp16"]["enabled"] is False
    assert "torch_autocast" not in config


def test_concrete_values_that_contradict_the_recipe_name_both_files(tmp_path):
    raw = json.loads((DS_CONFIGS_DIR / "zero2.json").read_text())
    raw.update(train_micro_batch_size_per_gpu=4, gradient_clipping=0.5)
    raw["bf16"]["enabled"] = True
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(raw))
    recipe = load_recipe("tiny_llama", [f"deepspeed.config={path}"])
    with pytest.raises(ConfigError) as error:
        resolve_ds_config(json.loads(path.read_text()), path, recipe, 256, 2, "fp32")
    message = str(error.value)
    assert (f"train_micro_batch_size_per_gpu=4 in {path} contradicts training.micro_batch_size=8 in {recipe.path}"
            in message)
    assert "gradient_clipping=0.5" in message and "training.grad_clip=1.0" in message
    assert "bf16.enabled=true" in message and "precision=fp32" in message


def test_concrete_values_that_agree_are_kept(tmp_path):
    raw = json.loads((DS_CONFIGS_DIR / "zero1.json").read_text())
    raw.update(train_micro_batch_size_per_gpu=8, gradient_clipping=1.0)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(raw))
    config = resolve(str(path))
    assert config["train_micro_batch_size_per_gpu"] == 8


def test_recipe_overrides_merge_into_the_json():
    config = resolve("zero2", "bf16", 2, 256, "deepspeed.overrides.zero_optimization.overlap_comm=false")
    assert config["zero_optimization"]["overlap_comm"] is False
    assert config["zero_optimization"]["stage"] == 2


def test_missing_config_lists_the_available_ones():
    with pytest.raises(ConfigError, match=r"no DeepSpeed config 'zero5'.*Available: zero0, zero1"):
        ds_config_file("zero5")


def test_unresolvable_auto_and_scheduler_are_errors(tmp_path):
    raw = json.loads((DS_CONFIGS_DIR / "zero1.json").read_text())
    raw["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}
    raw["zero_optimization"]["allgather_bucket_size"] = "auto"
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as error:
        resolve(str(path))
    assert "remove the 'scheduler' section" in str(error.value)
    assert "zero_optimization.allgather_bucket_size" in str(error.value)


def test_invalid_json_names_file_and_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "zero_optimization": {"stage": 1,}\n}\n')
    recipe = load_recipe("tiny_llama", [f"deepspeed.config={path}"])
    with pytest.raises(ConfigError, match=f"{path}: not valid JSON at line 2"):
        load_ds_config(recipe)


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_hf_trainer_fills_the_same_values(name, precision):
    """The same file through the HF Trainer's own "auto" filling (HfTrainerDeepSpeedConfig) gives the same
    config as train.py, so one set of files serves both. (At ZeRO-0 train.py turns bf16 into torch
    autocast, a documented difference.)"""
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    args = SimpleNamespace(world_size=2, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                           max_grad_norm=1.0, learning_rate=3.0e-3, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
                           weight_decay=0.1, save_on_each_node=False, fp16=False, fp16_full_eval=False,
                           bf16=precision == "bf16", bf16_full_eval=False, get_warmup_steps=lambda steps: 0)
    hf = HfTrainerDeepSpeedConfig(str(DS_CONFIGS_DIR / f"{name}.json"))
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=256)), num_training_steps=200)
    ours = resolve(name, precision, 2, 256)
    if name == "zero0" and precision == "bf16":
        assert ours.pop("torch_autocast") == {"enabled": True, "dtype": "bfloat16"}
        assert hf.config["bf16"]["enabled"] is True
        hf.config["bf16"]["enabled"] = False
    if name == "zero0":  # train.py states fp32 gradient accumulation, which the zero1-3 files state themselves
        ours.pop("data_types", None)
    if not name.endswith("_offload"):  # train.py names AdamW's kernel (torch's, fused on CUDA); the Trainer's is
        # DeepSpeed's FusedAdam. With offload both step with DeepSpeed's CPU Adam
        assert {key: ours["optimizer"]["params"].pop(key) for key in ("torch_adam", "fused")} == \
            {"torch_adam": True, "fused": False}
    assert '"auto"' not in json.dumps(hf.config)
    assert ours == hf.config
