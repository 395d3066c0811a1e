"""GRPO's math against TRL 1.16's GRPOTrainer itself, built in-process on CPU around a small random Llama
(conftest's save_small_checkpoint), nothing generated:

- the loss, for every loss type, with GSPO's sequence-level ratio and with delta: two micro-batches of one optimizer
  step (gradient_accumulation_steps=2, one off-policy with old_per_token_logps, one on-policy without) go through
  TRL's _compute_loss and through the model's logits -> token_logps -> grpo_loss; each micro-batch's loss (ours / 2,
  DeepSpeed's averaging) within 1e-6, the step's accumulated gradient within 1e-5, and the metrics TRL records per
  micro-batch;
- adaptive entropy control: three optimizer steps of two micro-batches through _compute_loss (TRL updates its
  coefficient at the step's end, accelerate's sync_gradients) and through EntropyControl around grpo_loss, as
  training/objectives/grpo/objective.py runs them: each micro-batch's loss, and the coefficient and the step's entropy
  after each step;
- the advantages: _generate_and_score_completions with _generate stubbed to return fixed completions, two reward
  functions that return crafted values (None among them, a group whose rewards are all equal); TRL's advantages,
  frac_reward_zero_std and per-function rewards against score -> weighted_rewards -> group_advantages (or, GDPO's
  normalize_then_sum, normalized_sum_advantages).
"""
from dataclasses import replace

import pytest
import torch

from tests.conftest import save_small_checkpoint
from tests.helpers.trl_state import left_as_found
from training.objectives.grpo.loss import (
    STEP_TOKEN_MEAN,
    EntropyControl,
    LossSettings,
    entropy_threshold,
    group_advantages,
    grpo_loss,
    kept_tokens,
    metric_means,
    normalized_sum_advantages,
    sampling_ratio,
    token_logps,
    weighted_rewards,
)
from training.objectives.grpo.rewards import score

BATCH, ACCUMULATION, GENERATIONS, MAX_COMPLETION, TEMPERATURE = 4, 2, 4, 8, 0.7
EPSILON, EPSILON_HIGH, PAD = 0.2, 0.28, 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    save_small_checkpoint(path)
    return path


@pytest.fixture(autouse=True)
def restored():
    """TRL's Trainer seeds the global generators and sets accelerate's process-wide state: put them back."""
    with left_as_found():
        yield


def trainer(checkpoint, tmp_path, reward_funcs=None, **options):
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=BATCH,
                      gradient_accumulation_steps=ACCUMULATION, num_generations=GENERATIONS,
                      max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE,
                      **{"epsilon": EPSILON, "epsilon_high": EPSILON_HIGH, **options}, use_cpu=True, bf16=False,
                      fp16=False, report_to="none", save_strategy="no")
    rows = datasets.Dataset.from_list([{"prompt": "x"}] * BATCH * ACCUMULATION)
    built = GRPOTrainer(model=str(checkpoint), reward_funcs=reward_funcs or [lambda completions, **_: [0.0]],
                        args=args, train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(checkpoint))
    built.model.train()
    built.current_gradient_accumulation_steps = ACCUMULATION  # what Trainer's loop sets per step
    return built


