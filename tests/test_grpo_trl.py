"""train.py's GRPO (training.objective=grpo) against TRL 1.16's GRPOTrainer, step by step: the same checkpoint,
prompts, reward functions and settings, and the same completions on both sides (generation stubbed: ours
training.objectives.grpo.objective.sample, TRL's _generate_single_turn, so that TRL's own prompt tokenization, decoding,
truncation detection and length metrics still run), fp32, one rank, ZeRO-0, 3 optimizer steps. Ours packs each
micro-batch's completions into rows (data.packing=bfd), TRL runs one per row: the same numbers.

The prompts are exactly one global batch (2 prompts x 4 generations), so every step sees both prompts on both sides;
TRL's data set is given in the order ours draws them in, unshuffled. One case generates both prompts' groups at once
for 2 steps of one group each (generation_batch_size, TRL's as ours: steps_per_generation 2), one generation's steps
only (at the next epoch ours draws them in a new order, TRL's unshuffled sampler in the same). A completion is
chosen by (its prompt's token ids, its index in the group): some end with EOS, some are cut at
max_completion_length, of different lengths. Two reward functions (exact_answer and length_penalty, weighted 1 and
0.5) give rewards that differ within each group.

What is matched, and how (tolerance 1e-5 throughout: absolute, relative for grad_norm; measured at most 5.4e-6,
the masked case's grad_norm):
- loss: TRL logs the sum of its micro-batches' losses (each already scaled for accumulation, loss_is_scaled_for_ga)
  over a logging window of one step, that is the step's loss; ours logs the mean of the shares, the same;
- grad_norm: both the norm before clipping (transformers' clip_grad_norm_, ours zero0_grad_norm); the first step's is
  above grad_clip, so clipping shapes the later steps (an off-policy step whose tokens are mostly clipped may fall
  below it);
- the optimizer: torch's AdamW on both sides, the same hyper-parameters, a constant learning rate. TRL's is built here
  over our parameter groups (training/planning/shape.py weight_decay_groups): the HF Trainer also decays the
  embeddings, which ours does not (a choice of ours, documented there), and weight decay is on;
- kl (beta > 0; the reference the checkpoint loaded again on both sides), entropy, clip_ratio/{low,high,region}_mean
  (cispo: cispo_clip_ratio; vespo: vespo/phi_seq_mean): per micro-batch token means (sequence means under GSPO's
  sequence-level ratio), and clip_ratio/low_min and high_max, the extremes over the completions, averaged over the
  step's micro-batches on both sides, each logged by both sides or neither;
- the loss types beyond the issue's four (cispo, sapo, luspo, vespo), GSPO's importance_sampling_level=sequence,
  GDPO's multi_objective_aggregation=normalize_then_sum, mask_truncated_completions, the entropy bonus (with GSPO;
  policy_loss and entropy_coef logged) and its adaptive control (the coefficient moving every step), a reference
  synced to the policy every step (sync_ref_model), and (together) the off-policy sequence mask and
  use_bias_correction_kl=false, in cases with num_iterations=2, so that the off-policy step's
  ratios count; delta is set in one of them (tests/training/objectives/grpo/test_loss.py proves it against TRL where
  it changes the loss). top_entropy_quantile is proven there only: this random model's token entropies lie within
  2e-3 of each other, and the 1e-6 by which TRL's forward and ours round them apart reorders neighbours at the
  quantile (seen: step 2's threshold token differs);
- a reward model beside the functions (a sequence classifier with one label, from its path on both sides: TRL's
  AutoModelForSequenceClassification, ours training/objectives/grpo/rewards.py RewardModel): its rewards/judge/* equal;
  and a function of TRL's whole signature (tests/helpers/trl_rewards.py: completion_ids, trainer_state's
  global_step, a metric through log_metric, a completions column through log_extra): its rewards and metrics equal;
- reward, rewards/<fn>/{mean,std}, frac_reward_zero_std, completions/*: of the generation; TRL logs them only on
  steps that generate (with num_iterations=2 every other step), ours repeats them: compared where TRL has them;
- gradient accumulation 2 (dapo): TRL shuffles the generation batch before cutting it into micro-batches
  (shuffle_sequence_dict); made the identity here so that each micro-batch is one prompt's group on both sides
  (dapo's loss and gradient do not depend on the cut, the per-micro-batch metric means do);
- num_iterations=2, or generation_batch_size of 2 steps: TRL generates every steps_per_generation x num_iterations
  = 2 steps and takes the old log-probabilities at generation time (as gradient_accumulation_steps % 2 != 0), as
  ours does; with generation_batch_size dapo divides each step by the generation's tokens over its 2 steps;
- TRL's GRPOConfig turns gradient checkpointing on by default: off here (the same numbers, half the time).

reward_std: TRL 1.16's std over the whole generation's rewards (this test found ours logging the mean of the groups'
stds).
"""
import json

