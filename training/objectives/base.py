"""What a training objective is to train.py and its loop (training/trainer.py): what it refuses, what it adds to the
plan, the batches it trains on, the loss of a micro-batch and what the loss is a mean over, what it does before step 1,
the metrics of a logged step and their console text, its evaluation, and what it adds to summary.json and its table.
docs/objectives.md says how to add one."""
from pathlib import Path

import deepspeed
import torch
from transformers import PretrainedConfig

from training.base.loader import load
from training.config.recipe import Recipe
from training.objectives.spec import ObjectiveSpec
from training.planning.plan import RunPlan


class Objective:
    """What every objective shares; where an objective has nothing of its own to add, nothing is added."""
    name = ""
    carried = ("eval_",)  # the prefixes of the last logged record's fields that summary.json keeps

    def __init__(self, plan: RunPlan):
        self.plan = plan

    @staticmethod
    def check(recipe: Recipe, model_config: PretrainedConfig | None, world_size: int | None = None,
              zero_stage: int | None = None) -> None:
        """What the objective refuses to train with this model and layout, before anything is built (a ConfigError
        that names the setting and the fix). The schema's checks of its section alone: training/config/recipe.py.
        `python -m data_pipeline` calls it with no model_config, world_size and zero_stage (its refusals of the data
        settings)."""

    @staticmethod
    def describe(plan: RunPlan) -> list[str]:
        """--dry-run's lines of the objective's own: its batch, and what it costs beside the training step."""
        raise NotImplementedError

    def batches(self, prepared, rank: int) -> tuple:
        """(training batches, evaluation batches or None) over the prepared data set, for data-parallel `rank`."""
        raise NotImplementedError

    def start(self, engine: deepspeed.DeepSpeedEngine, batches, evaluation, resume: bool) -> None:
        """What runs once the engine holds the starting (or resumed) weights, before step 1."""

    def step_batches(self, engine: deepspeed.DeepSpeedEngine, micro_batches: list[dict]) -> list[dict]:
        """The micro-batches a step trains on, from the data's: the same (lm, dpo), or what the model generates from
        them (grpo)."""
        return micro_batches

    def may_stop_after(self, data_position: int) -> bool:
        """Whether a stop asked for by SIGTERM may save and end the run once the data is at `data_position`, or
        must wait for a later step (grpo: the end of a generation, whose completions a checkpoint does not hold)."""
        return True

    def count(self, batch: dict) -> int:
        """What a micro-batch's loss is a sum over (target tokens, pairs): the step's loss is its mean over the
        global batch."""
        raise NotImplementedError

    def start_step(self, micro_batches: list[dict]) -> None:
        """A new optimizer step begins, on these micro-batches of this rank (metrics sums restart)."""

    def end_step(self, engine: deepspeed.DeepSpeedEngine, step: int, applied: bool) -> None:
        """Optimizer step `step` has ended; `applied`: it changed the weights (DeepSpeed or the stability guard may
        drop it). Every rank calls it."""

    def finish(self) -> None:
        """Training has ended, however it ended (the last step, a stop, an error): what the objective started is
        stopped (grpo: the vLLM server it started). Every rank calls it."""

    def state_dict(self) -> dict:
        """What the objective carries from step to step beyond the weights, as numbers (grpo: its adaptive entropy
        coefficient): saved in each checkpoint's run_state.json."""
        return {}

    def save(self, folder: Path) -> None:
        """The objective's files in a checkpoint's folder (grpo: a synced reference model). Every rank calls it,
        before run_state.json marks the checkpoint complete."""

    def restore(self, state: dict, folder: Path) -> None:
        """Back to a checkpoint, on --resume and on a rewind: the state_dict it saved ({} where none) and the files
        in its folder."""

    def loss(self, engine: deepspeed.DeepSpeedEngine, batch: dict, per_micro_batch: float,
             shard: tuple[int, int]) -> torch.Tensor:
        """The micro-batch's summed loss over `per_micro_batch` (the global count over micro-batches x ranks), so that
        DeepSpeed's averaging yields the global mean; `shard`: this rank's part of the rows under sequence
        parallelism."""
        raise NotImplementedError

    def metrics(self) -> dict:
        """A logged step's fields of the objective's own (every rank calls it)."""
        return {}

    def console(self, record: dict) -> str:
        """The console text of a logged step's (or evaluation's) fields of the objective's own."""
        return ""

    def evaluate(self, engine: deepspeed.DeepSpeedEngine, evaluation, shard: tuple[int, int]) -> dict:
        """The evaluation's fields (eval_loss and the objective's own) over the evaluation batches."""
        raise NotImplementedError

    def summary(self) -> dict:
        """summary.json's fields of the objective's own."""
        return {}

    def table(self, summary: dict) -> list[tuple[str, str]]:
        """The summary table's rows of the objective's own, from summary.json's fields."""
        return []


def objective_class(spec: ObjectiveSpec) -> type[Objective]:
    """The run-time class the spec names (its "module:Class"): loaded here, at the top of the import order, so that
    the schema, which holds the specs, never imports the run-time code."""
    return load(spec.runtime)
