"""training.objective=dpo, preference tuning: DPO's loss and its kin (TRL's loss types) on packed pairs, the reference
pass, and the rewards TRL logs.

Each sequence's log-probability is the sum of its completion tokens' log-probabilities (fp32), read from packed rows
by `sequence_index` (data_pipeline/preference.py). The reference is the starting model: its log-probabilities are
computed once, in a pass over the training and evaluation pairs before step 1, in the run's own DeepSpeed layout (no
second model in memory), and stored with the run (reference_logps.npz), which a resumed run reads again. Under LoRA
the reference is the base with the adapters disabled, computed beside each step's forward pass (no pass, no file).
With dpo.sync_ref_model (TR-DPO) it is a model of its own, run beside each step and mixed with the policy every
ref_model_sync_steps steps (training/objectives/reference.py: SyncedReference, saved with each checkpoint).

A pair's loss is one of TRL's loss types on its log-ratios to the reference (policy - reference, of chosen and of
rejected), or a weighted sum of several: with h = beta x (chosen's - rejected's), -log sigmoid(h) (sigmoid, DPO),
(h / beta - 1 / (2 beta))^2 on the per-token mean log-ratios (ipo, IPO), and the others of pair_loss. The step's loss
is the mean over the global batch's pairs; rewards are beta x (policy - reference) per sequence, as TRL logs them.
"""
from pathlib import Path

import deepspeed
import torch
from transformers import PretrainedConfig

from data_pipeline.loader import EvalPairBatches, PairBatches
from data_pipeline.prepare import pad_token_id
from training.base.errors import ConfigError
from training.config.recipe import Recipe
from training.models.model import disable_dropout
from training.objectives.base import Objective
from training.objectives.dpo.loss import chosen_targets, described_loss
from training.objectives.dpo.preference_loss import PreferenceLoss
from training.objectives.dpo.reference_logps import start_preference
from training.objectives.reference import SyncedReference, load_reference, reference_place, synced_note
from training.parallel import distributed
from training.planning.plan import RunPlan