import pytest
import torch

from tests.conftest import save_small_checkpoint, save_small_reward_model, train_in_process
from tests.helpers.trl_state import left_as_found

GENERATIONS, MAX_COMPLETION, TEMPERATURE, STEPS = 4, 6, 0.7, 3
# lr 5e-3: enough for the policy to move (KL up to about 1, three quarters of the off-policy tokens clipped); at 2e-2
# Adam's first steps turn the two layouts' fp32 rounding of gradient entries near zero into weights 2e-5 apart, and
# the third step's grad_norm differs by 1.4e-5 relative
LR, WEIGHT_DECAY, BETAS, EPS, GRAD_CLIP, EPSILON, EPSILON_HIGH = 5e-3, 0.1, (0.9, 0.99), 1e-8, 1.0, 0.2, 0.28
PROMPTS = [{"prompt": "17+25=", "answer": "42"}, {"prompt": "3+4=", "answer": "7"}]
# per prompt, the completions of its group by index: (text, ends with EOS); the others are cut at
# MAX_COMPLETION tokens
COMPLETIONS = {"17+25=": [(" 42", True), (" 41", True), (" 42 is the sum of the two numbers", False), ("42", True)],
               "3+4=": [(" 7", True), (" 7 and then some more words follow", False), (" 8", True),
                        (" 7 and more", True)]}
REWARDS = [("exact_answer", {}, 1.0), ("length_penalty", {"target": 4}, 0.5)]
GENERATION_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/exact_answer/mean",
                      "rewards/exact_answer/std",
                      "rewards/length_penalty/mean", "rewards/length_penalty/std", "completions/mean_length",
                      "completions/min_length", "completions/max_length", "completions/clipped_ratio",
                      "completions/mean_terminated_length", "completions/min_terminated_length",
                      "completions/max_terminated_length")
LOSS_METRICS = ("entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "clip_ratio/low_min", "clip_ratio/high_max", "cispo_clip_ratio", "vespo/phi_seq_mean",
                "policy_loss", "entropy_coef")  # those of them that TRL logs for the case


