"""GRPO's math as TRL 1.16's GRPOTrainer computes it (trl/trainer/grpo_trainer.py: _generate_and_score_completions
for the rewards and advantages, _compute_loss for the loss and its metrics), with TRL's names and defaults.

Rewards. F reward functions score N = prompts x num_generations completions, r[i, f] (NaN where a function returned
None); r_i = sum_f w_f r[i, f] over the values present (NaN where none is: the completion is unscorable).

Advantages. Over each prompt's group g of num_generations completions, NaN left out of every mean and std (std with
Bessel's correction):
    none:   A_i = r_i - mean_g(r)
    group:  A_i = (r_i - mean_g(r)) / (std_g(r) + 1e-4)
    batch:  A_i = (r_i - mean_g(r)) / (std(r) + 1e-4)      std over the whole generation batch, mean still the group's
and A_i = 0 where r_i is NaN. scale_rewards True is "group", False "none" (GRPOConfig's forms). With
multi_objective_aggregation "normalize_then_sum" (GDPO) each function's rewards are first normalized over the group,
n[i, f] = (r[i, f] - mean_g(r[., f])) / (std_g(r[., f]) + 1e-4), summed with the weights, s_i = sum_f w_f n[i, f]
(NaN where unscorable), and A_i = (s_i - mean(s)) / (std(s) + 1e-4) over the whole batch, scale_rewards unused.

Loss. Per completion token t (mask m_t), with rho_t = exp(logp_t - old_t) (old = logp detached when the samples
are on-policy, so rho = 1 but its gradient flows); with importance_sampling_level "sequence" (GSPO) one rho per
sequence, rho = exp(sum_t m (logp_t - old_t) / sum_t m), in every place rho_t appears below. clip(rho) =
clamp(rho, 1 - epsilon_low, 1 + epsilon_high), and delta (INTELLECT-2) caps the unclipped rho_t at delta.
    grpo, bnpo, dr_grpo, dapo, luspo:  p_t = -min(rho_t A, clip(rho_t) A)
    cispo:  p_t = -min(rho_t, epsilon_high) A logp_t       the capped ratio detached (MiniMax-M1)
    sapo:   p_t = -4 sigmoid(tau (rho_t - 1)) / tau A      tau = sapo_temperature_pos if A > 0 else _neg
    vespo:  p_t = -phi(w) A logp_t    w = exp(sum_t m (logp_t - old_t)) per sequence, phi(w) = e^lambda w^k
            e^(-lambda w), detached, (k, lambda) = vespo_k/lambda_pos if A >= 0 else _neg
    l_t = p_t o_i e_t + beta k_t,   k_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   (k3)
where k_t is multiplied by rho_t (before delta) when use_bias_correction_kl (TRL's default); o_i = 0 for a
completion with A < 0 whose mean old_t - logp_t is above off_policy_mask_threshold (DeepSeek-V3.2's off-policy
sequence mask; else 1), and with top_entropy_quantile q < 1 e_t = 1 only for tokens whose entropy is at least the
(1 - q) quantile of every rank's completion tokens in the micro-batch (Beyond the 80/20 Rule; else 1). A
micro-batch of B sequences gives
    grpo, sapo:  sum_i (sum_t m l / sum_t m) / B       each sequence's token mean, then the mean over sequences
    bnpo:        sum_it m l / sum_it m                 the micro-batch's token mean
    dr_grpo:     sum_it m l / (B x max_completion_length)
    luspo:       sum_it m l / B                        each sequence's sum: its length weighs (LUSPO)
    dapo, cispo, vespo:  sum_it m l / tokens_per_micro_batch     (dapo: TRL's default)

How a caller scales. grpo_loss returns a micro-batch's share such that the MEAN of the shares over the optimizer step's
micro-batches x data-parallel ranks is TRL's step loss: what DeepSpeed's averaging of gradients (1 / accumulation
steps, then the mean over ranks) computes, so pass the share to engine.backward as it is. (TRL's own per-micro-batch
loss is the share / gradient_accumulation_steps, its ranks averaged by DDP.) grpo, sapo, bnpo, dr_grpo and luspo are
normalized within the micro-batch, as TRL does: the step is a mean of micro-batch means, and micro-batches of
different token counts weigh the same. dapo, cispo and vespo need the step's count: tokens_per_micro_batch =
max(1, the completion tokens of the whole step, every micro-batch on every rank) / (micro-batches x ranks), which is
TRL's num_items_in_batch / num_processes x gradient_accumulation_steps / steps_per_generation when a generation batch
is an optimizer step's batch, and train.py's per_micro_batch when the objective counts completion tokens.

Metrics. grpo_loss returns each metric as [sum, count] over the micro-batch's completion tokens, or over its
sequences where the value is one per sequence (the clip ratios under GSPO, vespo's phi); TRL logs, per micro-batch,
the mean over all ranks (sum both over ranks, then metric_means), and the step's value is the mean over its
micro-batches. Names: kl (beta > 0), entropy, and clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean
(cispo: cispo_clip_ratio; vespo: vespo/phi_seq_mean; sapo: none). EXTREMES, clip_ratio/low_min and
clip_ratio/high_max, are the min and max over every rank's completions of their share of clipped tokens (one value
each, reduced by min and max over the ranks). With the entropy bonus (entropy_bonus: a coefficient c != 0, or
adaptive control, EntropyControl, where c moves after every step and the bonus stays on while c is 0) the share is
the policy loss above minus c x the mean entropy (with its gradient) over the tokens that take the policy loss
(e_t m_t), and policy_loss, the share without it, is logged as a mean over the ranks (TRL's, for dapo, cispo and
vespo, is it / accumulation steps).

The engine's mismatch (vllm_importance_sampling_correction, with generation_engine vllm: TRL's, for a sampler other
than the trainer). With s_t the engine's log-probability of the token it sampled, d_t = m_t (old_t - s_t) (0 where
s_t is unknown), r = exp(d_t) per token (token_* modes) or exp(sum_t d_t) per sequence (sequence_*); truncate clamps
r to [clip_min, clip_max], mask sets it to 0 outside them. l_t's policy part p_t o_i e_t is multiplied by r (not the
KL term); vespo instead adds log r (clamped to [log 1e-8, 20]) to log w and takes token modes only; the off-policy
mask reads s_t in place of old_t whenever the engine reports s_t. Metrics: sampling/sampling_logp_difference/mean
and /max of |old_t - s_t|, sampling/importance_sampling_ratio/min, /mean and /max of r over the completion tokens (or
the sequences); TRL logs them once per generation as the mean (min, max) of the ranks' values, here they are token
(sequence) means over every rank's micro-batch, the step's value the mean over its micro-batches, as the others.
"""
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # PPO's clipped ratio (and delta, where set)
STEP_TOKEN_MEAN = ("dapo", "cispo", "vespo")  # normalized by the step's completion tokens (tokens_per_micro_batch)
EXTREMES = {"clip_ratio/low_min": "min", "clip_ratio/high_max": "max",  # over every rank's sequences, not means
            "sampling/sampling_logp_difference/max": "max", "sampling/importance_sampling_ratio/min": "min",
            "sampling/importance_sampling_ratio/max": "max"}
SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
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


def normalized_sum_advantages(per_function: torch.Tensor, weights: Sequence[float] | torch.Tensor,
                              num_generations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO's advantages (multi_objective_aggregation "normalize_then_sum"): each function's rewards normalized over
    its group, their weighted sum normalized over the whole batch; and that batch std, per completion."""
    count = per_function.size(1)
    groups = per_function.view(-1, num_generations, count)
    std = nanstd(groups, dim=1).unsqueeze(1) if num_generations > 1 else torch.zeros_like(groups[:, :1])
    normalized = ((groups - groups.nanmean(dim=1, keepdim=True)) / (std + STD_EPSILON)).view(-1, count)
    weights = torch.as_tensor(weights, dtype=per_function.dtype, device=per_function.device)
    sums = (normalized * weights).nansum(dim=1).masked_fill(per_function.isnan().all(dim=1), torch.nan)
    batch_std = nanstd(sums).expand_as(sums) if sums.numel() > 1 else torch.zeros_like(sums)
    return ((sums - sums.nanmean()) / (batch_std + STD_EPSILON)).nan_to_num(nan=0.0), batch_std


def token_logps(logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float = 1.0,
                entropy_gradient: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of completion_ids [B, C] and the entropies of the distributions they were drawn
    from (without a gradient, a metric, unless entropy_gradient: the entropy bonus's), in fp32, at the sampling
    temperature (logits / temperature, as TRL's). logits [B, C, V] are those that predict each completion token: the
    model's at positions P - 1 .. P + C - 2 of prompt + completion."""
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    vocabulary = logps if entropy_gradient else logps.detach()
    entropies = -(vocabulary.exp() * vocabulary).sum(-1)
    return logps.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1), entropies


