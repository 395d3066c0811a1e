"""Checkpoints written in the background (checkpointing.asynchronous, training/state/saving.py), on 2 CPU ranks.

At every ZeRO stage, step 2's files are held unwritten while steps 3 and 4 change the weights: the checkpoint still
holds step 2's states (a resume from it trains steps 3-4 to the same losses). A kill -9 of every rank while a save is
being written, after training has moved past it, leaves the previous checkpoint `latest` and whole, and the run
resumes from it on the curve. (Every other test that saves and resumes runs asynchronous saves too: the default.)
A failing run writes the save being written to the end before its ranks end (fast).
"""
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO, SMALL_MODEL, TRAIN_ENV, deepspeed_ops_built, run_train, train_command
from training.state.saving import Saving

PROBES = "tests/helpers/train_with_probes.py"


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def common(data_cache: str, steps: int) -> list[str]:
    return ["--recipe", "tiny_llama", SMALL_MODEL, data_cache, f"training.max_steps={steps}",
            "checkpointing.every_steps=2", "logging.every_steps=1", "precision=fp32"]


def back_to(out: Path, tag: str) -> None:
    """The test moves `latest` back to `tag` and moves the checkpoints after it out of the run."""
    checkpoints = out / "checkpoints"
    for later in checkpoints.glob("global_step*"):
        if int(later.name.removeprefix("global_step")) > int(tag.removeprefix("global_step")):
            later.rename(out / later.name)
    (checkpoints / "latest").write_text(tag)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_asynchronous_saves_train_the_synchronous_curve_at_every_zero_stage(tmp_path, data_cache, zero_stage):
    out = tmp_path / "run"
    args = [*common(data_cache, 4), f"deepspeed.config=zero{zero_stage}"]
    first = run_train(["--hold-in-write", f"2:1.5:{tmp_path / 'held'}", "--output-dir", str(out), *args], ranks=2,
                      script=PROBES)
    assert first.returncode == 0, first.stderr[-3000:]
    console = first.stdout + first.stderr
    assert re.search(r"checkpoint global_step2: [\d,.]+ MiB in [\d.]+ s \([\d.]+ s of them in the step\)", console)
    assert console.index("checkpoint global_step2:") > console.index("step 4/")  # written while steps 3-4 ran
    before = losses(out)
    back_to(out, "global_step2")
    resumed = run_train(["--resume", "--output-dir", str(out), *args], ranks=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(out)
    assert max(abs(after[step] - before[step]) for step in (3, 4)) <= 1e-6, (before, after)


@pytest.mark.slow
def test_a_kill_while_a_save_is_written_leaves_the_previous_checkpoint_latest(tmp_path, data_cache):
    """Step 4's files are held unwritten; once step 5 is logged (training went on), every rank is SIGKILLed."""
    out, marker = tmp_path / "run", tmp_path / "held"
    deepspeed_ops_built()
    command = train_command(["--hold-in-write", f"4:300:{marker}", "--output-dir", str(out), *common(data_cache, 8)],
                            ranks=2, script=PROBES)
    launch = subprocess.Popen(command, cwd=REPO, env=TRAIN_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not (marker.exists() and 5 in losses_so_far(out)):
        assert launch.poll() is None and time.monotonic() < deadline, launch.stdout.read()[-3000:]
        time.sleep(0.2)
    os.killpg(launch.pid, signal.SIGKILL)
    launch.wait()
    checkpoints = out / "checkpoints"
    assert (checkpoints / "latest").read_text() == "global_step2"
    assert (checkpoints / "global_step2" / "run_state.json").is_file()
    assert not (checkpoints / "global_step4" / "run_state.json").exists()
    before = losses_so_far(out)
    resumed = run_train(["--resume", "--output-dir", str(out), *common(data_cache, 8)], ranks=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(out)
    assert max(abs(after[step] - before[step]) for step in (3, 4, 5)) <= 1e-6, (before, after)
    assert not (checkpoints / "global_step4").exists() or (checkpoints / "global_step4" / "run_state.json").is_file()


def losses_so_far(out: Path) -> dict[int, float]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return {}
    found = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line being written
            continue
        if "loss" in record:
            found[record["step"]] = record["loss"]
    return found


def test_a_failing_run_writes_the_save_being_written_to_the_end_however_long_that_takes(capsys):
    """The drain a failing rank runs before it ends (failure.exit_waits) joins this rank's writer past its timeout
    (a loaded machine once took more than the 5 s to write a tiny save, and `latest` was lost), gives the other
    ranks only the timeout to count their files, and once every rank has, waits for rank 0 to complete the save
    however long that takes (CI lost `latest` when rank 0's fsyncs took more than the timeout). Another rank waits
    for rank 0's word that the save is complete: the launcher kills rank 0 as soon as another rank ends (CI lost
    `latest` that way too)."""
    written = threading.Event()
    writer = threading.Thread(target=lambda: (time.sleep(0.5), written.set()))
    completer = threading.Thread(target=time.sleep, args=(0.5,), daemon=True)
    writer.start()
    completer.start()
    counts = {"checkpoint-written/1/0": 2}
    saving = Saving.__new__(Saving)
    saving.rank, saving.world_size, saving.writer, saving.completer = 0, 2, SimpleNamespace(thread=writer), completer
    saving.store = SimpleNamespace(add=lambda key, amount: counts[key])
    saving.pending = SimpleNamespace(run_state=SimpleNamespace(step=2), key="checkpoint-written/1/0")
    saving.drain(0.05)
    assert written.is_set() and not completer.is_alive()
    assert capsys.readouterr().err == "the checkpoint of step 2 is being written: the run ends once it is\n"
    counts["checkpoint-written/1/0"] = 1  # a rank lost: it never counts its files, and `latest` stays
    saving.completer = threading.Thread(target=time.sleep, args=(30,), daemon=True)
    saving.completer.start()
    started = time.monotonic()
    saving.drain(0.05)
    assert saving.completer.is_alive() and time.monotonic() - started < 5
    waited = []
    counts["checkpoint-written/1/0"] = 2
    saving.rank, saving.completer = 1, None
    saving.store.wait = lambda keys: waited.append(keys)
    saving.drain(0.05)
    assert waited == [["checkpoint-written/1/0/complete"]]
