"""DPO's formulas on a packed micro-batch's logits and its pairs' log-probabilities: each sequence's summed
log-probability and its token statistics (TRL's token metrics, WPO's weights), and TRL's loss types per pair
(docs/dpo.md has the formulas and their papers)."""
import math

import torch
import torch.nn.functional as F

from training.objectives.dpo.spec import DPO_CHUNK_TOKENS, SORTED_LOSSES, DpoSection


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
