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
import math
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import PretrainedConfig

from training.base.errors import ConfigError, DataError
from data_pipeline.loader import EvalPairBatches, PairBatches
from data_pipeline.prepare import pad_token_id
from training.compat.datasets import fingerprint
from training.config.recipe import Recipe
from training.objectives.dpo.spec import SORTED_LOSSES, DpoSection
from training.models.model import disable_dropout
from training.objectives.base import Objective
from training.objectives.reference import SyncedReference, load_reference, reference_place, synced_note
from training.parallel import distributed
from training.planning.kernels import DPO_CHUNK_TOKENS
from training.planning.plan import RunPlan
from training.state.output_dir import REFERENCE_FILE

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")  # means over pairs
PAIRS = len(METRICS)  # where PreferenceLoss's sums hold the pairs' count, after METRICS's sums
TOKEN_METRICS = ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy")  # means over target tokens:
# chosen and rejected, chosen, rejected, chosen


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, sequence_index: torch.Tensor, count: int,
                   ld_alpha: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of `count` sequences' summed log-probability of its target tokens (each label predicted from the token
    before it), and its number of target tokens. `ld_alpha` (LD-DPO): the tokens past the shorter completion of the
    pair count `ld_alpha` times."""
    targets, owner = labels[:, 1:].reshape(-1), sequence_index[:, 1:].reshape(-1)
    token_logps = -F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets, reduction="none")
    taken = targets != -100
    owners, values = owner[taken], token_logps[taken]
    tokens = torch.zeros(count, dtype=torch.float32, device=logits.device).index_add_(0, owners,
                                                                                      torch.ones_like(values))
    if ld_alpha is not None:
        values = values * length_weights(owners, tokens, ld_alpha)
    logps = torch.zeros(count, dtype=torch.float32, device=logits.device).index_add_(0, owners, values)
    return logps, tokens


@torch.no_grad()
def token_statistics(logits: torch.Tensor, labels: torch.Tensor, sequence_index: torch.Tensor, tokens: torch.Tensor,
                     weighting: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pass over the target tokens' logits without a gradient, DPO_CHUNK_TOKENS tokens at a time (a chunk's fp32
    [tokens, vocab], not the batch's): each sequence's sums, over its target tokens, of the policy's entropy, of the
    mean of the logits over the vocabulary and of the tokens it ranks first ([sequences, 3]: TRL's entropy,
    logits/chosen and logits/rejected, and mean_token_accuracy); and with `weighting` each sequence's WPO weight
    (Zhou et al. 2024; TRL's use_weighting): the exponential of the mean, over its target tokens (`tokens`: each
    sequence's count, sequence_logps'), of log p(token) - log sum_v p(v)^2 under the policy, which weighs a sequence
    by how likely the policy is to produce it, relative to how peaked its distributions are (without ld_alpha's
    tails' weight, as TRL's)."""
    targets, owner = labels[:, 1:].reshape(-1), sequence_index[:, 1:].reshape(-1)
    positions = (targets != -100).nonzero().squeeze(-1)
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    sums = torch.zeros(len(tokens), 3, dtype=torch.float32, device=logits.device)
    aligned = torch.zeros_like(tokens) if weighting else None
    for chunk in positions.split(DPO_CHUNK_TOKENS):
        scores = flat[chunk].float()
        normalizer = scores.logsumexp(-1)
        probabilities = (scores - normalizer.unsqueeze(-1)).exp_()
        entropy = normalizer - (probabilities * scores).sum(-1)
        del probabilities  # the WPO terms' logsumexp is the pass's other peak: 12 bytes per token and entry
        hits = (scores.argmax(-1) == targets[chunk]).float()
        sums.index_add_(0, owner[chunk], torch.stack([entropy, scores.mean(-1), hits], dim=-1))
        if aligned is not None:  # log p(y) - log sum p^2 = l_y - lse(l) - (lse(2l) - 2 lse(l)), lse the logsumexp
            target = scores.gather(-1, targets[chunk].unsqueeze(-1)).squeeze(-1)
            aligned.index_add_(0, owner[chunk], target + normalizer - (2 * scores).logsumexp(-1))
    return sums, None if aligned is None else torch.exp(aligned / tokens.clamp(min=1))


def length_weights(owners: torch.Tensor, tokens: torch.Tensor, alpha: float) -> torch.Tensor:
    """LD-DPO's weight of each target token: 1 within the first min(chosen, rejected) tokens of its completion, alpha
    past them. `owners`: each target token's sequence, a completion's tokens one run in order (packed rows keep a
    sequence whole); `tokens`: each sequence's count."""
    _, runs = torch.unique_consecutive(owners, return_counts=True)
    position = torch.arange(len(owners), device=owners.device) - torch.repeat_interleave(runs.cumsum(0) - runs, runs)
    shared = tokens.view(-1, 2).min(dim=1).values.repeat_interleave(2)
    return torch.where(position < shared[owners], 1.0, alpha)


