"""Fine-tuning an HF checkpoint end to end, on 2 CPU ranks: load, train, evaluate, checkpoint, survive
kills and SIGTERM, resume, export.

Tolerances (fp32 throughout, so that any difference is a bug rather than rounding):
- first-step loss vs plain transformers on the same batch: 1e-5 (the sum over ranks and micro-batches
  reorders the additions; measured about 1e-7);
- losses after a resume vs the uninterrupted run: 1e-6 (the same arithmetic in the same order);
- logits of the exported folder vs the engine: 1e-5.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_pipeline.loader import EvalBatches, StepBatches
from data_pipeline.prepare import prepare_dataset
from tests.conftest import REPO, TRAIN_ENV, deepspeed_ops_built, run_train, save_small_checkpoint, train_command
from training.config.recipe import load_recipe

pytestmark = pytest.mark.slow

PROBES = "tests/helpers/train_with_probes.py"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("checkpoint")
    save_small_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def sft_args(checkpoint, tmp_path_factory):
    cache = tmp_path_factory.mktemp("data_cache")
    return ["--recipe", "tiny_llama_sft", f"model.name_or_path={checkpoint}", f"data.cache_dir={cache}",
            "precision=fp32", "logging.every_steps=1", "training.eval_every_steps=4", "checkpointing.keep_last=null"]


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out)}


def prepared(sft_args):
    recipe = load_recipe("tiny_llama_sft", [a for a in sft_args if "=" in a and not a.startswith("--")])
    return recipe, prepare_dataset(recipe.data, AutoTokenizer.from_pretrained(recipe.tokenizer_path))[0]


def summed_loss(model, batch: dict) -> tuple[float, int]:
    # no KV cache: with one, transformers stops reading document starts from position_ids
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")
    return loss.item(), int((labels != -100).sum())


@pytest.fixture(scope="module")
def finetuned(sft_args, tmp_path_factory):
    """8 steps under ZeRO-2 and ZeRO-3, recording the trained engine's logits on the first micro-batch."""
    runs = {}
    for stage in ("zero2", "zero3"):
        out = tmp_path_factory.mktemp(stage)
        result = run_train([*sft_args, "--output-dir", str(out), f"deepspeed.config={stage}", "training.max_steps=8",
                            "--record-logits"], ranks=2, script=PROBES)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[stage] = out
    return runs


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_first_step_loss_equals_the_checkpoints_loss_in_transformers(finetuned, stage, sft_args, checkpoint):
    recipe, data = prepared(sft_args)
    batch = StepBatches(data["train"], recipe.training.global_batch_size, 1, 0, 1,
                        recipe.training.seed).micro_batches(0)[0]
    with torch.no_grad():
        loss_sum, targets = summed_loss(AutoModelForCausalLM.from_pretrained(checkpoint), batch)
    assert records(finetuned[stage])[0]["loss"] == pytest.approx(loss_sum / targets, abs=1e-5)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_exported_folder_gives_the_engines_logits(finetuned, stage):
    out = finetuned[stage]
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert model.dtype == torch.float32 and model.config.use_cache
    recorded = torch.load(out / "engine_logits.pt")
    with torch.no_grad():
        logits = model(input_ids=recorded["input_ids"], position_ids=recorded["position_ids"], use_cache=False).logits
    torch.testing.assert_close(logits, recorded["logits"], rtol=0, atol=1e-5)
    assert AutoTokenizer.from_pretrained(out / "hf").pad_token == "<pad>"


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_export_command_and_deepspeeds_zero_to_fp32_give_the_same_weights(finetuned, stage, tmp_path):
    out = finetuned[stage]
    hf = load_file(out / "hf" / "model.safetensors")
    result = subprocess.run([sys.executable, "-m", "training", "export", str(out / "checkpoints"),
                             str(tmp_path / "export")], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    exported = load_file(tmp_path / "export" / "model.safetensors")
    script = subprocess.run([sys.executable, str(out / "checkpoints" / "zero_to_fp32.py"), str(out / "checkpoints"),
                             str(tmp_path / "zero_to_fp32"), "--safe_serialization"], cwd=REPO, capture_output=True,
                            text=True)
    assert script.returncode == 0, script.stderr[-3000:]
    from_script = load_file(tmp_path / "zero_to_fp32" / "model.safetensors")
    assert exported.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(exported[name], tensor), name
        assert torch.equal(from_script[name], tensor), name


def test_eval_loss_is_the_token_mean_over_the_held_out_rows(finetuned, sft_args):
    """Logged at steps 4 and 8; the last equals plain transformers on the exported model over all eval rows."""
    evaluated = [r for r in records(finetuned["zero2"]) if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [4, 8]
    for r in evaluated:
        assert r["eval_perplexity"] == pytest.approx(torch.tensor(r["eval_loss"]).exp().item(), rel=1e-6)
    recipe, data = prepared(sft_args)
    model = AutoModelForCausalLM.from_pretrained(finetuned["zero2"] / "hf")
    with torch.no_grad():
        sums = [summed_loss(model, batch) for batch in EvalBatches(data["eval"], 8, 0, 1)]
    assert evaluated[-1]["eval_loss"] == pytest.approx(sum(s for s, _ in sums) / sum(n for _, n in sums), abs=1e-5)


def start(args: list[str]) -> subprocess.Popen:
    deepspeed_ops_built()
    return subprocess.Popen(train_command(args, ranks=2), cwd=REPO, env=TRAIN_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_step(out, step: int, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert process.poll() is None, process.stdout.read()[-3000:]
        if (out / "metrics.jsonl").exists() and any(r >= step for r in losses(out)):
            return
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached")


@pytest.fixture(scope="module")
def uninterrupted(sft_args, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    result = run_train([*sft_args, "--output-dir", str(out), "training.max_steps=10"], ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(out)


def resume(sft_args, out) -> dict[int, float]:
    result = run_train([*sft_args, "--output-dir", str(out), "training.max_steps=10", "--resume"], ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(out)


def test_resume_after_sigkill_continues_the_uninterrupted_run(sft_args, uninterrupted, tmp_path):
    out = tmp_path / "killed"
    process = start([*sft_args, "--output-dir", str(out), "training.max_steps=10", "checkpointing.every_steps=4"])
    wait_for_step(out, 6, process)
    os.killpg(process.pid, signal.SIGKILL)  # the launcher and both ranks, no chance to clean up
    process.wait()
    assert (out / "checkpoints" / "latest").read_text() == "global_step4"
    resumed = resume(sft_args, out)
    assert sorted(resumed) == sorted(uninterrupted)
    assert [resumed[s] for s in range(5, 11)] == pytest.approx([uninterrupted[s] for s in range(5, 11)], abs=1e-6)
    run_state = json.loads((out / "checkpoints" / "global_step10" / "run_state.json").read_text())
    assert run_state["tokens_seen"] == json.loads((out / "summary.json").read_text())["tokens_seen"] > 0


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_latest(sft_args, uninterrupted, tmp_path):
    out = tmp_path / "killed_saving"
    result = run_train([*sft_args, "--output-dir", str(out), "training.max_steps=10", "checkpointing.every_steps=3",
                        "--kill-after-deepspeed-save", "6"], ranks=2, script=PROBES)
    assert result.returncode != 0
    assert (out / "checkpoints" / "latest").read_text() == "global_step3"
    assert (out / "checkpoints" / "global_step6").is_dir()  # the unfinished save, with truncated files
    resumed = resume(sft_args, out)
    assert [resumed[s] for s in range(4, 11)] == pytest.approx([uninterrupted[s] for s in range(4, 11)], abs=1e-6)
    assert not (out / "checkpoints" / "global_step6").exists()  # removed on resume; step 9 and 10 saved anew
    assert (out / "checkpoints" / "latest").read_text() == "global_step10"


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(sft_args, uninterrupted, tmp_path):
    out = tmp_path / "preempted"
    process = start([*sft_args, "--output-dir", str(out), "training.max_steps=10"])  # no periodic checkpoints
    wait_for_step(out, 3, process)
    # to every process of the run, as SLURM preempts a job (the single-node `deepspeed` runner does not
    # pass a SIGTERM sent to it alone on to the ranks)
    os.killpg(process.pid, signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    stopped_at = max(losses(out))
    assert 3 <= stopped_at < 10
    assert (out / "checkpoints" / "latest").read_text() == f"global_step{stopped_at}"
    assert f"stopped by SIGTERM after step {stopped_at}" in output
    assert not (out / "hf").exists()
    resumed = resume(sft_args, out)
    assert [resumed[s] for s in range(stopped_at + 1, 11)] == pytest.approx(
        [uninterrupted[s] for s in range(stopped_at + 1, 11)], abs=1e-6)


def test_bf16_zero1_checkpoints_export_too(sft_args, tmp_path):
    """bf16 at ZeRO-1 trains with DeepSpeed's BF16_Optimizer, whose checkpoints zero_to_fp32 refuses;
    the export command still writes exactly the trained bf16 weights."""
    out = tmp_path / "bf16"
    args = [a for a in sft_args if a != "precision=fp32"]
    result = run_train([*args, "--output-dir", str(out), "precision=bf16", "deepspeed.config=zero1",
                        "training.max_steps=2"], ranks=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((out / "checkpoints" / "global_step2").glob("bf16_zero_pp_rank_0_*optim_states.pt"))
    result = subprocess.run([sys.executable, "-m", "training", "export", str(out / "checkpoints" / "global_step2"),
                             str(tmp_path / "export")], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    exported, hf = (load_file(path / "model.safetensors") for path in (tmp_path / "export", out / "hf"))
    assert exported.keys() == hf.keys() and all(torch.equal(exported[k], hf[k]) for k in hf)
    assert next(iter(exported.values())).dtype == torch.bfloat16
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "export").dtype == torch.bfloat16