@dataclass(frozen=True)
class LossSettings:
    """The loss's settings, with GRPOConfig's names and defaults (epsilon_low is its `epsilon`)."""
    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    importance_sampling_level: str = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    max_completion_length: int = 512
    use_bias_correction_kl: bool = True
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0  # the coefficient this step applies (EntropyControl.applied under adaptive control)
    entropy_bonus: bool = False  # the loss has the bonus and its gradient (GrpoSection.entropy_bonus), also while
    # adaptive control applies a coefficient of 0
    vllm_importance_sampling_correction: bool = False  # TRL's default is True, for its vLLM runs only
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}: expected one of {LOSS_TYPES}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level={self.importance_sampling_level!r}: expected one of "
                             f"{IMPORTANCE_SAMPLING_LEVELS}")
        if self.vllm_importance_sampling_mode not in SAMPLING_MODES:
            raise ValueError(f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r}: expected one of "
                             f"{SAMPLING_MODES}")
        if self.loss_type == "vespo" and self.vllm_importance_sampling_correction and \
                not self.vllm_importance_sampling_mode.startswith("token_"):
            raise ValueError(f"loss_type='vespo' weighs its sequences itself: vllm_importance_sampling_mode must be "
                             f"token_truncate or token_mask, not {self.vllm_importance_sampling_mode!r}")


@dataclass
class EntropyControl:
    """TRL's adaptive entropy control (use_adaptive_entropy; Skywork-OR1): after every optimizer step the bonus's
    coefficient moves by `delta`, up (to at most `highest`) when the step's entropy was at or below `target`, down (to
    at least `lowest`) when above; a step applies the coefficient only while the previous step's entropy was at or
    below the target (none before the first). The step's entropy is the mean over the tokens the bonus acts on, of
    every micro-batch and rank, weighed by tokens (kept_tokens). Its state is saved with each checkpoint."""
    coef: float
    target: float
    delta: float
    lowest: float
    highest: float
    last_entropy: float | None = None  # the last step's; None: none measured yet (TRL's inf)

    def applied(self) -> float:
        return self.coef if self.last_entropy is not None and self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.highest)
        else:
            self.coef = max(self.coef - self.delta, self.lowest)
        self.last_entropy = entropy

    def state_dict(self) -> dict[str, float | None]:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}  # TRL's names

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        self.coef, self.last_entropy = state["entropy_coef"], state["last_world_entropy"]


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log(pi / pi_old) per token [B, C], or (GSPO) each sequence's token mean of it [B, 1]."""
    if level == "token":
        return log_ratio
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


@torch.no_grad()
def sampling_ratio(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor,
                   settings: LossSettings) -> torch.Tensor:
    """The engine mismatch's importance ratio, trainer over engine (the module's docstring): [B, C] in the token
    modes, [B, 1] in the sequence modes, truncated or masked to [clip_min, clip_max]."""
    difference = ((old - sampling) * mask).nan_to_num(nan=0.0)
    mode = settings.vllm_importance_sampling_mode
    ratio = torch.exp(difference.sum(-1, keepdim=True) if mode.startswith("sequence_") else difference)
    low, high = settings.vllm_importance_sampling_clip_min, settings.vllm_importance_sampling_clip_max
    if mode.endswith("_truncate"):
        return ratio.clamp(min=low, max=high) if low is not None or high is not None else ratio
    outside = (ratio < (-math.inf if low is None else low)) | (ratio > (math.inf if high is None else high))
    return ratio.masked_fill(outside, 0.0)


