"""An objective is one module and one name (docs/objectives.md): each known name has its training code, and a toy
objective added in a few lines trains. The toy computes the language model's loss itself, from the logits: its
losses must be the language model's (fused loss off, as the toy's traits ask)."""
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from data_pipeline.loader import model_inputs
from tests.conftest import SMALL_MODEL, save_small_checkpoint, train_in_process
from training.objectives.base import Objective, objective_class
from training.objectives.registry import SPECS
from training.objectives.lm.objective import LanguageModel
from training.objectives.spec import ObjectiveSpec


@pytest.mark.parametrize("recipe, overrides, off", [
    ("tiny_llama_dpo", [], True), ("tiny_llama_dpo", ["dpo.disable_dropout=false"], False),
    ("tiny_llama_grpo", ["grpo.beta=0"], False),
    ("tiny_llama_grpo", ["grpo.beta=0", "grpo.disable_dropout=true"], True)])
def test_dpo_and_grpo_start_with_the_models_dropout_as_trl_does_by_default(tmp_path, recipe, overrides, off):
    """TRL's defaults: DPO turns the dropout off, GRPO keeps it; each objective's disable_dropout says otherwise."""
    import train
    save_small_checkpoint(tmp_path / "base")
    plan = train.make_plan(train.parse_args(["--recipe", recipe, "--dry-run", f"model.name_or_path={tmp_path / 'base'}",
                                             "lora.enabled=true", *overrides]), world_size=1)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=16, n_head=2,
                                                                  vocab_size=64))
    engine = SimpleNamespace(module=model, device=torch.device("cpu"))
    objective_class(plan.recipe.training.spec)(plan).start(engine, None, None, False)
    assert {module.p for module in model.modules() if isinstance(module, torch.nn.Dropout)} == {0.0 if off else 0.1}


def test_every_objective_the_recipe_names_has_its_training_code():
    classes = {name: objective_class(spec) for name, spec in SPECS.items()}
    assert all(issubclass(cls, Objective) and cls.name == name for name, cls in classes.items())


class TokenLossFromLogits(LanguageModel):
    """The next-token loss, summed over the micro-batch's targets, computed from the model's logits."""
    name = "toy"

    def loss(self, engine, batch, per_micro_batch, shard):
        inputs = model_inputs(batch, engine.device, shard)
        labels = inputs.pop("labels")
        logits = engine(**inputs).logits[:, :-1].float()
        return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum") / per_micro_batch


@pytest.mark.slow
def test_a_toy_objective_added_in_a_few_lines_trains_as_the_language_model(tmp_path, data_cache, monkeypatch):
    monkeypatch.setitem(SPECS, "toy", ObjectiveSpec(name="toy", runtime=f"{__name__}:TokenLossFromLogits",
                                                    trains_on="documents", model_loss=False, rows_per_example=1,
                                                    unit="rows", examples="documents"))
    losses = {}
    for objective in ("lm", "toy"):
        out = tmp_path / objective
        result = train_in_process(["--recipe", "tiny_llama", "--output-dir", str(out), SMALL_MODEL, data_cache,
                                   f"training.objective={objective}", "fused_loss=false", "training.max_steps=3",
                                   "logging.every_steps=1", "checkpointing.every_steps=null"])
        assert result.returncode == 0, result.stderr[-3000:]
        losses[objective] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["toy"]) == 3 and losses["toy"] == pytest.approx(losses["lm"], rel=1e-5)
