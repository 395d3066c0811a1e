"""GRPO's math as TRL 1.16's GRPOTrainer computes it (trl/trainer/grpo_trainer.py: _generate_and_score_completions
for the rewards and advantages, _compute_loss for the loss and its metrics), with TRL's names and defaults.

Rewards. F reward functions score N = prompts x num_generations completions, r[i, f] (NaN where a function returned
None); r_i = sum_f w_f r[i, f] over the values present (NaN where none is: the completion is unscorable).

Advantages. Over each prompt's group g of num_generations completions, NaN left out of every mean and std (std with
Bessel's correction):
    none:   A_i = r_i - mean_g(r)
    group:  A_i = (r_i - mean_g(r)) / (std_g(r) + 1e-4)
    batch:  A_i = (r_i - mean_g(r)) / (std(r) + 1e-4)      std over the whole generation batch, mean still the group's
and A_i = 0 where r_i is NaN. scale_rewards True is "group", False "none" (GRPOConfig's forms).

Loss. Per completion token t (mask m_t), with rho_t = exp(logp_t - old_t) (old = logp detached when the samples
are on-policy, so rho = 1 but its gradient flows) and clip(rho) = clamp(rho, 1 - epsilon_low, 1 + epsilon_high):
    l_t = -min(rho_t A, clip(rho_t) A) + beta k_t,   k_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   (k3)
where k_t is multiplied by rho_t when use_bias_correction_kl (TRL's default). A micro-batch of B sequences gives
    grpo:    sum_i (sum_t m l / sum_t m) / B         each sequence's token mean, then the mean over sequences
    bnpo:    sum_it m l / sum_it m                   the micro-batch's token mean
    dr_grpo: sum_it m l / (B x max_completion_length)
    dapo:    sum_it m l / tokens_per_micro_batch     (TRL's default)

How a caller scales. grpo_loss returns a micro-batch's share such that the MEAN of the shares over the optimizer step's
micro-batches x data-parallel ranks is TRL's step loss: what DeepSpeed's averaging of gradients (1 / accumulation
steps, then the mean over ranks) computes, so pass the share to engine.backward as it is. (TRL's own per-micro-batch
loss is the share / gradient_accumulation_steps, its ranks averaged by DDP.) grpo, bnpo and dr_grpo are normalized
within the micro-batch, as TRL does: the step is a mean of micro-batch means, and micro-batches of different token
counts weigh the same. dapo needs the step's count: tokens_per_micro_batch = max(1, the completion tokens of the
whole step, every micro-batch on every rank) / (micro-batches x ranks), which is TRL's num_items_in_batch /
num_processes x gradient_accumulation_steps / steps_per_generation when a generation batch is an optimizer step's
batch, and train.py's per_micro_batch when the objective counts completion tokens.

Metrics. grpo_loss returns sums over the micro-batch's completion tokens and their count ("tokens"); TRL logs, per
micro-batch, the token mean over all ranks (sum the sums over ranks, then metric_means), and the step's value is the
mean over its micro-batches. Names: kl (beta > 0), entropy, clip_ratio/low_mean, clip_ratio/high_mean,
clip_ratio/region_mean. Not built: importance_sampling_level="sequence", delta, top_entropy_quantile < 1, the entropy
bonus, vLLM's importance-sampling correction and the other loss types (cispo, sapo, luspo, vespo).
"""
from collections.abc import Sequence

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4  # TRL's, added to the std before dividing


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation with Bessel's correction, NaN left out; NaN where fewer than 2 values are present."""
    count = (~values.isnan()).sum(dim)
    squares = ((values - values.nanmean(dim, keepdim=True)) ** 2).nansum(dim)
    return torch.where(count > 1, squares / (count - 1), torch.nan).sqrt()


def weighted_rewards(per_function: torch.Tensor, weights: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """[N, F] rewards (NaN: the function had no opinion) to [N]: the weighted sum of the values present, NaN where
    no function scored the completion."""
    weights = torch.as_tensor(weights, dtype=per_function.dtype, device=per_function.device)
    rewards = (per_function * weights).nansum(dim=1)
    return rewards.masked_fill(per_function.isnan().all(dim=1), torch.nan)


def group_advantages(rewards: torch.Tensor, num_generations: int,
                     scale_rewards: str | bool = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage over its prompt's group (rewards in groups of num_generations consecutive
    completions), and the std it was scaled by, per completion (TRL logs frac_reward_zero_std from it; under "none"
    it is the group's, unused)."""
    scale_rewards = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: expected one of {SCALE_REWARDS}")
    groups = rewards.view(-1, num_generations)
    baseline = groups.nanmean(dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(groups, dim=1).repeat_interleave(num_generations) if num_generations > 1 else \
            torch.zeros_like(rewards)
    advantages = rewards - baseline
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    return advantages.nan_to_num(nan=0.0), std


def token_logps(logits: torch.Tensor, completion_ids: torch.Tensor,
                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of completion_ids [B, C] and the entropies of the distributions they were drawn
    from (no gradient: a metric), in fp32, at the sampling temperature (logits / temperature, as TRL's). logits
    [B, C, V] are those that predict each completion token: the model's at positions P - 1 .. P + C - 2 of
    prompt + completion."""
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropies = -(logps.detach().exp() * logps.detach()).sum(-1)
    return logps.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1), entropies


def grpo_loss(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor | None,
              ref_per_token_logps: torch.Tensor | None, advantages: torch.Tensor, completion_mask: torch.Tensor, *,
              loss_type: str = "dapo", beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
              max_completion_length: int = 512, tokens_per_micro_batch: float | None = None,
              use_bias_correction_kl: bool = True,
              entropies: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's share of the step's loss (see the module's docstring for the formulas and how to scale), and
    its metrics' sums over the completion tokens. Tensors are [B, C] (advantages [B]); old_per_token_logps None
    means on-policy; ref_per_token_logps is read only when beta > 0; tokens_per_micro_batch only by dapo."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: expected one of {LOSS_TYPES}")
    mask = completion_mask.to(per_token_logps.dtype)
    advantages = advantages.unsqueeze(1)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    ratio = torch.exp(per_token_logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(ratio * advantages, clipped * advantages)
    if beta != 0.0:
        log_ref_ratio = ref_per_token_logps - per_token_logps
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        if use_bias_correction_kl:
            kl = kl * ratio
        per_token_loss = per_token_loss + beta * kl

    masked = per_token_loss * mask
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (per_token_loss.size(0) * max_completion_length)
    else:  # dapo
        if tokens_per_micro_batch is None:
            raise ValueError("loss_type='dapo' needs tokens_per_micro_batch (the step's completion tokens / "
                             "(micro-batches x ranks))")
        loss = masked.sum() / tokens_per_micro_batch

    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    sums = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high}
    if beta != 0.0:
        sums["kl"] = kl
    if entropies is not None:
        sums["entropy"] = entropies
    metrics = {name: (value.detach().to(mask.dtype) * mask).sum() for name, value in sums.items()}
    return loss, {**metrics, "tokens": mask.sum()}


def metric_means(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """grpo_loss's metric sums (summed over ranks, where there are several) as TRL logs them: token means."""
    tokens = sums["tokens"].clamp(min=1.0)
    return {name: (value / tokens).item() for name, value in sums.items() if name != "tokens"}
