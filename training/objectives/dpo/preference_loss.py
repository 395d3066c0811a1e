"""PreferenceLoss: a micro-batch of pairs' loss against the reference, and the sums the step's metrics (TRL's
rewards, log-probabilities and token metrics) are made of."""
from typing import NamedTuple

import deepspeed
import torch

from data_pipeline.loader import EvalPairBatches
from training.objectives.dpo.loss import pair_losses, sequence_logps, token_statistics
from training.objectives.dpo.spec import DpoSection
from training.parallel import distributed

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")  # means over pairs
PAIRS = len(METRICS)  # where PreferenceLoss's sums hold the pairs' count, after METRICS's sums
TOKEN_METRICS = ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy")  # means over target tokens:
# chosen and rejected, chosen, rejected, chosen


def model_inputs(batch: dict, device: torch.device) -> dict:
    return {name: batch[name].to(device, non_blocking=True) for name in ("input_ids", "position_ids")}


class PairLogps(NamedTuple):
    """A packed micro-batch's [pairs, 2] values (chosen, rejected)."""
    logps: torch.Tensor
    tokens: torch.Tensor  # target tokens
    statistics: torch.Tensor | None  # [pairs, 2, 3]: token_statistics' sums (the policy's; not the reference's)
    weights: torch.Tensor | None  # WPO's (dpo.use_weighting)


def pair_logps(model: torch.nn.Module, batch: dict, device: torch.device, ld_alpha: float | None = None,
               statistics: bool = False, weighting: bool = False) -> PairLogps:
    """The micro-batch's log-probabilities and token counts, and with `statistics` the tokens' (token_statistics),
    WPO's weights with `weighting` too."""
    logits = model(**model_inputs(batch, device)).logits
    labels, owners, count = batch["labels"].to(device), batch["sequence_index"].to(device), 2 * batch["pairs"]
    logps, tokens = sequence_logps(logits, labels, owners, count, ld_alpha)
    sums, weights = token_statistics(logits, labels, owners, tokens, weighting) if statistics else (None, None)
    return PairLogps(logps.view(-1, 2), tokens.view(-1, 2), None if sums is None else sums.view(-1, 2, 3),
                     None if weights is None else weights.view(-1, 2))