class Dpo(Objective):
    """training.objective=dpo: preference pairs, the loss against the reference (PreferenceLoss), TRL's rewards."""
    name = "dpo"
    carried = ("eval_", "rewards/", "logps/", "logits/", "entropy", "mean_token_accuracy")

    def __init__(self, plan: RunPlan):
        super().__init__(plan)
        self.preference: PreferenceLoss | None = None
        self.synced: SyncedReference | None = None

    @staticmethod
    def check(recipe: Recipe, model_config: PretrainedConfig | None, world_size: int | None = None,
              zero_stage: int | None = None) -> None:
        data, tiles = recipe.data, recipe.long_context.logits_tile_tokens
        synced = recipe.dpo.sync_ref_model
        refused = [reason for condition, reason in (
            (synced and recipe.lora.enabled, "dpo.sync_ref_model with lora: the reference is the base with the "
                                             "adapters disabled, not a model of its own to mix the policy into (TRL "
                                             "refuses it alike)"),
            (synced and not recipe.model.name_or_path, "dpo.sync_ref_model from model.config alone: the reference is "
                                                       "the starting checkpoint, loaded again; set model.name_or_path"),
            (data.packing == "concat", "data.packing=concat: it would cut sequences across rows; use bfd (pairs "
                                       "packed whole) or none (one sequence per row)"),
            (data.long_documents == "split", "data.long_documents=split: a pair's sequence cut in two has no whole "
                                             "log-probability; use truncate or drop"),
            (bool(data.filters), "data.filters: the quality filters judge documents, not pairs; filter the sources "
                                 "first"),
            (tiles is not None, "long_context.logits_tile_tokens: the loss needs every sequence's log-probability, "
                                "which the tiled loss does not return")) if condition]
        if refused:
            raise ConfigError(f"training.objective=dpo does not support {refused[0]}")
        if model_config is not None and getattr(model_config, "output_router_logits", False):
            raise ConfigError("training.objective=dpo with the router's load-balancing loss: DPO's loss has no place "
                              "for it; set moe.aux_loss_coef=0")

    @staticmethod
    def describe(plan: RunPlan) -> list[str]:
        """Its batch (pairs) and what its reference costs."""
        training, seq_len, section = plan.recipe.training, plan.recipe.data.seq_len, plan.recipe.dpo
        if plan.recipe.lora.enabled:
            reference = ("the base with the adapters disabled: one more forward pass per micro-batch, without "
                         "gradients (2N FLOPs per token more than the training FLOPs below); no second model, no pass "
                         "before step 1")
        elif section.sync_ref_model:
            synced = synced_note(plan, section.ref_model_mixup_alpha, section.ref_model_sync_steps)
            reference = (f"{reference_place(plan)}, one more forward pass per micro-batch without gradients (2N FLOPs "
                         f"per token more than the training FLOPs below){synced}")
        else:
            reference = ("the starting model: one forward pass over every training and evaluation pair before step 1, "
                         "in this layout (2N FLOPs per token: a third of an epoch's 6N training FLOPs, at most a "
                         "training step's memory: no gradients, no second model), stored with the run (16 bytes per "
                         "pair)")
        return [f"batch: {training.micro_batch_size} pairs/rank x {plan.accumulation_steps} accumulation x "
                f"{plan.dims.dp_size} data-parallel ranks = {training.global_batch_size} pairs per step, each "
                f"micro-batch's 2 x {training.micro_batch_size} sequences packed into rows of {seq_len} tokens "
                f"(at most {2 * training.micro_batch_size} rows, which the memory below assumes)",
                f"DPO: loss {described_loss(section)}"
                f"{', each pair weighted by WPO (dpo.use_weighting)' if section.use_weighting else ''}, beta "
                f"{section.beta:g}; reference: {reference}"]

    def batches(self, prepared, rank: int) -> tuple[PairBatches, EvalPairBatches | None]:
        """Batches of pairs, packed when fetched."""
        data, training, plan = self.plan.recipe.data, self.plan.recipe.training, self.plan
        packing = (data.seq_len, pad_token_id(plan.tokenizer), data.packing)
        evaluation = EvalPairBatches(prepared["eval"], training.micro_batch_size, rank, plan.dims.dp_size, *packing,
                                     training.eval_max_rows) if "eval" in prepared else None
        return PairBatches(prepared["train"], training.micro_batch_size, plan.accumulation_steps, rank,
                           plan.dims.dp_size, training.seed, *packing), evaluation

    def start(self, engine: deepspeed.DeepSpeedEngine, batches: PairBatches, evaluation: EvalPairBatches | None,
              resume: bool) -> None:
        recipe, section = self.plan.recipe, self.plan.recipe.dpo
        if section.disable_dropout:
            disable_dropout(engine.module)
        if section.sync_ref_model:
            self.synced = SyncedReference(load_reference(self.plan, engine), section.ref_model_mixup_alpha,
                                          section.ref_model_sync_steps, "dpo.sync_ref_model")
        self.preference = start_preference(engine, section, recipe.lora.enabled, self.plan.output_dir, batches,
                                           evaluation, resume, live=self.synced.model if self.synced else None)

    def count(self, batch: dict) -> int:
        return PreferenceLoss.count(batch)

    def start_step(self, micro_batches: list[dict]) -> None:
        self.preference.start_step()
        if self.preference.sft_weight:  # the sft term's mean is over the global batch's chosen tokens
            chosen = distributed.all_reduce_on_host([sum(map(chosen_targets, micro_batches))])[0]
            self.preference.sft_per_micro_batch = chosen / (len(micro_batches) * self.plan.dims.dp_size)

    def loss(self, engine: deepspeed.DeepSpeedEngine, batch: dict, per_micro_batch: float,
             shard: tuple[int, int]) -> torch.Tensor:
        return self.preference(engine, batch, per_micro_batch)

    def end_step(self, engine: deepspeed.DeepSpeedEngine, step: int, applied: bool) -> None:
        if self.synced:
            self.synced.end_step(engine.module, step, applied)

    def save(self, folder: Path) -> None:
        if self.synced:
            self.synced.save(folder)

    def restore(self, state: dict, folder: Path) -> None:
        if self.synced:
            self.synced.restore(folder)

    def metrics(self) -> dict:
        return self.preference.metrics()

    def evaluate(self, engine: deepspeed.DeepSpeedEngine, evaluation: EvalPairBatches, shard: tuple[int, int]) -> dict:
        return self.preference.evaluate(engine, evaluation)

    def console(self, record: dict) -> str:
        return ((f"  reward margin {record['rewards/margins']:.3f}  accuracy {record['rewards/accuracies']:.0%}"
                 if "rewards/margins" in record else "")
                + (f"  eval loss {record['eval_loss']:.4f} (accuracy {record['eval_rewards/accuracies']:.0%})"
                   if "eval_loss" in record else ""))

    def summary(self) -> dict:
        return self.preference.summary()

    def table(self, summary: dict) -> list[tuple[str, str]]:
        return [*([("DPO reward margin / accuracy (last step)", f"{summary['rewards/margins']:.3f} / "
                    f"{summary['rewards/accuracies']:.0%}")] if "rewards/margins" in summary else []),
                *([("DPO eval loss / reward accuracy", f"{summary['eval_loss']:.4f} / "
                    f"{summary['eval_rewards/accuracies']:.0%}")] if "eval_rewards/accuracies" in summary else []),
                *([("DPO reference pass", f"{summary['reference_pass_s']:.1f} s")] if "reference_pass_s" in summary
                  else [])]
