"""What a training objective is to the loop (train.py): the batches it trains on, the loss of a micro-batch and what
the loss is a mean over, what it does before step 1, the metrics of a logged step, its evaluation and what it adds to
summary.json. docs/objectives.md says how to add one."""
import deepspeed
import torch
from transformers import PretrainedConfig

from training.config.recipe import Recipe
from training.planning.plan import RunPlan


class Objective:
    """The language model's defaults where an objective has nothing of its own to add."""
    name = ""

    def __init__(self, plan: RunPlan):
        self.plan = plan

    @staticmethod
    def check(recipe: Recipe, model_config: PretrainedConfig) -> None:
        """What the objective refuses to train with this model and layout, before anything is built (a ConfigError
        that names the setting and the fix). The recipe's own checks of its section: training/config/recipe.py."""

    def batches(self, prepared, rank: int) -> tuple:
        """(training batches, evaluation batches or None) over the prepared data set, for data-parallel `rank`."""
        raise NotImplementedError

    def start(self, engine: deepspeed.DeepSpeedEngine, batches, evaluation, resume: bool) -> None:
        """What runs once the engine holds the starting (or resumed) weights, before step 1."""

    def count(self, batch: dict) -> int:
        """What a micro-batch's loss is a sum over (target tokens, pairs): the step's loss is its mean over the
        global batch."""
        raise NotImplementedError

    def start_step(self) -> None:
        """A new optimizer step begins (metrics sums restart)."""

    def loss(self, engine: deepspeed.DeepSpeedEngine, batch: dict, per_micro_batch: float,
             shard: tuple[int, int]) -> torch.Tensor:
        """The micro-batch's summed loss over `per_micro_batch` (the global count over micro-batches x ranks), so that
        DeepSpeed's averaging yields the global mean; `shard`: this rank's part of the rows under sequence
        parallelism."""
        raise NotImplementedError

    def metrics(self) -> dict:
        """A logged step's fields of the objective's own (every rank calls it)."""
        return {}

    def evaluate(self, engine: deepspeed.DeepSpeedEngine, evaluation, shard: tuple[int, int]) -> dict:
        """The evaluation's fields (eval_loss and the objective's own) over the evaluation batches."""
        raise NotImplementedError

    def summary(self) -> dict:
        """summary.json's fields of the objective's own."""
        return {}