def sampling_metrics(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor,
                     ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """The engine mismatch's metrics, [sum, count] (or an extreme, EXTREMES: +-inf where there is no token)."""
    kept = mask.bool()
    difference = (old - sampling).abs()[kept & ~(old - sampling).isnan()]
    ratios = ratio.flatten() if ratio.size(1) == 1 else ratio[kept]
    return {"sampling/sampling_logp_difference/mean": torch.stack([difference.sum(),
                                                                   mask.new_tensor(float(difference.numel()))]),
            "sampling/sampling_logp_difference/max": difference.max() if difference.numel() else
            mask.new_tensor(-math.inf),
            "sampling/importance_sampling_ratio/min": ratios.min() if ratios.numel() else mask.new_tensor(math.inf),
            "sampling/importance_sampling_ratio/mean": metric_sum(ratio, mask),
            "sampling/importance_sampling_ratio/max": ratios.max() if ratios.numel() else mask.new_tensor(-math.inf)}


@torch.no_grad()
def gamma_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, settings: LossSettings,
                  sampling: torch.Tensor | None = None) -> torch.Tensor:
    """VESPO's phi(w) = e^lambda w^k e^(-lambda w) (phi(1) = 1) of each sequence's whole importance ratio
    w = exp(sum_t m log_ratio) (a sum, not a mean), times the engine mismatch's token ratios `sampling` where given,
    k and lambda by the advantage's sign; [B, 1], no gradient."""
    lowest = math.log(1e-8)
    log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if sampling is not None:  # outside the completion the ratio is 1 (its difference is 0): no mask needed
        log_w = log_w + sampling.log().clamp(lowest, 20.0).sum(-1, keepdim=True)
    log_w = log_w.clamp(lowest, 20.0)
    positive = advantages >= 0
    k = torch.where(positive, settings.vespo_k_pos, settings.vespo_k_neg)
    lam = torch.where(positive, settings.vespo_lambda_pos, settings.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def policy_term(per_token_logps: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, settings: LossSettings,
                sampling: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy's loss per token [B, C] (or per sequence [B, 1], GSPO's ratio) under settings.loss_type, and what
    TRL logs of it, by name (`sampling`: the engine mismatch's ratio, which vespo weighs its sequences by)."""
    loss_type, low, high = settings.loss_type, settings.epsilon_low, settings.epsilon_high
    if loss_type == "cispo":
        return (-ratio.clamp(max=high).detach() * advantages * per_token_logps,
                {"cispo_clip_ratio": (ratio > high) & (advantages > 0)})
    if loss_type == "sapo":
        temperatures = torch.where(advantages > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
        return -torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures * advantages, {}
    if loss_type == "vespo":
        phi = gamma_weights(advantages, log_ratio, mask, settings, sampling)
        return -phi * advantages * per_token_logps, {"vespo/phi_seq_mean": phi}
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    if settings.delta is not None:  # INTELLECT-2's two-sided clipping: the unclipped ratio capped at delta too
        ratio = ratio.clamp(max=settings.delta)
    below, above = (ratio < 1 - low) & (advantages < 0), (ratio > 1 + high) & (advantages > 0)
    return (-torch.min(ratio * advantages, clipped * advantages),
            {"clip_ratio/low_mean": below, "clip_ratio/high_mean": above, "clip_ratio/region_mean": below | above})


def off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor, old: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask [B, 1]: a completion with a negative advantage whose mean KL from the
    policy that sampled it, sum_t m (old_t - logp_t) / sum_t m, is above the threshold takes no policy loss."""
    kl = (old - per_token_logps.detach()).nan_to_num(nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def entropy_threshold(entropies: torch.Tensor, top_entropy_quantile: float) -> torch.Tensor:
    """The entropy at the (1 - top_entropy_quantile) quantile of the completion tokens' (those of every rank:
    `entropies` is their 1-d gather), above which tokens take the policy loss; infinite where there are none."""
    if entropies.numel() == 0:
        return entropies.new_tensor(math.inf)
    return torch.quantile(entropies.float(), 1 - top_entropy_quantile)


def kept_tokens(completion_mask: torch.Tensor, entropies: torch.Tensor | None,
                high_entropy: torch.Tensor | None) -> torch.Tensor:
    """The tokens that take the policy loss and the entropy bonus: the completion's, or with top_entropy_quantile < 1
    those at or above its threshold (high_entropy)."""
    if high_entropy is None:
        return completion_mask.float()
    return ((entropies.detach() >= high_entropy) & completion_mask.bool()).float()


def grpo_loss(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor | None,
              ref_per_token_logps: torch.Tensor | None, advantages: torch.Tensor, completion_mask: torch.Tensor,
              settings: LossSettings, tokens_per_micro_batch: float | None = None,
              entropies: torch.Tensor | None = None, high_entropy: torch.Tensor | None = None,
              sampling_per_token_logps: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's share of the step's loss (see the module's docstring for the formulas and how to scale), and
    its metrics, each [sum, count] over its tokens or sequences. Tensors are [B, C] (advantages [B]);
    old_per_token_logps None means on-policy; ref_per_token_logps is read only when beta > 0;
    tokens_per_micro_batch only by the loss types normalized by the step's tokens (STEP_TOKEN_MEAN); high_entropy
    (entropy_threshold's, of every rank's tokens) only with top_entropy_quantile < 1; sampling_per_token_logps (the
    engine's, NaN where unknown) by the off-policy mask and, vllm_importance_sampling_correction, the engine mismatch's
    correction, which needs them."""
    mask = completion_mask.to(per_token_logps.dtype)
    advantages = advantages.unsqueeze(1)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    log_ratio = per_token_logps - old
    ratio = torch.exp(importance_weights(log_ratio, mask, settings.importance_sampling_level))
    correction = None
    if settings.vllm_importance_sampling_correction:
        if sampling_per_token_logps is None:
            raise ValueError("vllm_importance_sampling_correction needs sampling_per_token_logps: the engine's")
        correction = sampling_ratio(old, sampling_per_token_logps, mask, settings)
    per_token_loss, logged = policy_term(per_token_logps, log_ratio, ratio, advantages, mask, settings,
                                         correction if settings.loss_type == "vespo" else None)
    if settings.off_policy_mask_threshold is not None:
        sampled = old if sampling_per_token_logps is None else sampling_per_token_logps
        per_token_loss = per_token_loss * off_policy_mask(advantages, per_token_logps, sampled, mask,
                                                          settings.off_policy_mask_threshold)
    kept = mask  # the tokens that take the policy loss (and the entropy bonus)
    if settings.top_entropy_quantile < 1.0:
        kept = kept_tokens(completion_mask, entropies, high_entropy).to(mask.dtype)
        per_token_loss = per_token_loss * kept
    if correction is not None and settings.loss_type != "vespo":
        per_token_loss = per_token_loss * correction
    if settings.beta != 0.0:
        log_ref_ratio = ref_per_token_logps - per_token_logps
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        if settings.use_bias_correction_kl:
            kl = kl * ratio
        per_token_loss = per_token_loss + settings.beta * kl
        logged["kl"] = kl

    loss = aggregate(per_token_loss, mask, settings, tokens_per_micro_batch)
    policy_loss = loss.detach()
    if settings.entropy_bonus:  # the mean entropy of the tokens that take the policy loss
        loss = loss - settings.entropy_coef * (entropies * kept).sum() / kept.sum().clamp(min=1.0)
    if entropies is not None:
        logged["entropy"] = entropies
    metrics = {name: metric_sum(value, mask) for name, value in logged.items()}
    if correction is not None:
        metrics.update(sampling_metrics(old, sampling_per_token_logps, mask, correction))
    if settings.entropy_bonus:
        metrics["policy_loss"] = torch.stack([policy_loss, mask.new_tensor(1.0)])  # averaged over the ranks
    if settings.loss_type in CLIPPED:  # a completion without tokens (NaN) is in neither extreme
        low, high = (sequence_means(logged[name], mask) for name in ("clip_ratio/low_mean", "clip_ratio/high_mean"))
        metrics.update({"clip_ratio/low_min": low.nan_to_num(nan=math.inf).min(),
                        "clip_ratio/high_max": high.nan_to_num(nan=-math.inf).max()})
    return loss, metrics


def aggregate(per_token_loss: torch.Tensor, mask: torch.Tensor, settings: LossSettings,
              tokens_per_micro_batch: float | None) -> torch.Tensor:
    """The micro-batch's share of the loss from its per-token (or per-sequence, [B, 1]) losses, as the loss type
    normalizes them (the module's docstring)."""
    masked = per_token_loss * mask  # [B, 1] per-sequence losses count once per token
    if settings.loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if settings.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if settings.loss_type == "dr_grpo":
        return masked.sum() / (mask.size(0) * settings.max_completion_length)
    if settings.loss_type == "luspo":
        return masked.sum(-1).mean()
    if tokens_per_micro_batch is None:  # dapo, cispo, vespo: STEP_TOKEN_MEAN
        raise ValueError(f"loss_type={settings.loss_type!r} needs tokens_per_micro_batch (the step's completion "
                         f"tokens / (micro-batches x ranks))")
    return masked.sum() / tokens_per_micro_batch


def metric_sum(value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum, count] of a logged value: over the completion tokens, or over the sequences where it has one value per
    sequence ([B, 1]: TRL's test of its shape)."""
    value = value.detach().to(mask.dtype)
    if value.size(1) == 1:
        return torch.stack([value.sum(), mask.new_tensor(float(value.size(0)))])
    return torch.stack([(value * mask).sum(), mask.sum()])


def sequence_means(value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A logged value's mean over each sequence's tokens [B] (NaN for one without tokens), or its one value."""
    value = value.detach().to(mask.dtype)
    return value.squeeze(1) if value.size(1) == 1 else (value * mask).sum(-1) / mask.sum(-1)


def metric_means(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """grpo_loss's metrics (reduced over ranks, where there are several: EXTREMES by their min or max, the others
    summed) as TRL logs them: the means over the tokens (or sequences), and the extremes (NaN where no sequence had
    a token)."""
    return {name: (value.item() if math.isfinite(value) else math.nan) if name in EXTREMES else
            (value[0] / value[1].clamp(min=1.0)).item() for name, value in sums.items()}
