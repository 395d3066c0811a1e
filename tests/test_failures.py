"""What a failure does to a multi-rank run: one rank's error ends every rank within seconds, with its exit
code and its message printed once; nothing of an earlier run is deleted; ranks started by `srun` (no launcher
between SLURM and them) get SIGTERM directly, save and resume. 2 CPU ranks, SMALL_MODEL, a few steps.

Without the failure watch (training/parallel/failure.py), the ranks that did not fail wait in their next collective
until gloo's 30-minute timeout: the time limits here (60 s after start-up) would catch that.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, SMALL_MODEL, TRAIN_ENV, deepspeed_ops_built, run_train, snapshot
from training.parallel.launch import free_port

pytestmark = pytest.mark.slow

PROBES = "tests/helpers/train_with_probes.py"
SHORT = [SMALL_MODEL, "training.schedule=constant", "training.warmup_steps=0", "logging.every_steps=1"]


def timed_run(args: list[str], script: str = "train.py") -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = run_train(args, ranks=2, script=script, timeout=300)
    return result, time.monotonic() - started


def test_a_bad_data_line_ends_both_ranks_and_overwrite_deletes_nothing(earlier_run, tmp_path, data_cache):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "one document"}\n{"text": "two", \n{"text": "three"}\n')
    before = snapshot(earlier_run)
    result, seconds = timed_run(["--recipe", "tiny_llama", "--output-dir", str(earlier_run), "--overwrite",
                                 f"data.sources=[{{path: {data}, text_field: text}}]", *SHORT])
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert output.count(f"{data}:2") == 1, output[-3000:]  # named once, by the rank that read it
    assert "Traceback" not in output
    assert snapshot(earlier_run) == before
    assert seconds < 120


def test_a_crash_on_one_rank_ends_the_other_with_one_traceback(tmp_path, data_cache):
    result, seconds = timed_run(["--fail-on-rank", "1", "--recipe", "tiny_llama", "--output-dir", str(tmp_path),
                                 data_cache, "training.max_steps=20", *SHORT], script=PROBES)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert output.count("Traceback") == 1 and "RuntimeError: probe: rank 1 fails in step 3" in output
    assert not (tmp_path / "summary.json").exists()
    assert seconds < 120


def test_an_output_dir_another_node_cannot_see_is_refused(tmp_path, data_cache):
    result, _ = timed_run(["--blind-node-on-rank", "1", "--recipe", "tiny_llama", "--output-dir", str(tmp_path / "out"),
                           data_cache, *SHORT], script=PROBES)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert output.count("is not on a file system every node sees") == 1
    assert f"({socket.gethostname()}) cannot read the file rank 0 wrote there" in output  # node_name()
    assert not list((tmp_path / "out").glob(".shared-check-*"))


def srun_ranks(args: list[str]) -> list[subprocess.Popen]:
    """Two ranks as `srun --ntasks 2 python train.py ...` starts them: plain processes told their place by SLURM's
    variables, all in one process group (SLURM signals every task of the step)."""
    env = dict(TRAIN_ENV, SLURM_STEP_NUM_TASKS="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    deepspeed_ops_built()
    ranks = []
    for rank in range(2):
        ranks.append(subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, text=True,
                                      env=dict(env, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      process_group=ranks[0].pid if ranks else 0))
    return ranks


def logged_losses(out) -> dict[int, float]:
    if not (out / "metrics.jsonl").exists():
        return {}
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_srun_ranks_take_sigterm_save_and_resume(tmp_path, data_cache):
    common = ["--recipe", "tiny_llama", data_cache, "training.max_steps=10", *SHORT]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run_train([*common, "--output-dir", str(whole)], ranks=2).returncode == 0  # the deepspeed launcher
    ranks = srun_ranks([*common, "--output-dir", str(parts)])
    deadline = time.monotonic() + 300
    while max(logged_losses(parts), default=0) < 3:
        assert time.monotonic() < deadline and all(rank.poll() is None for rank in ranks)
        time.sleep(0.2)
    os.killpg(ranks[0].pid, signal.SIGTERM)  # as SLURM preempts: every task gets it, no launcher in between
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    stopped_at = max(logged_losses(parts))
    assert stopped_at < 10 and (parts / "checkpoints" / "latest").read_text() == f"global_step{stopped_at}"
    assert f"stopped by SIGTERM after step {stopped_at}" in outputs[0]
    resumed = srun_ranks([*common, "--output-dir", str(parts), "--resume"])
    assert [rank.wait(timeout=300) for rank in resumed] == [0, 0], resumed[0].stdout.read()[-3000:]
    assert logged_losses(parts) == pytest.approx(logged_losses(whole), abs=1e-6)
