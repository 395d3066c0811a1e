"""training.objective=grpo, run by train.py: the same curve on 1 rank (ZeRO-0, one completion per row) and 2 ranks
(ZeRO-3, completions packed into rows, the LM head cast to fp32), after a kill -9 and a resume in another layout
(ZeRO-3 with the whole weights gathered for generation; adaptive entropy control's coefficient and the synced
reference restored), and with LoRA
(the reference: the base with the adapters disabled); the same evaluation by generation on held-out prompts (2
completions each, num_generations_eval); the completions' samples; the export loaded by transformers; a SIGTERM inside a
generation. Against TRL's GRPOTrainer step by step: tests/test_grpo_trl.py.

Sixteen sums from tiny_llama_grpo, 4 prompts x 4 generations a step, each generation sampling 2 steps' prompts at
once (grpo.generation_batch_size; the LoRA run one step's), 8 completions per micro-batch on 2 ranks and 16 on 1 (so
that every layout groups a step's completions alike: TRL's kl, entropy and clip ratios are means of each
micro-batch's mean, over the ranks' micro-batches together, which differ once completions end at a stop string and
their lengths differ), fp32, rewarded for
a length near 40 characters (the small random model's completions differ in length: each group has something to
learn) and for the right answer. Every
completion draws from a random stream of its own (training/objectives/grpo/sampling.py), so every layout samples the
same completions and the rewards match exactly; the losses, entropies and the weights' norm after each step match within
1e-5 (the engine sums the same terms in another order), the gradient norm within 5e-5 (ZeRO computes it over its flat
buffers).
"""
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import (
    REPO,
    run_train,
    save_small_checkpoint,
    save_small_reward_model,
    small_grpo_run,
    train_in_process,
)
from training.objectives.grpo.spec import COMPLETIONS_FILE

pytestmark = pytest.mark.slow