def completion_logits(model, batch: dict) -> torch.Tensor:
    """The logits that predict each completion token, from the model's own forward (TRL's fused head not asked)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    prompt = batch["prompt_ids"].size(1)
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, prompt - 1:-1]


# old log-probabilities this far above the model's (ratios 0.64 to 1.65), per row of a micro-batch (advantages 1.3,
# -0.7, 0.4, -1.1): mixed, the whole row below 1 - epsilon, the whole row above 1 + epsilon_high, and ratios of 1.65
# (above delta 1.5) and 0.64 alternating. Token ratios are clipped where the advantage's sign makes it count and
# where it does not, and so are sequence ratios (GSPO's: the mean over a completion's tokens).
OLD_OFFSETS = torch.tensor([[-0.5, 0.5, -0.1, 0.3, 0.1, -0.35], [0.4] * 6, [-0.3] * 6, [-0.5, 0.45] * 3])


def micro_batch(model, generator: torch.Generator, completion_lengths: list[int], off_policy: bool,
                beta: float) -> dict:
    """Left-padded prompts, right-padded completions, advantages of both signs, old log-probabilities OLD_OFFSETS
    off the model's and reference ones a random 0.5 nats (std) off (both zero on padding, as TRL's are)."""
    prompt_mask = torch.tensor([[0] * (5 - n) + [1] * n for n in [5, 3, 4, 2]])
    completion_mask = (torch.arange(6)[None] < torch.tensor(completion_lengths)[:, None]).long()
    batch = {"prompt_ids": torch.randint(4, 4096, (BATCH, 5), generator=generator).masked_fill(prompt_mask == 0, PAD),
             "prompt_mask": prompt_mask, "completion_mask": completion_mask,
             "completion_ids": torch.randint(4, 4096, (BATCH, 6), generator=generator).masked_fill(
                 completion_mask == 0, PAD),
             "advantages": torch.tensor([1.3, -0.7, 0.4, -1.1])}
    with torch.no_grad():
        logps = token_logps(completion_logits(model, batch), batch["completion_ids"], TEMPERATURE)[0]
    if off_policy:
        batch["old_per_token_logps"] = (logps + OLD_OFFSETS) * completion_mask
    if beta:
        batch["ref_per_token_logps"] = (logps + 0.5 * torch.randn(logps.shape, generator=generator)) * completion_mask
    return batch


def gradients(model) -> list[torch.Tensor]:
    found = [parameter.grad.clone() for parameter in model.parameters()]
    model.zero_grad(set_to_none=True)
    return found


# (loss_type, beta, other GRPOConfig settings): every loss type, the four of them named in the issue with and without
# the KL term; GSPO (grpo at the sequence level), LUSPO at its level and dapo at the one TRL warns of; delta; the
# off-policy sequence mask (row 1's mean KL 0.4 with a negative advantage is dropped); the top half of the tokens by
# entropy; the KL without the ratio; the entropy bonus (over the tokens that take the policy loss)
LOSSES = [(loss_type, beta, {}) for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo") for beta in (0.0, 0.04)] + [
    ("cispo", 0.04, {"epsilon_high": 1.2}), ("sapo", 0.04, {}), ("vespo", 0.04, {}),
    ("grpo", 0.04, {"importance_sampling_level": "sequence"}),
    ("luspo", 0.04, {"importance_sampling_level": "sequence"}),
    ("dapo", 0.0, {"importance_sampling_level": "sequence"}), ("dapo", 0.04, {"delta": 1.5}),
    ("dapo", 0.04, {"off_policy_mask_threshold": 0.1}), ("grpo", 0.04, {"top_entropy_quantile": 0.5}),
    ("bnpo", 0.04, {"use_bias_correction_kl": False}), ("grpo", 0.04, {"entropy_coef": 0.05}),
    ("dapo", 0.0, {"entropy_coef": 0.05, "top_entropy_quantile": 0.5})]


@pytest.mark.parametrize("loss_type, beta, options", LOSSES,
                         ids=["-".join([t, f"beta{b:g}", *map(str, o.values())]) for t, b, o in LOSSES])
def test_loss_gradient_and_metrics_equal_trl(checkpoint, tmp_path, loss_type, beta, options):
    theirs = trainer(checkpoint, tmp_path, loss_type=loss_type, beta=beta, **options)
    model, generator = theirs.model, torch.Generator().manual_seed(0)
    batches = [micro_batch(model, generator, [6, 2, 4, 1], True, beta), micro_batch(model, generator, [3, 6, 1, 5],
                                                                                  False, beta)]
    step_tokens = sum(batch["completion_mask"].sum() for batch in batches)
    for batch in batches:
        batch["num_items_in_batch"] = step_tokens  # TRL's: the completion tokens of the generation batch

    trl_losses = []
    for batch in batches:
        loss = theirs._compute_loss(model, batch)
        loss.backward()
        trl_losses.append(loss.item())
    trl_gradients, trl_metrics = gradients(model), theirs._metrics["train"]

    # cispo's and vespo's losses weigh the log-probabilities themselves (about -8 here, where float32's spacing is 1e-6
    # and TRL's forward rounds apart from ours), the others ratios near 1
    tolerance = 1e-5 if loss_type in ("cispo", "vespo") else 1e-6
    settings = LossSettings(loss_type=loss_type, beta=beta, epsilon_low=EPSILON,
                            **{"epsilon_high": EPSILON_HIGH, **options}, max_completion_length=MAX_COMPLETION,
                            entropy_bonus="entropy_coef" in options)
    for index, batch in enumerate(batches):
        logps, entropies = token_logps(completion_logits(model, batch), batch["completion_ids"], TEMPERATURE,
                                       entropy_gradient=settings.entropy_bonus)
        share, sums = grpo_loss(logps, batch.get("old_per_token_logps"), batch.get("ref_per_token_logps"),
                                batch["advantages"], batch["completion_mask"], settings,
                                tokens_per_micro_batch=float(step_tokens) / ACCUMULATION, entropies=entropies,
                                high_entropy=entropy_threshold(entropies[batch["completion_mask"].bool()],
                                                               settings.top_entropy_quantile))
        (share / ACCUMULATION).backward()  # DeepSpeed's averaging over the step's micro-batches (one rank)
        assert share.item() / ACCUMULATION == pytest.approx(trl_losses[index], abs=tolerance), f"micro-batch {index}"
        means = metric_means(sums)
        assert set(means) == set(trl_metrics) - {"entropy_coef"}  # a setting, logged by the objective (objective.py)
        if loss_type in STEP_TOKEN_MEAN and "policy_loss" in means:  # TRL's is its micro-batch loss there: / steps
            means["policy_loss"] /= ACCUMULATION
        for name, value in means.items():
            assert value == pytest.approx(trl_metrics[name][index], abs=1e-6), f"{name}, micro-batch {index}"
    for theirs_gradient, ours in zip(trl_gradients, gradients(model)):
        torch.testing.assert_close(ours, theirs_gradient, rtol=0, atol=1e-5)
    assert max(gradient.abs().max() for gradient in trl_gradients) > 1e-2, "a gradient worth comparing"
    clipped = [name for name in ("clip_ratio/region_mean", "cispo_clip_ratio") if name in trl_metrics]
    assert all(any(value > 0 for value in trl_metrics[name]) for name in clipped), "clipping exercised"


@pytest.mark.parametrize("target, quantile", [(100.0, 1.0), (100.0, 0.5), (0.2, 1.0)],
                         ids=["entropy-below-target", "below-target-top-half", "entropy-above-target"])
def test_adaptive_entropy_control_equals_trl(checkpoint, tmp_path, target, quantile):
    """Below the target the coefficient rises from step 1 and applies from step 2 (TRL's first step has no previous
    entropy); above it, it falls and never applies. With top_entropy_quantile 0.5 the step's entropy is the kept
    tokens' (kept_tokens), a token-weighted mean over both micro-batches, compared with TRL's to 1e-6."""
    options = {"entropy_coef": 0.1, "use_adaptive_entropy": True, "entropy_target": target,
               "entropy_coef_delta": 0.03, "entropy_coef_min": 0.02, "entropy_coef_max": 0.15,
               "top_entropy_quantile": quantile}
    theirs = trainer(checkpoint, tmp_path, loss_type="grpo", beta=0.0, **options)
    model, generator = theirs.model, torch.Generator().manual_seed(0)
    batches = [micro_batch(model, generator, [6, 2, 4, 1], True, 0.0), micro_batch(model, generator, [3, 6, 1, 5],
                                                                                 False, 0.0)]
    settings = LossSettings(loss_type="grpo", epsilon_low=EPSILON, epsilon_high=EPSILON_HIGH,
                            max_completion_length=MAX_COMPLETION, entropy_coef=0.1, entropy_bonus=True,
                            top_entropy_quantile=quantile)
    control = EntropyControl(0.1, target, 0.03, 0.02, 0.15)
    coefficients = []
    for step in range(3):
        window = torch.zeros(2)
        for index, batch in enumerate(batches):
            theirs.accelerator.gradient_state._set_sync_gradients(index == len(batches) - 1)
            trl_loss = theirs._compute_loss(model, batch)
            logps, entropies = token_logps(completion_logits(model, batch), batch["completion_ids"], TEMPERATURE,
                                           entropy_gradient=True)
            mask = batch["completion_mask"]
            high = entropy_threshold(entropies[mask.bool()], quantile) if quantile < 1 else None
            share, _ = grpo_loss(logps, batch.get("old_per_token_logps"), None, batch["advantages"], mask,
                                 replace(settings, entropy_coef=control.applied()), entropies=entropies,
                                 high_entropy=high)
            assert share.item() / ACCUMULATION == pytest.approx(trl_loss.item(), abs=1e-6), (step, index)
            kept = kept_tokens(mask, entropies, high)
            window += torch.stack([(entropies.detach() * kept).sum(), kept.sum()])
        control.update((window[0] / window[1]).item())
        assert control.last_entropy == pytest.approx(theirs._last_world_entropy, abs=1e-6), step
        assert control.coef == pytest.approx(theirs.entropy_coef, abs=1e-12), step
        coefficients.append(control.coef)
    model.zero_grad(set_to_none=True)
    assert coefficients == pytest.approx([0.13, 0.15, 0.15] if target > 1 else [0.07, 0.04, 0.02])  # both bounds
    assert theirs._metrics["train"]["entropy_coef"] == pytest.approx(coefficients)


def reward_a(prompts, completions, a, **_):
    return a


def reward_b(prompts, completions, b, **_):
    return b


# per row (two groups of 4): row 1 only b, row 2 only a, row 5 neither (unscorable); the second group's rewards are
# all equal (zero std)
A = [1.0, None, 0.0, 1.0, 0.5, None, 0.5, 0.5]
B = [0.2, 0.3, None, 2.0, None, None, None, None]


@pytest.mark.parametrize("scale_rewards, aggregation", [(scale, "sum_then_normalize") for scale in
                                                        ("group", "batch", "none", True, False)]
                         + [("group", "normalize_then_sum")])
def test_advantages_equal_trl(checkpoint, tmp_path, scale_rewards, aggregation):
    weights = [1.0, 0.5]
    theirs = trainer(checkpoint, tmp_path, reward_funcs=[reward_a, reward_b], reward_weights=weights,
                     scale_rewards=scale_rewards, multi_objective_aggregation=aggregation)
    rows = [{"prompt": "x", "a": a, "b": b} for a, b in zip(A, B)]
    completions = [f"completion {i}" for i in range(len(rows))]
    theirs._generate = lambda prompts: ([[5, 6]] * len(rows), [[7, 8, 2]] * len(rows), None, completions, None,
                                        {}, None, None)
    output = theirs._generate_and_score_completions(rows)

    per_function = score([reward_a, reward_b], ["x"] * len(rows), completions, {"a": A, "b": B}, "a test")
    trl_per_function = torch.tensor([theirs._logs["rewards"][name] for name in ("reward_a", "reward_b")]).T
    torch.testing.assert_close(per_function, trl_per_function, equal_nan=True, rtol=0, atol=0)
    if aggregation == "normalize_then_sum":
        advantages, std = normalized_sum_advantages(per_function, weights, GENERATIONS)
    else:
        advantages, std = group_advantages(weighted_rewards(per_function, weights), GENERATIONS, scale_rewards)
    torch.testing.assert_close(advantages, output["advantages"], rtol=1e-6, atol=1e-6)
    assert torch.isclose(std, torch.zeros_like(std)).float().mean().item() == \
        theirs._metrics["train"]["frac_reward_zero_std"][0]
    assert advantages[5] == 0, "an unscorable completion has no advantage"


@pytest.mark.parametrize("loss_type, settings, same_as", [
    ("cispo", {"epsilon_high": 5.0}, "dapo"), ("vespo", {}, "dapo"), ("sapo", {}, "grpo"),
    ("grpo", {"importance_sampling_level": "sequence"}, "grpo")])
def test_on_the_policy_the_other_loss_types_take_dapos_or_grpos_step(loss_type, settings, same_as):
    """With the samples on the policy (num_iterations 1, no old log-probabilities) every ratio is 1: cispo (its cap
    above 1) and vespo (phi(1) = 1) take dapo's gradient, sapo (its gate's slope at 1 is 1) and GSPO grpo's. Their
    differences act on off-policy samples only, which is why a comparison of them needs num_iterations > 1."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 50, generator=generator, requires_grad=True)
    completion_ids = torch.randint(0, 50, (4, 6), generator=generator)
    mask = torch.arange(6)[None] < torch.tensor([6, 2, 4, 1])[:, None]
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1])

    def gradient(settings: LossSettings) -> torch.Tensor:
        logps, entropies = token_logps(logits, completion_ids, TEMPERATURE)
        loss, _ = grpo_loss(logps, None, None, advantages, mask, settings, tokens_per_micro_batch=6.5,
                            entropies=entropies)
        return torch.autograd.grad(loss, logits)[0]

    theirs = gradient(LossSettings(loss_type=same_as))
    torch.testing.assert_close(gradient(LossSettings(loss_type=loss_type, **settings)), theirs, rtol=1e-6, atol=1e-7)
    assert theirs.abs().max() > 1e-3