class PreferenceLoss:
    """The loss of a micro-batch of pairs, and the sums the step's metrics are made of. The pair losses are a mean over
    the global batch's pairs; the sft term (TRL's: the chosen completions' negative log-likelihood) a mean over its
    chosen completions' tokens, counted before the step (sft_per_micro_batch)."""

    def __init__(self, section: DpoSection, adapters_off: bool, reference_seconds: float | None,
                 live: torch.nn.Module | None = None):
        self.section, self.adapters_off, self.reference_seconds = section, adapters_off, reference_seconds
        self.live = live  # dpo.sync_ref_model's reference model, run beside each forward pass
        self.sums: torch.Tensor | None = None
        self.sft_weight = sum(weight for name, weight in section.losses if name == "sft")
        self.sft_per_micro_batch = 1.0  # the step's chosen tokens over micro-batches x ranks (Dpo.start_step)

    @staticmethod
    def count(batch: dict) -> int:
        """The pairs a micro-batch trains on (what its loss is a mean over)."""
        return int(batch["real"].sum())

    def reference(self, engine: deepspeed.DeepSpeedEngine, batch: dict) -> torch.Tensor:
        """The batch's stored reference values, the synced reference model's (sync_ref_model), or under LoRA the
        base's, adapters disabled."""
        if self.live is not None:
            with torch.no_grad():
                return pair_logps(self.live, batch, engine.device, self.section.ld_alpha)[0]
        if not self.adapters_off:
            return batch["reference"].to(engine.device, torch.float32)
        with torch.no_grad(), engine.module.disable_adapter():
            return pair_logps(engine.module, batch, engine.device, self.section.ld_alpha)[0]

    def terms(self, engine: deepspeed.DeepSpeedEngine, batch: dict) -> torch.Tensor:
        """[the summed pair loss, the chosen completions' summed log-probability, their target tokens] over the
        micro-batch's real pairs; the metrics' sums take the pairs in."""
        reference, section = self.reference(engine, batch), self.section
        policy, tokens, statistics, weights = pair_logps(engine, batch, engine.device, section.ld_alpha,
                                                         statistics=True, weighting=section.use_weighting)
        real = batch["real"].to(engine.device)
        losses, rewards = pair_losses(policy, reference, tokens, section, weights, real)
        self.add(policy.detach()[real], rewards[real], statistics[real], tokens[real])
        return torch.stack([losses[real].sum(), policy[real, 0].sum(), tokens[real, 0].sum()])

    def __call__(self, engine: deepspeed.DeepSpeedEngine, batch: dict, pairs_per_micro_batch: float) -> torch.Tensor:
        """This micro-batch's summed pair loss over pairs_per_micro_batch (see train.py's train_step), and the sft
        term's share."""
        pair_loss, chosen_logps, _ = self.terms(engine, batch)
        return pair_loss / pairs_per_micro_batch - self.sft_weight * chosen_logps / self.sft_per_micro_batch

    def add(self, policy: torch.Tensor, rewards: torch.Tensor, statistics: torch.Tensor, tokens: torch.Tensor) -> None:
        """The sums of the real pairs' metrics: each of METRICS's, the pairs, then TOKEN_METRICS's and their tokens."""
        sums = torch.stack([rewards[:, 0].sum(), rewards[:, 1].sum(), (rewards[:, 0] - rewards[:, 1]).sum(),
                            (rewards[:, 0] > rewards[:, 1]).float().sum(), policy[:, 0].sum(), policy[:, 1].sum(),
                            torch.tensor(float(len(policy)), device=policy.device),
                            statistics[..., 0].sum(), statistics[:, 0, 1].sum(), statistics[:, 1, 1].sum(),
                            statistics[:, 0, 2].sum(), tokens.sum(), tokens[:, 0].sum(), tokens[:, 1].sum()]).double()
        self.sums = sums if self.sums is None else self.sums + sums

    def start_step(self) -> None:
        self.sums = None

    def metrics(self, prefix: str = "") -> dict:
        """The means over every pair, or every target token, every rank has seen since start_step."""
        sums = distributed.all_reduce(self.sums.clone())
        pairs, (entropy, chosen_logits, rejected_logits, hits, tokens, chosen, rejected) = sums[PAIRS], sums[PAIRS + 1:]
        means = [*(sums[:PAIRS] / pairs), entropy / tokens, chosen_logits / chosen, rejected_logits / rejected,
                 hits / chosen]
        return {f"{prefix}{name}": mean.item() for name, mean in zip(METRICS + TOKEN_METRICS, means, strict=True)}

    def evaluate(self, engine: deepspeed.DeepSpeedEngine, batches: EvalPairBatches) -> dict:
        """eval_loss (the mean pair loss, and the sft term over every evaluation pair's chosen tokens) and the rewards
        over the evaluation pairs."""
        engine.eval()
        self.start_step()
        terms = torch.zeros(3, dtype=torch.float64, device=engine.device)
        with torch.no_grad():
            for batch in batches:
                terms += self.terms(engine, batch).double()
        engine.train()
        metrics = self.metrics("eval_")
        pair_loss, chosen_logps, chosen_tokens, pairs = distributed.all_reduce(
            torch.cat([terms, self.sums[PAIRS:PAIRS + 1]]))
        self.start_step()
        sft = -self.sft_weight * chosen_logps / chosen_tokens if self.sft_weight else 0.0
        return {"eval_loss": float(pair_loss / pairs + sft), **metrics}

    def summary(self) -> dict:
        return {"reference_pass_s": self.reference_seconds} if self.reference_seconds is not None else {}
