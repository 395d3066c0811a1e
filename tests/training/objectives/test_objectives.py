"""An objective is one module and one name (docs/objectives.md): each known name has its training code, and a toy
objective added in a few lines trains. The toy computes the language model's loss itself, from the logits: its
losses must be the language model's (fused loss off, as the toy's traits ask)."""
import json

import pytest
import torch.nn.functional as F

import training.config.recipe as schema
from data_pipeline.loader import model_inputs
from tests.conftest import SMALL_MODEL, train_in_process
from training.objectives import OBJECTIVES
from training.objectives.lm import LanguageModel


def test_every_objective_the_recipe_names_has_its_training_code():
    assert set(OBJECTIVES) == set(schema.OBJECTIVES)
    assert all(cls.name == name for name, cls in OBJECTIVES.items())


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
    monkeypatch.setitem(schema.OBJECTIVES, "toy", schema.ObjectiveTraits(model_loss=False, rows_per_example=1,
                                                                         unit="rows", examples="documents"))
    monkeypatch.setitem(OBJECTIVES, "toy", TokenLossFromLogits)
    losses = {}
    for objective in ("lm", "toy"):
        out = tmp_path / objective
        result = train_in_process(["--recipe", "tiny_llama", "--output-dir", str(out), SMALL_MODEL, data_cache,
                                   f"training.objective={objective}", "fused_loss=false", "training.max_steps=3",
                                   "logging.every_steps=1", "checkpointing.every_steps=null"])
        assert result.returncode == 0, result.stderr[-3000:]
        losses[objective] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["toy"]) == 3 and losses["toy"] == pytest.approx(losses["lm"], rel=1e-5)