def f_divergence_scores(ratios: torch.Tensor, section: DpoSection) -> torch.Tensor:
    """f-DPO: the log-ratios u as f'(exp u) of the chosen f-divergence, which the losses of the reward difference take
    in their place (reverse KL, DPO's own: u itself)."""
    kind = section.f_divergence_type
    if kind == "forward_kl":
        return 1 - torch.exp(-ratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(ratios)
    alpha = section.f_alpha_divergence_coef
    if kind == "reverse_kl" or abs(alpha - 1) < 1e-6:  # alpha -> 1 is the reverse KL
        return ratios
    return (torch.exp(((alpha - 1) * ratios).clamp(max=80.0)) - 1) / (alpha - 1)  # exp(80) still fits fp32


def pair_loss(name: str, ratios: torch.Tensor, tokens: torch.Tensor, section: DpoSection) -> torch.Tensor:
    """One of TRL's loss types, per pair, from [pairs, 2] (chosen, rejected) log-ratios to the reference and token
    counts (docs/dpo.md has the formulas and their papers)."""
    beta, smoothing = section.beta, section.label_smoothing
    chosen, rejected = ratios[:, 0], ratios[:, 1]
    scores = f_divergence_scores(ratios, section)
    margin = beta * (scores[:, 0] - scores[:, 1])
    if name == "sigmoid":
        return -F.logsigmoid(margin)
    if name == "hinge":
        return torch.relu(1 - margin)
    if name in ("ipo", "sigmoid_norm"):  # on the per-token mean log-ratios
        means = scores / tokens.clamp(min=1)
        mean_margin = means[:, 0] - means[:, 1]
        return (mean_margin - 1 / (2 * beta)) ** 2 if name == "ipo" else -F.logsigmoid(beta * mean_margin)
    if name == "exo_pair":  # KL(softmax of the two rewards || (1 - eps, eps))
        return (torch.sigmoid(margin) * (F.logsigmoid(margin) - math.log1p(-smoothing))
                + torch.sigmoid(-margin) * (F.logsigmoid(-margin) - math.log(smoothing)))
    if name == "robust":
        return (-(1 - smoothing) * F.logsigmoid(margin) + smoothing * F.logsigmoid(-margin)) / (1 - 2 * smoothing)
    if name == "nca_pair":
        return -F.logsigmoid(beta * chosen) - 0.5 * F.logsigmoid(-beta * chosen) - 0.5 * F.logsigmoid(-beta * rejected)
    if name == "bco_pair":
        return -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)
    if name == "sppo_hard":
        return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
    if name == "apo_zero":  # the chosen are better than the model's own: chosen up, rejected down
        return 1 - torch.sigmoid(beta * chosen) + torch.sigmoid(beta * rejected)
    if name == "apo_down":  # the chosen are worse than the model's own: both down, the rejected more
        return torch.sigmoid(beta * chosen) + 1 - torch.sigmoid(margin)
    if name == "discopop":  # logistic and exponential losses, blended by the margin
        blend = torch.sigmoid(margin / section.discopop_tau)
        return -F.logsigmoid(margin) * (1 - blend) + torch.exp(-margin) * blend
    raise ValueError(f"dpo.loss={name!r}: not a loss type")


def described_loss(section: DpoSection) -> str:
    """`sigmoid`, or `0.8 x sigmoid + 0.2 x bco_pair`."""
    losses = section.losses
    if len(losses) == 1 and losses[0][1] == 1.0:
        return losses[0][0]
    return " + ".join(f"{weight:g} x {name}" for name, weight in losses)


def sorted_loss(name: str, policy: torch.Tensor, reference: torch.Tensor, real: torch.Tensor,
                section: DpoSection) -> torch.Tensor:
    """AOT's losses (Melnyk et al. 2024), on the micro-batch's real pairs (zero on its padding pairs): aot compares
    the sorted policy margins pi_c - pi_r with the sorted reference margins, aot_unpaired the sorted chosen log-ratios
    with the sorted rejected ones, position by position, each difference d in the label-smoothed sigmoid loss
    -(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d) (not robust's, which divides by 1 - 2 eps). The sort is
    over the micro-batch, as TRL's is over its per-device batch: which pairs share one matters."""
    if name == "aot":
        first, second = policy[:, 0] - policy[:, 1], reference[:, 0] - reference[:, 1]
    else:
        ratios = policy - reference
        first, second = ratios[:, 0], ratios[:, 1]
    delta = torch.sort(first[real]).values - torch.sort(second[real]).values
    margin, smoothing = section.beta * delta, section.label_smoothing
    losses = torch.zeros_like(first)
    losses[real] = -F.logsigmoid(margin) * (1 - smoothing) - F.logsigmoid(-margin) * smoothing
    return losses


