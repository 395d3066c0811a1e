"""An objective is one folder and one registry entry (docs/objectives.md): each known name has its training code, and
a toy objective with a settings section of its own, added in a few lines, trains. The toy computes the language
model's loss itself, from the logits, times its section's scale: at scale 1 its losses must be the language model's
(fused loss off, as the toy's spec asks), at scale 2 twice them. Its memory term, named by its spec, is in the plan."""
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from pydantic import PositiveFloat
from transformers import AutoConfig, AutoModelForCausalLM

import training.config.recipe as recipe_module
from data_pipeline.loader import model_inputs
from tests.conftest import SMALL_MODEL, save_small_checkpoint, train_in_process
from training.base.errors import ConfigError
from training.base.schema import StrictModel
from training.config.recipe import load_recipe
from training.objectives.base import Objective, objective_class
from training.objectives.lm.objective import LanguageModel
from training.objectives.registry import SPECS
from training.objectives.spec import ObjectiveSpec
from training.planning.objective_memory import ObjectiveMemory


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


class ToySection(StrictModel):
    """toy: the recipe section of the toy objective."""
    scale: PositiveFloat = 1.0  # the loss times this


class TokenLossFromLogits(LanguageModel):
    """The next-token loss, summed over the micro-batch's targets, computed from the model's logits, times toy.scale."""
    name = "toy"

    def loss(self, engine, batch, per_micro_batch, shard):
        inputs = model_inputs(batch, engine.device, shard)
        labels = inputs.pop("labels")
        logits = engine(**inputs).logits[:, :-1].float()
        loss = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum") / per_micro_batch
        return loss * self.plan.recipe.toy.scale


def toy_memory(recipe, precision, shape, stage, ranks) -> ObjectiveMemory:
    """The toy's memory term: a frozen fp32 copy of the model on each rank, as a reference would be held."""
    return ObjectiveMemory(reference=4.0 * shape.parameters)


TOY = ObjectiveSpec(name="toy", runtime=f"{__name__}:TokenLossFromLogits", trains_on="documents", model_loss=False,
                    rows_per_example=1, unit="rows", examples="documents", memory=f"{__name__}:toy_memory",
                    settings=ToySection)


def with_the_toy(monkeypatch, spec: ObjectiveSpec = TOY) -> None:
    """The toy's registry line, and the schema built with its section as the module builds it with the others'."""
    monkeypatch.setitem(SPECS, "toy", spec)
    monkeypatch.setattr(recipe_module, "Recipe", recipe_module.recipe_schema(SPECS))


def test_the_toys_section_is_validated_and_refused_under_another_objective(monkeypatch, tmp_path):
    with_the_toy(monkeypatch)
    assert load_recipe("tiny_llama", ["training.objective=toy", "toy.scale=2"]).toy.scale == 2
    with pytest.raises(ConfigError, match=r"toy.scale: Input should be greater than 0"):
        load_recipe("tiny_llama", ["training.objective=toy", "toy.scale=0"])
    with pytest.raises(ConfigError, match=r"toy.\* is set but training.objective is lm: set training.objective=toy"):
        load_recipe("tiny_llama", ["toy.scale=2"])


def test_the_plan_counts_the_toys_memory_term(monkeypatch):
    """The plan reaches an objective's memory only through its spec's `memory`: the toy's frozen copy is in its
    model states and in its peak (--dry-run's cell for its setting), beside the same toy's without the term."""
    import train
    from training.planning.memory import planned_model_states, planned_peak
    plans, states = {}, {}
    for memory in (None, TOY.memory):
        with_the_toy(monkeypatch, replace(TOY, memory=memory))
        plans[memory] = train.make_plan(train.parse_args(["--recipe", "tiny_llama", "--dry-run", SMALL_MODEL,
                                                          "training.objective=toy"]), world_size=1)
        states[memory] = planned_model_states(plans[memory])
    held = 4.0 * plans[None].shape.parameters
    assert states[TOY.memory].device_bytes == states[None].device_bytes + held
    assert planned_peak(plans[TOY.memory], states[TOY.memory]) == planned_peak(plans[None], states[None]) + held


@pytest.mark.slow
def test_a_toy_objective_added_in_a_few_lines_trains_as_the_language_model(tmp_path, data_cache, monkeypatch):
    with_the_toy(monkeypatch)
    losses = {}
    for objective, scale in (("lm", None), ("toy", 1), ("toy", 2)):
        out = tmp_path / f"{objective}{scale}"
        result = train_in_process(["--recipe", "tiny_llama", "--output-dir", str(out), SMALL_MODEL, data_cache,
                                   f"training.objective={objective}", "fused_loss=false", "training.max_steps=3",
                                   "logging.every_steps=1", "checkpointing.every_steps=null",
                                   *([f"toy.scale={scale}"] if scale else [])])
        assert result.returncode == 0, result.stderr[-3000:]
        losses[out.name] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["toy1"]) == 3 and losses["toy1"] == pytest.approx(losses["lmNone"], rel=1e-5)
    # the loss is scaled, the gradient with it: the first step's loss is twice, later ones follow another curve
    assert losses["toy2"][0] == pytest.approx(2 * losses["lmNone"][0], rel=1e-5)