CASES = [  # loss_type, beta, num_iterations, gradient accumulation steps, other settings (the same names on both sides)
    pytest.param("grpo", 0.04, 1, 1, {}, id="grpo-beta0.04"),
    pytest.param("dr_grpo", 0.0, 2, 1, {}, id="dr_grpo-beta0-iterations2"),
    pytest.param("dapo", 0.04, 1, 2, {}, id="dapo-beta0.04-accumulation2"),
    pytest.param("bnpo", 0.04, 2, 1, {}, id="bnpo-beta0.04-iterations2"),
    pytest.param("grpo", 0.04, 2, 2, {"importance_sampling_level": "sequence", "entropy_coef": 0.05},
                 id="gspo-entropy-bonus-beta0.04-iterations2-acc2"),
    pytest.param("cispo", 0.0, 2, 2, {"epsilon_high": 1.1}, id="cispo-iterations2-accumulation2"),
    pytest.param("sapo", 0.04, 2, 1, {}, id="sapo-beta0.04-iterations2"),
    pytest.param("luspo", 0.0, 2, 1, {"importance_sampling_level": "sequence"}, id="luspo-iterations2"),
    pytest.param("vespo", 0.0, 2, 2, {}, id="vespo-iterations2-accumulation2"),
    pytest.param("dapo", 0.0, 2, 1, {"delta": 1.3, "multi_objective_aggregation": "normalize_then_sum",
                                     "mask_truncated_completions": True}, id="dapo-delta-gdpo-masked-iterations2"),
    pytest.param("bnpo", 0.04, 2, 2, {"off_policy_mask_threshold": 0.05, "use_bias_correction_kl": False},
                 id="bnpo-opsm-iterations2-accumulation2"),
    # the coefficient rises by 0.05 after every step (the entropy is below the target) and applies from step 2:
    # entropy_coef logged 0.15, 0.2, 0.25 on both sides; a resume restores it (tests/test_grpo.py)
    # the reference mixed with the policy after every step (TR-DPO): steps 2 and 3 take their KL to the mixed one
    pytest.param("grpo", 0.04, 1, 1, {"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.6},
                 id="grpo-sync-ref-model-beta0.04"),
    pytest.param("grpo", 0.0, 1, 2, {"use_adaptive_entropy": True, "entropy_coef": 0.1, "entropy_target": 100.0,
                                     "entropy_coef_delta": 0.05}, id="grpo-adaptive-entropy-accumulation2"),
    # one generation of both prompts' groups for 2 optimizer steps of one group each (TRL's steps_per_generation 2):
    # step 2 is off the policy, and dapo divides each step by the generation's tokens / 2
    pytest.param("dapo", 0.04, 1, 1, {"generation_batch_size": 8}, id="dapo-beta0.04-generation-of-2-steps"),
    # two more rewards: a reward model (a sequence classifier with one label, TRL's reward_funcs given its path), and
    # a function of TRL's whole signature (completion_ids, trainer_state, log_metric, log_extra)
    pytest.param("grpo", 0.04, 1, 1, {"more_rewards": True}, id="grpo-reward-model-trl-arguments-beta0.04"),
]
JUDGE_WEIGHT = 0.1  # the reward model's: its random scores span about 20
PROGRESS = "tests.helpers.trl_rewards:progress"


def steps_of(settings: dict) -> tuple[int, int]:
    """(completions per optimizer step, steps): every prompt's group for STEPS steps, or with generation_batch_size
    one group a step for the 2 steps of one generation (past it our epoch order and TRL's unshuffled one part)."""
    generation = len(PROMPTS) * GENERATIONS
    return (generation // 2, 2) if "generation_batch_size" in settings else (generation, STEPS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    save_small_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "judge"
    save_small_reward_model(path)
    return path


def our_order() -> list[int]:
    """The order our run draws the prompts in, its first epoch's (data_pipeline/loader.py), which TRL's data set is
    given in, unshuffled: both sides then take the same prompts at each step of the first epoch."""
    import datasets

    from data_pipeline.loader import PromptBatches
    return list(PromptBatches(datasets.Dataset.from_list(PROMPTS), 1, 0, 1, seed=1234, num_iterations=1,
                              num_generations=2).epoch_order(0))


def completion_table(tokenizer) -> dict[tuple[int, ...], list[list[int]]]:
    """Per prompt's token ids (as both sides tokenize a string prompt: with BOS), its group's completion ids."""
    table = {}
    for prompt, group in COMPLETIONS.items():
        ids = []
        for text, ends in group:
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
            if ends:
                assert len(tokens) < MAX_COMPLETION
                ids.append(tokens + [tokenizer.eos_token_id])
            else:
                assert len(tokens) > MAX_COMPLETION
                ids.append(tokens[:MAX_COMPLETION])
                assert ids[-1][-1] not in (tokenizer.eos_token_id, tokenizer.pad_token_id)
        table[tuple(tokenizer(prompt)["input_ids"])] = ids
    return table


def fixed_completions(table, prompt_ids: list) -> list[list[int]]:
    """The completion of each row: prompts come num_generations times in a row on both sides."""
    return [table[tuple(int(t) for t in ids)][row % GENERATIONS] for row, ids in enumerate(prompt_ids)]


def recipe_yaml(base, prompts, cache, loss_type, beta, iterations, accumulation, settings, judge=None) -> str:
    rewards = ", ".join([f"{{function: {name}, params: {json.dumps(params)}, weight: {weight}}}"
                         for name, params, weight in REWARDS]
                        + ([f"{{model: {judge}, weight: {JUDGE_WEIGHT}}}", f"{{function: '{PROGRESS}'}}"]
                           if judge else []))
    batch, steps = steps_of(settings)
    return f"""
model: {{name_or_path: {base}}}
data: {{sources: [{{path: {prompts}}}], seq_len: 32, packing: bfd, dedup: {{exact: false}}, cache_dir: {cache}}}
training: {{objective: grpo, micro_batch_size: {batch // accumulation}, global_batch_size: {batch},
           max_steps: {steps}, lr: {LR}, schedule: constant, warmup_steps: 0, weight_decay: {WEIGHT_DECAY},
           betas: {list(BETAS)}, eps: {EPS}, grad_clip: {GRAD_CLIP}, seed: 1234}}
grpo: {{num_generations: {GENERATIONS}, max_completion_length: {MAX_COMPLETION}, temperature: {TEMPERATURE},
       beta: {beta}, epsilon: {EPSILON}, loss_type: {loss_type}, scale_rewards: group, num_iterations: {iterations},
       rewards: [{rewards}], {json.dumps({"epsilon_high": EPSILON_HIGH, **settings})[1:-1]}}}
deepspeed: {{config: zero0}}
precision: fp32
logging: {{every_steps: 1, report_to: []}}
checkpointing: {{every_steps: null}}
stability: {{enabled: false}}
"""


def our_logs(tmp_path, monkeypatch, base, loss_type, beta, iterations, accumulation, settings,
             judge=None) -> list[dict]:
    from transformers import AutoTokenizer

    import training.objectives.grpo.objective as grpo
    table = completion_table(AutoTokenizer.from_pretrained(base))

    def sample(model, prompts, seeds, section, eos_id, pad_id, synced, tokenizer=None):
        completions = fixed_completions(table, prompts)
        return ([torch.tensor(ids) for ids in completions],
                [ids[-1] != eos_id and len(ids) == section.max_completion_length for ids in completions])

    monkeypatch.setattr(grpo, "sample", sample)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_yaml(base, data, tmp_path / "cache", loss_type, beta, iterations, accumulation,
                                  settings, judge))
    result = train_in_process(["--recipe", str(recipe), "--output-dir", str(tmp_path / "run")])
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    return [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]


def trl_logs(tmp_path, monkeypatch, base, loss_type, beta, iterations, accumulation, settings,
             judge=None) -> list[dict]:
    import datasets
    import trl.trainer.grpo_trainer
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from training.objectives.grpo.rewards import load_reward
    from training.planning.shape import weight_decay_groups
    tokenizer = AutoTokenizer.from_pretrained(base)
    table = completion_table(tokenizer)
    monkeypatch.setattr(trl.trainer.grpo_trainer, "shuffle_sequence_dict", lambda batch: batch)
    batch, steps = steps_of(settings)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=batch // accumulation,
                      gradient_accumulation_steps=accumulation, num_generations=GENERATIONS,
                      max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE, loss_type=loss_type, beta=beta,
                      epsilon=EPSILON, **{"epsilon_high": EPSILON_HIGH, **settings}, scale_rewards="group",
                      num_iterations=iterations,
                      reward_weights=[weight for *_, weight in REWARDS] + ([JUDGE_WEIGHT, 1.0] if judge else []),
                      max_steps=steps, learning_rate=LR,
                      lr_scheduler_type="constant", warmup_steps=0, weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0],
                      adam_beta2=BETAS[1], adam_epsilon=EPS, optim="adamw_torch", max_grad_norm=GRAD_CLIP,
                      logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False, fp16=False,
                      seed=1234, shuffle_dataset=False, dataloader_num_workers=0, gradient_checkpointing=False)
    with left_as_found():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        optimizer = torch.optim.AdamW(weight_decay_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS)
        trainer = GRPOTrainer(model=model, reward_funcs=[load_reward(name, params) for name, params, _ in REWARDS]
                              + ([str(judge), load_reward(PROGRESS)] if judge else []),
                              args=args, train_dataset=datasets.Dataset.from_list([PROMPTS[i] for i in our_order()]),
                              processing_class=tokenizer,
                              optimizers=(optimizer, None))
        trainer._generate_single_turn = lambda prompt_ids, *_, **__: (fixed_completions(table, prompt_ids), None)
        trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


