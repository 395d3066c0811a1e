"""training.objective=lm: the next-token loss over the packed rows' target tokens (pretraining, SFT)."""
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from data_pipeline.curriculum import PhaseSchedule, phase_schedule, phase_steps, planned_table, prepared_labels
from data_pipeline.length_warmup import warmup_line
from data_pipeline.loader import EvalBatches, StepBatches, model_inputs, target_count
from training.base.errors import DataError
from training.loop.evaluation import evaluate
from training.objectives.base import Objective
from training.planning.plan import RunPlan


def phase_lengths(plan: RunPlan) -> list[int]:
    data, training = plan.recipe.data, plan.recipe.training
    return phase_steps(data.phases, training.max_steps, training.decay_steps(training.max_steps),
                       training.global_batch_size * data.seq_len)


def planned_phases(plan: RunPlan) -> list[str]:
    """--dry-run's data phases (data.phases), from the recipe's source labels (a prepared folder's are read)."""
    data = plan.recipe.data
    if not data.phases:
        return []
    labels = [source.key for source in data.sources] or prepared_labels(Path(data.prepared))
    return planned_table(data.phases, phase_lengths(plan), labels, plan.recipe.training.global_batch_size, data.seq_len)


def planned_warmup(plan: RunPlan) -> list[str]:
    """--dry-run's sequence lengths (data.seq_len_warmup)."""
    data = plan.recipe.data
    return [warmup_line(data.seq_len_warmup, data.seq_len, plan.recipe.training.micro_batch_size)] \
        if data.seq_len_warmup else []


def run_phases(plan: RunPlan, rows) -> PhaseSchedule:
    """The run's phase schedule over the prepared rows, its table printed once."""
    training = plan.recipe.training
    phases = phase_schedule(rows, plan.recipe.data.phases, phase_lengths(plan), training.global_batch_size,
                            training.seed)
    if dist.get_rank() == 0:
        print("\n".join(phases.table()), flush=True)
    return phases


class LanguageModel(Objective):
    name = "lm"
    row_batches: type[StepBatches] = StepBatches  # the training batches' class (distill's carry what seeds samples)

    @staticmethod
    def describe(plan: RunPlan) -> list[str]:
        training, seq_len, split = plan.recipe.training, plan.recipe.data.seq_len, plan.dims.sequence_parallel
        return [f"batch: {training.micro_batch_size} rows/rank x {plan.accumulation_steps} accumulation x "
                f"{plan.dims.dp_size} data-parallel ranks = {training.global_batch_size} rows x {seq_len} tokens = "
                f"{training.global_batch_size * seq_len:,} tokens per step"
                + (f"; each row split over {split} ranks, {seq_len // split:,} tokens each" if split > 1 else ""),
                *planned_phases(plan), *planned_warmup(plan)]

    def batches(self, prepared, rank: int) -> tuple[StepBatches, EvalBatches | None]:
        data, training, plan = self.plan.recipe.data, self.plan.recipe.training, self.plan
        row_length = len(prepared["train"][0]["input_ids"])
        if row_length != data.seq_len:
            raise DataError(f"data.prepared={data.prepared} holds rows of {row_length} tokens, but data.seq_len is "
                            f"{data.seq_len}; prepare again with this seq_len or set data.seq_len={row_length}")
        evaluation = EvalBatches(prepared["eval"], training.micro_batch_size, rank, plan.dims.dp_size,
                                 training.eval_max_rows) if "eval" in prepared else None
        phases = run_phases(self.plan, prepared["train"]) if data.phases else None
        if data.seq_len_warmup and dist.get_rank() == 0:
            print(warmup_line(data.seq_len_warmup, data.seq_len, training.micro_batch_size), flush=True)
        return self.row_batches(prepared["train"], training.micro_batch_size, plan.accumulation_steps, rank,
                                plan.dims.dp_size, training.seed, phases, data.seq_len_warmup), evaluation

    def count(self, batch: dict) -> int:
        return target_count(batch)

    def loss(self, engine: deepspeed.DeepSpeedEngine, batch: dict, per_micro_batch: float,
             shard: tuple[int, int]) -> torch.Tensor:
        return engine(**model_inputs(batch, engine.device, shard), num_items_in_batch=per_micro_batch).loss

    def evaluate(self, engine: deepspeed.DeepSpeedEngine, evaluation: EvalBatches, shard: tuple[int, int]) -> dict:
        return evaluate(engine, evaluation, shard)

    def console(self, record: dict) -> str:
        return (f"  eval loss {record['eval_loss']:.4f} (perplexity {record['eval_perplexity']:.1f})"
                if "eval_loss" in record else "")

    def table(self, summary: dict) -> list[tuple[str, str]]:
        return [("eval loss (perplexity)", f"{summary['eval_loss']:.4f} ({summary['eval_perplexity']:.1f})")] \
            if "eval_perplexity" in summary else []