def pair_losses(policy: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor, section: DpoSection,
                weights: torch.Tensor | None = None,
                real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair losses (the weighted sum of dpo.loss's; with WPO's [pairs, 2] `weights`, times the pair's two) and
    per-sequence rewards, from [pairs, 2] (chosen, rejected) log-probabilities and token counts; `real`: the pairs
    the sorted losses sort (default all)."""
    ratios = policy - reference
    rewards = section.beta * ratios.detach()
    losses = torch.zeros_like(ratios[:, 0])
    real = torch.ones_like(losses, dtype=torch.bool) if real is None else real
    for name, weight in section.losses:
        if name in SORTED_LOSSES:
            losses = losses + weight * sorted_loss(name, policy, reference, real, section)
        elif name != "sft":  # not a pair's: PreferenceLoss takes it over the batch's chosen tokens
            losses = losses + weight * pair_loss(name, ratios, tokens, section)
    if weights is not None:
        losses = losses * weights[:, 0] * weights[:, 1]
    return losses, rewards


def chosen_targets(batch: dict) -> int:
    """The target tokens of the real pairs' chosen completions in a packed micro-batch (what the sft term is a mean
    over), counted as sequence_logps counts them."""
    owner = batch["sequence_index"][:, 1:][batch["labels"][:, 1:] != -100]
    return int((batch["real"][owner // 2] & (owner % 2 == 0)).sum())


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


def training_layout(batches: PairBatches) -> Iterator[dict]:
    """Every training pair once, in this rank's micro-batches: first epoch 0's as the steps read them (the same
    packed rows, so that until the first update the policy's values equal the reference's exactly and step 1's
    rewards are 0, as TRL's), then the pairs that epoch 0 leaves out."""
    for position in range(batches.steps_per_epoch):
        yield from batches.micro_batches(position)
    left_out = batches.epoch_order(0)[batches.steps_per_epoch * batches.global_batch_size:]
    if len(left_out):
        yield from EvalPairBatches(batches.rows, batches.micro_batch_size, batches.dp_rank, batches.dp_size,
                                   batches.seq_len, batches.pad_id, batches.packing, indices=left_out)


def reference_pass(engine: deepspeed.DeepSpeedEngine, micro_batches: Iterable[dict], count: int,
                   ld_alpha: float | None) -> np.ndarray:
    """[count, 2] log-probabilities (chosen, rejected) of every pair under the engine's current weights: each
    data-parallel rank its share, gathered by a sum."""
    values = torch.zeros((count, 2), dtype=torch.float64, device=engine.device)
    engine.eval()
    with torch.no_grad():
        for batch in micro_batches:
            logps = pair_logps(engine, batch, engine.device, ld_alpha)[0].double()
            real = batch["real"].to(engine.device)
            values[batch["pair_index"].to(engine.device)[real]] = logps[real]
    engine.train()
    return distributed.all_reduce(values).cpu().numpy()


def start_preference(engine: deepspeed.DeepSpeedEngine, section: DpoSection, lora: bool, output_dir: Path,
                     batches: PairBatches, evaluation: EvalPairBatches | None, resume: bool,
                     live: torch.nn.Module | None = None) -> PreferenceLoss:
    """The loss, with every pair's reference values in `batches` (and `evaluation`): read from the run's
    reference_logps.npz when resuming, else computed now by the starting model and written there. Under LoRA, and
    with a `live` reference model (sync_ref_model), none."""
    if lora or live is not None:
        return PreferenceLoss(section, adapters_off=lora, reference_seconds=None, live=live)
    path, started = output_dir / REFERENCE_FILE, time.perf_counter()
    if resume:
        stored = read_reference(path, batches, section.ld_alpha)
    else:
        stored = {"train": reference_pass(engine, training_layout(batches), len(batches.rows), section.ld_alpha),
                  **({"eval": reference_pass(engine, evaluation, len(evaluation.rows), section.ld_alpha)}
                     if evaluation else {})}
        if dist.get_rank() == 0:
            partial = path.with_name(f"{path.stem}.partial.npz")
            np.savez(partial, data=np.array(fingerprint(batches.rows)), ld_alpha=np.array(ld_key(section.ld_alpha)),
                     **stored)
            os.replace(partial, path)  # a kill leaves the old file or the new one whole
    batches.reference = stored["train"]
    if evaluation:
        evaluation.reference = stored["eval"]
    return PreferenceLoss(section, adapters_off=False, reference_seconds=None if resume else
                          time.perf_counter() - started)


def ld_key(ld_alpha: float | None) -> str:
    """How reference_logps.npz records the ld_alpha its values were summed with."""
    return "null" if ld_alpha is None else repr(float(ld_alpha))


def read_reference(path: Path, batches: PairBatches, ld_alpha: float | None) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise DataError(f"{path} is missing: a resumed DPO run needs the reference log-probabilities its first start "
                        f"computed (the starting model's weights are gone from the checkpoints); start the run again "
                        f"without --resume, or, if it was started with dpo.sync_ref_model=true (its checkpoints hold "
                        f"the reference), resume with that")
    with np.load(path) as stored:
        if str(stored["data"]) != fingerprint(batches.rows) or len(stored["train"]) != len(batches.rows):
            raise DataError(f"{path} holds reference values for other prepared pairs than this run's: resume with the "
                            f"data the run started with")
        summed_with = str(stored["ld_alpha"]) if "ld_alpha" in stored.files else ld_key(None)
        if summed_with != ld_key(ld_alpha):
            raise ConfigError(f"{path} holds reference values summed with dpo.ld_alpha={summed_with}, not "
                              f"{ld_key(ld_alpha)}: resume with the ld_alpha the run started with")
        return {name: stored[name] for name in stored.files if name not in ("data", "ld_alpha")}


class Dpo(Objective):
    """training.objective=dpo: preference pairs, the loss against the reference (PreferenceLoss), TRL's rewards."""
    name = "dpo"
    carried = ("eval_", "rewards/", "logps/", "logits/", "entropy", "mean_token_accuracy")

    def __init__(self, plan: RunPlan):
        super().__init__(plan)
        self.preference: PreferenceLoss | None = None
        self.synced: SyncedReference | None = None

    @staticmethod
    def check(recipe: Recipe, model_config: PretrainedConfig | None, world_size: int | None = None) -> None:
        data, parallelism, tiles = recipe.data, recipe.parallelism, recipe.long_context.logits_tile_tokens
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
            (parallelism.pipeline_stages > 1, "parallelism.pipeline_stages > 1: the pipeline's last stage would need "
                                              "each pair's sequences and reference values"),
            (parallelism.tensor_parallel > 1, "parallelism.tensor_parallel > 1"),
            (parallelism.sequence_parallel > 1, "parallelism.sequence_parallel > 1: the loss is a function of each "
                                                "sequence's whole log-probability, which sequence parallelism splits "
                                                "across ranks"),
            (tiles is not None, "long_context.logits_tile_tokens: the loss needs every sequence's log-probability, "
                                "which the tiled loss does not return")) if condition]
        if refused:
            raise ConfigError(f"training.objective=dpo does not support {refused[0]}")
        if model_config is None:
            return
        if recipe.parallelism.expert_parallel > 1:
            raise ConfigError(f"parallelism.expert_parallel={recipe.parallelism.expert_parallel}:\n  DPO with expert "
                              f"parallelism is not built: use expert_parallel=1")
        if getattr(model_config, "output_router_logits", False):
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
                f"{plan.dp_size} data-parallel ranks = {training.global_batch_size} pairs per step, each micro-batch's "
                f"2 x {training.micro_batch_size} sequences packed into rows of {seq_len} tokens (at most "
                f"{2 * training.micro_batch_size} rows, which the memory below assumes)",
                f"DPO: loss {described_loss(section)}"
                f"{', each pair weighted by WPO (dpo.use_weighting)' if section.use_weighting else ''}, beta "
                f"{section.beta:g}; reference: {reference}"]

    def batches(self, prepared, rank: int) -> tuple[PairBatches, EvalPairBatches | None]:
        """Batches of pairs, packed when fetched."""
        data, training, plan = self.plan.recipe.data, self.plan.recipe.training, self.plan
        packing = (data.seq_len, pad_token_id(plan.tokenizer), data.packing)
        evaluation = EvalPairBatches(prepared["eval"], training.micro_batch_size, rank, plan.dp_size, *packing,
                                     training.eval_max_rows) if "eval" in prepared else None
        return PairBatches(prepared["train"], training.micro_batch_size, plan.accumulation_steps, rank, plan.dp_size,
                           training.seed, *packing), evaluation

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
            self.preference.sft_per_micro_batch = chosen / (len(micro_batches) * self.plan.dp_size)

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