@pytest.mark.slow
@pytest.mark.parametrize("loss_type, beta, iterations, accumulation, settings", CASES)
def test_grpo_matches_trl_step_by_step(tmp_path, monkeypatch, checkpoint, judge, loss_type, beta, iterations,
                                       accumulation, settings):
    scored_by = judge if settings.get("more_rewards") else None
    settings = {key: value for key, value in settings.items() if key != "more_rewards"}
    case = (loss_type, beta, iterations, accumulation, settings)
    ours = our_logs(tmp_path, monkeypatch, checkpoint, *case, judge=scored_by)
    theirs = trl_logs(tmp_path, monkeypatch, checkpoint, *case, judge=scored_by)
    batch, steps = steps_of(settings)
    generate_every = iterations * settings.get("generation_batch_size", batch) // batch
    assert [r["step"] for r in ours] == [log["step"] for log in theirs] == list(range(1, steps + 1))

    differences = {}  # the largest of each quantity, printed (pytest -s) for the record

    def compare(name: str, step: int, relative: bool = False, tolerance: float = 1e-5) -> None:
        mine, trl = ours[step - 1][name], theirs[step - 1][name]
        difference = abs(mine - trl) / (abs(trl) if relative else 1.0)
        differences[name] = max(differences.get(name, 0.0), difference)
        assert difference <= tolerance, f"step {step}: {name}: ours {mine!r}, TRL {trl!r}"

    for step in range(1, steps + 1):
        compare("loss", step)
        compare("grad_norm", step, relative=True)
        for name in LOSS_METRICS:
            assert (name in ours[step - 1]) == (name in theirs[step - 1]), f"step {step}: {name} logged by one side"
            if name in theirs[step - 1]:
                compare(name, step)
        assert ("kl" in ours[step - 1]) == bool(beta), f"step {step}"
        generated = (step - 1) % generate_every == 0
        assert ("reward" in theirs[step - 1]) == generated, f"step {step}: TRL generates every {generate_every} step(s)"
        judged = ("rewards/judge/mean", "rewards/judge/std", "rewards/progress/mean", "progress/steps_done",
                  "progress/mean_ids") if scored_by else ()
        for name in GENERATION_METRICS + judged if generated else ():
            compare(name, step)
    print(f"\n{'-'.join(map(str, case[:4]))} {settings}: "
          + ", ".join(f"{name} {value:.1e}" for name, value in differences.items()))

    assert len({round(r["loss"], 6) for r in ours}) > 1 or iterations > 1, "the steps must differ"
    assert len({round(r["grad_norm"], 4) for r in ours}) == steps, "each step's gradient its own"
    assert ours[0]["grad_norm"] > GRAD_CLIP, "clipping exercised, shaping the later steps"
    assert ours[0]["frac_reward_zero_std"] == 0, "rewards differ within each group"
    assert ours[0]["completions/clipped_ratio"] == 0.25, "truncated completions among them"
    if scored_by:
        assert ours[0]["rewards/judge/std"] > 1, "the reward model scores the completions apart"
        assert [r["progress/steps_done"] for r in ours] == [0, 1, 2], "trainer_state: the steps done before each"
    if beta:  # a synced reference follows the policy: 0.4 of its distance left after every step
        assert ours[-1]["kl"] > (1e-3 if settings.get("sync_ref_model") else 0.05), "the policy moved away from it"
    if settings.get("use_adaptive_entropy"):
        assert [r["entropy_coef"] for r in ours] == pytest.approx([0.15, 0.2, 0.25])
    if generate_every > 1:  # the off-policy step's ratios are not 1
        clipped = {"cispo": "cispo_clip_ratio", "sapo": None, "vespo": None}.get(loss_type, "clip_ratio/region_mean")
        assert clipped is None or ours[1][clipped] > 0.1, "the off-policy step clips"
        if loss_type == "vespo":
            assert abs(ours[1]["vespo/phi_seq_mean"] - 1) > 0.01, "the off-policy step weighs its sequences"