def reward_by_index(completions, **_):
    return [float(index % 3) for index in range(len(completions))]


# (loss type, mode, other settings): each of TRL's four modes, clip_min among them; vespo, which weighs by the token
# ratios itself; the off-policy mask, which reads the engine's log-probabilities
CORRECTIONS = [("grpo", mode, {}) for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")]\
    + [("grpo", "token_mask", {"vllm_importance_sampling_clip_min": 0.8}),
       ("dapo", "sequence_truncate", {"vllm_importance_sampling_clip_min": 0.5}), ("vespo", "token_truncate", {}),
       ("dapo", "token_truncate", {"off_policy_mask_threshold": 0.05})]


@pytest.mark.parametrize("loss_type, mode, options", CORRECTIONS,
                         ids=["-".join([t, m, *map(str, o.values())]) for t, m, o in CORRECTIONS])
def test_engine_mismatch_correction_equals_trl(checkpoint, tmp_path, loss_type, mode, options):
    """TRL's vLLM importance-sampling correction: _generate_and_score_completions with _generate stubbed to return
    completions and an engine's log-probabilities of them (the trainer's +- about 0.7 nats, one unknown: vLLM's None),
    use_vllm set after construction (nothing is generated); its ratio, its sampling/* metrics and _compute_loss's loss
    against sampling_ratio and grpo_loss given the same log-probabilities, on the policy (TRL computes old_logps with
    the same model: ours are the logps detached)."""
    theirs = trainer(checkpoint, tmp_path, reward_funcs=[reward_by_index], loss_type=loss_type,
                     vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode, **options)
    theirs.use_vllm = True
    model, generator = theirs.model, torch.Generator().manual_seed(1)
    lengths = [3, 5, 2, 6, 4, 1, 6, 5]
    completions = [torch.randint(4, 4096, (n,), generator=generator).tolist() for n in lengths]
    batch = {"prompt_ids": torch.tensor([[5, 6]] * len(lengths)), "prompt_mask": torch.ones(len(lengths), 2).long(),
             "completion_mask": (torch.arange(6)[None] < torch.tensor(lengths)[:, None]).long()}
    batch["completion_ids"] = torch.tensor([ids + [PAD] * (6 - len(ids)) for ids in completions])
    with torch.no_grad():
        logps = token_logps(completion_logits(model, batch), batch["completion_ids"], TEMPERATURE)[0]
    sampling = logps + 0.7 * torch.randn(logps.shape, generator=generator)
    sampling[3, 2] = torch.nan
    sampled = [[None if value != value else value for value in row[:n].tolist()] for row, n in zip(sampling, lengths)]
    theirs._generate = lambda prompts: ([[5, 6]] * len(lengths), completions, None, ["c"] * len(lengths), sampled,
                                        {}, None, None)
    output = theirs._generate_and_score_completions([{"prompt": "x"}] * len(lengths))
    trl_loss = theirs._compute_loss(model, output).item()
    trl_metrics = {name: values[0] for name, values in theirs._metrics["train"].items() if name.startswith("sampling/")}

    settings = LossSettings(loss_type=loss_type, epsilon_low=EPSILON, epsilon_high=EPSILON_HIGH,
                            max_completion_length=MAX_COMPLETION, vllm_importance_sampling_correction=True,
                            vllm_importance_sampling_mode=mode, **options)
    mask = batch["completion_mask"]
    ratio = sampling_ratio(logps, sampling, mask, settings)
    torch.testing.assert_close(ratio, output["importance_sampling_ratio"], rtol=1e-5, atol=1e-6)
    assert (ratio == (0.0 if mode.endswith("mask") else settings.vllm_importance_sampling_clip_max)).any() or \
        loss_type == "vespo", "the bounds exercised"
    logps, entropies = token_logps(completion_logits(model, batch), batch["completion_ids"], TEMPERATURE)
    share, sums = grpo_loss(logps, None, None, output["advantages"], mask, settings,
                            tokens_per_micro_batch=float(mask.sum()) / ACCUMULATION, entropies=entropies,
                            sampling_per_token_logps=sampling)
    assert share.item() / ACCUMULATION == pytest.approx(trl_loss, abs=1e-5)
    means = metric_means(sums)
    assert set(trl_metrics) == {name for name in means if name.startswith("sampling/")}
    for name, value in trl_metrics.items():
        assert means[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_without_the_correction_the_engines_logps_reach_only_the_off_policy_mask():
    """vllm_importance_sampling_correction false: the engine's log-probabilities change nothing but the off-policy
    mask (TRL's, which reads them whenever vLLM reports them); with it, a loss needs them."""
    generator = torch.Generator().manual_seed(0)
    logps = torch.randn(4, 6, generator=generator) - 2
    sampling, mask = logps + 0.5, torch.ones(4, 6)
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1])
    plain = LossSettings(loss_type="grpo")
    assert grpo_loss(logps, None, None, advantages, mask, plain, sampling_per_token_logps=sampling)[0] == \
        grpo_loss(logps, None, None, advantages, mask, plain)[0]
    masked = LossSettings(loss_type="grpo", off_policy_mask_threshold=0.1)
    assert grpo_loss(logps, None, None, advantages, mask, masked, sampling_per_token_logps=sampling)[0] != \
        grpo_loss(logps, None, None, advantages, mask, masked)[0]
    with pytest.raises(ValueError, match="needs sampling_per_token_logps"):
        grpo_loss(logps, None, None, advantages, mask, LossSettings(vllm_importance_sampling_correction=True),
                  tokens_per_micro_batch=6.0)
    with pytest.raises(ValueError, match="token_truncate or token_mask"):
        LossSettings(loss_type="vespo", vllm_importance_sampling_correction=True)