STEPS = 4
PROMPTS = [json.loads(line) for line in (REPO / "recipes/tiny_llama_grpo/prompts.jsonl").read_text().splitlines()[:16]]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "event" not in line]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("grpo")
    save_small_checkpoint(folder / "base")
    save_small_reward_model(folder / "judge")
    (folder / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    common = [*small_grpo_run(folder / "base", folder, STEPS), "grpo.log_completions_every=1",
              # the small random model's answers are rarely numbers: a length penalty makes every group's rewards
              # differ; and a reward model (a whole copy on each rank, scoring a group at a time: the same rewards
              # exactly under every layout)
              # and TRL's whole signature, weighing nothing: it logs a metric and a completions.jsonl column
              "grpo.rewards=[{function: length_penalty, params: {target: 40}}, {function: exact_answer}, "
              f"{{model: {folder / 'judge'}, weight: 0.1}}, {{function: 'tests.helpers.trl_rewards:progress', "
              "weight: 0}]",
              # 3 prompts held out, evaluated by generation at steps 2 and 4 (on 2 ranks the second's batch padded)
              "data.eval={fraction: 0.2}", "training.eval_every_steps=2",
              "grpo.num_generations_eval=2",  # 2 completions of each (TRL's num_generations_eval), 4 in training
              # adaptive entropy control, below its target: the coefficient 0.01 higher after every step, applied
              # from step 2; the killed run's checkpoint holds it (at 0.02), and the resumed run continues from it
              "grpo.use_adaptive_entropy=true", "grpo.entropy_target=100", "grpo.entropy_coef_delta=0.01",
              # the reference mixed with the policy after every step (TR-DPO): under ZeRO-3 weight by weight,
              # gathered; the killed run's step-2 checkpoint holds it, written at ZeRO-1 and restored at ZeRO-3
              "grpo.sync_ref_model=true", "grpo.ref_model_sync_steps=1",
              # one generation of 32 completions for 2 optimizer steps (TRL's steps_per_generation 2 x accumulation)
              "grpo.generation_batch_size=32",
              # completions may end at a '.' (about 1 in 10 of the random model's do), never before 2 tokens, and
              # sample as transformers' typical_p does: generate's processors and our warpers under every layout
              "grpo.generation_kwargs={stop_strings: ['.'], min_new_tokens: 2, typical_p: 0.95}",
              "data.packing=bfd"]  # but in `whole`: one completion per row
    whole, zero3, killed, resumed, lora = (folder / name for name in ("whole", "zero3", "killed", "resumed", "lora"))
    result = run_train(["--output-dir", str(whole), *common, "deepspeed.config=zero0", "data.packing=none",
                        "training.micro_batch_size=16"], ranks=1)
    assert result.returncode == 0, result.stderr[-3000:]
    # the LM head in fp32 (a no-op on fp32 numbers): through ZeRO-3's partitioned head and reference, and LoRA's;
    # generated on the static KV cache, each layer gathered in every pass (synced_gpus): `whole`'s completions
    result = run_train(["--output-dir", str(zero3), *common, "deepspeed.config=zero3",
                        "grpo.cast_lm_head_to_fp32=true", "grpo.generation_engine=static"], ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_train(["--kill-after-deepspeed-save", "4", "--output-dir", str(killed), *common,
                        "deepspeed.config=zero1", "checkpointing.every_steps=2", "training.micro_batch_size=16"],
                       ranks=1, script="tests/helpers/train_with_probes.py")
    assert result.returncode != 0 and (killed / "checkpoints/latest").read_text() == "global_step2"
    shutil.copytree(killed, resumed)
    # resumed at ZeRO-3 with the whole weights gathered for each generation, on the compiled engine: `whole`'s
    # completions, in training and in evaluation
    result = run_train(["--output-dir", str(resumed), "--resume", *common, "deepspeed.config=zero3",
                        "grpo.ds3_gather_for_generation=true", "grpo.generation_engine=compiled"], ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_train(["--output-dir", str(lora), *common, "deepspeed.config=zero2", "lora.enabled=true",
                        "grpo.beta=0.04", "grpo.loss_type=grpo", "training.max_steps=2", "grpo.sync_ref_model=false",
                        "grpo.generation_batch_size=null", "grpo.cast_lm_head_to_fp32=true"],
                       ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"whole": whole, "zero3": zero3, "killed": killed, "resumed": resumed, "lora": lora, "common": common}


def assert_same_curve(records: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in records] == [e["step"] for e in expected]
    for record, reference in zip(records, expected):
        for key, value in reference.items():
            if key.startswith(("reward", "completions/", "frac_", "eval_", "progress/")):
                assert record[key] == value, (record["step"], key)  # the same completions, scored alike
            elif key in ("loss", "entropy", "kl", "param_norm", "clip_ratio/low_mean", "clip_ratio/high_mean",
                         "clip_ratio/region_mean", "policy_loss", "entropy_coef"):
                assert record[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (record["step"], key)
            elif key == "grad_norm":  # ZeRO's norm over its flat buffers, ZeRO-0's torch's over each weight: the
                # same gradients (param_norm after the step agrees to 1e-7) measured 1.6e-5 apart
                assert record[key] == pytest.approx(value, rel=5e-5), (record["step"], key)


def test_grpo_takes_the_same_steps_on_one_rank_and_under_zero3(runs):
    whole = metrics(runs["whole"])
    assert len(whole) == STEPS and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in whole)
    assert any(r["reward_std"] > 0 for r in whole)  # the groups' rewards differ: there is something to learn
    assert all(r["rewards/judge/std"] > 0 for r in whole)  # the reward model scores completions apart
    assert [r["progress/steps_done"] for r in whole] == [0, 0, 2, 2]  # trainer_state: before each generation
    assert [r["step"] for r in whole if "eval_reward" in r] == [2, 4]
    # sampling is inside the first step of each generation, and the second trains on what it sampled
    assert all(0 < r["generation_time_s"] < r["step_time_s"] for r in whole[::2])
    assert all(r["generation_time_s"] == 0 for r in whole[1::2])
    assert [r["entropy_coef"] for r in whole] == pytest.approx([0.01, 0.02, 0.03, 0.04])
    summary = json.loads((runs["whole"] / "summary.json").read_text())
    assert summary["eval_reward"] == whole[-1]["eval_reward"]
    assert summary["generation_time_s"] == whole[-1]["generation_time_s"]
    assert_same_curve(metrics(runs["zero3"]), whole)


def test_a_killed_grpo_run_resumes_in_another_layout_on_the_same_curve(runs):
    whole = metrics(runs["whole"])
    assert_same_curve(metrics(runs["killed"]), whole[:len(metrics(runs["killed"]))])
    assert_same_curve(metrics(runs["resumed"]), whole)  # steps 1-2 from the killed run, 3-4 resumed on 2 ranks
    assert (runs["killed"] / "checkpoints/global_step2/reference.safetensors").is_file()
    samples = [json.loads(line) for line in (runs["resumed"] / COMPLETIONS_FILE).read_text().splitlines()]
    assert [s["generation"] for s in samples] == [g for g in range(STEPS // 2) for _ in range(32)]  # none twice
    assert samples == [json.loads(line) for line in (runs["whole"] / COMPLETIONS_FILE).read_text().splitlines()]
    assert all(1 <= s["ids"] <= 10 for s in samples)  # log_extra's column: each completion's token count
    stopped = [s["completion"] for s in samples if "." in s["completion"]]
    # each ends in the token that makes its first '.' (the tokenizer's tokens hold at most 4 characters after one)
    assert stopped and all(len(c) - c.index(".") <= 5 for c in stopped)


def test_the_planned_checkpoint_counts_the_synced_reference(runs):
    """The plan's size of a save, which training/state/disk_room.py holds against the free space before each save,
    with grpo.sync_ref_model: DeepSpeed's files and reference.safetensors of the killed run's step-2 checkpoint."""
    import train
    from training.planning.checkpoint_size import planned_checkpoint
    plan = train.make_plan(train.parse_args([*runs["common"], "--dry-run", "deepspeed.config=zero1",
                                             "checkpointing.every_steps=2"]), world_size=1)
    tag = runs["killed"] / "checkpoints/global_step2"
    deepspeeds = sum(path.stat().st_size for path in tag.glob("*.pt") if not path.name.startswith("rank_state"))
    reference = (tag / "reference.safetensors").stat().st_size
    assert reference == pytest.approx(plan.shape.parameters * 4, rel=0.02)  # fp32, whole
    assert deepspeeds + reference == pytest.approx(planned_checkpoint(plan).total, rel=0.02)


def test_grpo_with_lora_logs_the_kl_to_the_base_and_exports_adapters(runs):
    records = metrics(runs["lora"])
    assert records[0]["kl"] == pytest.approx(0, abs=1e-7)  # step 1: the policy is still the base
    assert records[-1]["kl"] > 0 and (runs["lora"] / "adapter" / "adapter_config.json").is_file()


def test_the_grpo_export_loads_in_transformers_and_keeps_the_trained_weights(runs):
    model = AutoModelForCausalLM.from_pretrained(runs["whole"] / "hf")
    summary = json.loads((runs["whole"] / "summary.json").read_text())
    assert summary["first_reward"] == metrics(runs["whole"])[0]["reward"]
    assert summary["reward"] == metrics(runs["whole"])[-1]["reward"]
    base = AutoModelForCausalLM.from_pretrained(runs["whole"].parent / "base")
    moved = max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(), base.state_dict().values()))
    assert moved > 1e-4
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


def test_a_reward_function_that_raises_ends_every_rank_with_one_error_and_its_own_frames(tmp_path):
    """A user's reward function that raises at the third generation (step 3): every rank stops with exit code 2 and
    one `error:` line naming the function, the generation and the step, then the function's own frames, none of
    training/'s; the checkpoint saved at step 2 stays the latest, whole. (A wrong count is named alike, fast:
    tests/training/objectives/grpo/test_rewards.py.)"""
    save_small_checkpoint(tmp_path / "base")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    flaky = tmp_path / "flaky.py"
    flaky.write_text("calls = []\n\n\ndef flaky(prompts, completions, **row_fields):\n"
                     "    calls.append(1)\n"
                     "    if len(calls) == 3:\n"
                     "        raise ValueError('my reward is broken')\n"
                     "    return [0.0] * len(completions)\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((REPO / "recipes/tiny_llama_grpo/recipe.yaml").read_text())
    out = tmp_path / "run"
    result = run_train(["--recipe", str(recipe), "--output-dir", str(out), f"model.name_or_path={tmp_path / 'base'}",
                        f"data.sources=[{{path: {tmp_path / 'prompts.jsonl'}}}]", "data.seq_len=20",
                        "grpo.num_generations=4", "grpo.max_completion_length=10", "training.micro_batch_size=8",
                        "training.global_batch_size=16", "grpo.rewards=[{function: flaky:flaky}]", "grpo.beta=0",
                        "checkpointing.every_steps=2", "training.max_steps=4", "logging.report_to=[]",
                        f"data.cache_dir={tmp_path / 'cache'}"], ranks=2)
    assert result.returncode == 2, result.stderr[-3000:]
    line = "error: reward function flaky raised ValueError: my reward is broken (generation 2, step 3)\n"
    assert result.stderr.count("error:") == 1 and result.stderr.count(line) == 1, result.stderr[-3000:]
    frames = result.stderr[result.stderr.index(line) + len(line):]
    assert frames.startswith(f'  File "{flaky.resolve()}", line 7, in flaky\n'
                             f"    raise ValueError('my reward is broken')"), result.stderr[-3000:]
    assert frames.count("  File ") == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not re.search(r'File ".*/training/', result.stderr), result.stderr[-3000:]
    assert (out / "checkpoints/latest").read_text() == "global_step2"
    assert json.loads((out / "checkpoints/global_step2/run_state.json").read_text())["step"] == 2


def test_a_sigterm_inside_a_generation_saves_at_its_end(tmp_path):
    """With num_iterations=2 a checkpoint inside a generation would resume without its completions: a SIGTERM in step
    3 (the first of generation 1) trains step 4 on the same completions, then saves and stops."""
    save_small_checkpoint(tmp_path / "base")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "out"
    result = run_train(["--sigterm-in-step", "3", "--recipe", "tiny_llama_grpo", "--output-dir", str(out),
                        f"model.name_or_path={tmp_path / 'base'}",
                        f"data.sources=[{{path: {tmp_path / 'prompts.jsonl'}}}]",
                        f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=20", "grpo.num_generations=4",
                        "grpo.max_completion_length=6", "grpo.num_iterations=2", "training.micro_batch_size=16",
                        "training.global_batch_size=16", "training.max_steps=8", "checkpointing.every_steps=null",
                        "logging.every_steps=1", "logging.report_to=[]", "precision=fp32", "deepspeed.config=zero1"],
                       ranks=1, script="tests/helpers/train_with_probes.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stopped by SIGTERM after step 4 of 8" in result.stdout + result.stderr
    assert (out / "checkpoints/latest").read_text() == "global_step4"
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[2]["reward"] == records[3]["reward"]


def test_a_rewind_restores_the_objectives_state_from_the_checkpoint(tmp_path, monkeypatch):
    """The stability guard rewinds to the step-2 checkpoint after step 3 was applied: adaptive entropy control's
    coefficient goes back to its value there (0.02) with the weights, so the retried step 3 logs 0.03 as the first
    did (not 0.04). One rank, in-process; the spike is the guard's verdict on step 4's loss, forced."""
    from training.loop.stability import StabilityGuard
    verdict, calls = StabilityGuard.loss_verdict, []

    def spike_at_step_4(guard, loss):
        calls.append(loss)
        return "loss_spike" if len(calls) == 4 else verdict(guard, loss)

    monkeypatch.setattr(StabilityGuard, "loss_verdict", spike_at_step_4)
    save_small_checkpoint(tmp_path / "base")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "run"
    result = train_in_process([
        "--recipe", "tiny_llama_grpo", "--output-dir", str(out), f"model.name_or_path={tmp_path / 'base'}",
        f"data.sources=[{{path: {tmp_path / 'prompts.jsonl'}}}]", f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=20", "grpo.num_generations=4", "grpo.max_completion_length=6", "training.micro_batch_size=16",
        "training.global_batch_size=16", "training.max_steps=4", "checkpointing.every_steps=2", "logging.every_steps=1",
        "logging.report_to=[]", "precision=fp32", "deepspeed.config=zero0", "stability.policy=rewind",
        "grpo.use_adaptive_entropy=true", "grpo.entropy_target=100", "grpo.entropy_coef_delta=0.01"])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line.get("event") for line in lines if "event" in line] == ["rewind"]
    assert [(r["step"], round(r["entropy_coef"], 6)) for r in lines if "event" not in r] == \
        [(1, 0.01), (2, 0.02), (3, 0.03), (4, 0.04)]



def test_the_fp32_head_trains_in_bf16_with_its_reference_partitioned(tmp_path):
    """grpo.cast_lm_head_to_fp32 where it acts: bf16 under ZeRO-3 (the head's weight and the reference partitioned),
    beta > 0. Step 1's KL is 0 (the policy is the reference, both heads cast) and its gradient moves from the bf16
    head's: the log-probabilities it is taken from are no longer rounded to bf16 logits. (The entropy of this
    near-uniform random model is flat to that rounding.)"""
    save_small_checkpoint(tmp_path / "base")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    records = {}
    for cast in (False, True):
        out = tmp_path / f"cast_{cast}"
        result = run_train(["--recipe", "tiny_llama_grpo", "--output-dir", str(out),
                            f"model.name_or_path={tmp_path / 'base'}",
                            f"data.sources=[{{path: {tmp_path / 'prompts.jsonl'}}}]",
                            f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=20", "grpo.num_generations=4",
                            "grpo.max_completion_length=8", "training.micro_batch_size=8",
                            "training.global_batch_size=8", "training.max_steps=2", "logging.every_steps=1",
                            "logging.report_to=[]", "precision=bf16", "deepspeed.config=zero3", "grpo.beta=0.04",
                            "grpo.rewards=[{function: length_penalty, params: {target: 40}}]",
                            f"grpo.cast_lm_head_to_fp32={str(cast).lower()}"], ranks=1)
        assert result.returncode == 0, result.stderr[-3000:]
        records[cast] = metrics(out)
    for cast, steps in records.items():
        assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in steps), cast
        assert steps[0]["kl"] == pytest.approx(0, abs=1e-7), cast
    assert records[True][0]["grad_norm"] != records[False][0]["grad_norm"]  # measured 1.58932 against 1.59019
    assert records[True][0]["grad_norm"] == pytest.approx(records[False][0]["grad_norm"], rel=1e-2)
