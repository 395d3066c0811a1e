"""A build lock that a killed run left in the torch extensions cache is named, not waited for without end
(training/parallel/op_builds.py)."""
import _bisect
import ctypes
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import train_in_process
from training.base.errors import ConfigError
from training.parallel.op_builds import wait_for_op_builds


def lock_of(root: Path, op: str, age_s: float = 0.0) -> Path:
    """`root/op/lock` as a build leaves it, made `age_s` ago."""
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    made = time.time() - age_s
    os.utime(lock, (made, made))
    return lock


@pytest.fixture
def extensions(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    return tmp_path / "extensions"


def test_a_lock_no_process_holds_is_named_with_its_fix_once_it_is_stale(extensions):
    lock = lock_of(extensions, "cpu_adam", age_s=3600)
    with pytest.raises(ConfigError) as raised:
        wait_for_op_builds(show=True)
    message = " ".join(str(raised.value).split())
    assert f"{lock} is the build lock of DeepSpeed's cpu_adam op, made 60 min ago, and no process on this node " \
           f"holds it" in message and f"delete it (rm {lock}) and start again" in message
    assert lock.exists()  # the lock is not this run's to delete


def test_a_young_lock_is_waited_for_and_named_once(extensions, capsys):
    lock = lock_of(extensions, "deepspeed_shm_comm")
    threading.Timer(0.5, lock.unlink).start()  # another machine's build ends
    wait_for_op_builds(show=True, poll_s=0.1)
    assert not lock.exists()
    printed = capsys.readouterr().err
    assert printed.count(f"waiting for {lock}: no process on this node holds this build lock") == 1


def test_a_young_lock_that_stays_is_stale_past_the_limit_and_other_ranks_say_nothing(extensions, capsys):
    lock_of(extensions, "fused_adam")
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="fused_adam op, made 0 min ago"):
        wait_for_op_builds(show=False, stale_after_s=0.4, poll_s=0.1)
    assert 0.4 <= time.perf_counter() - start < 5 and capsys.readouterr().err == ""


def test_a_lock_a_process_here_holds_is_a_build_under_way_and_left_to_torch(extensions, capsys):
    lock = lock_of(extensions, "cpu_adam", age_s=3600)
    held = os.open(lock, os.O_RDONLY)  # as torch's FileBaton holds it while it builds
    try:
        wait_for_op_builds(show=True)
    finally:
        os.close(held)
    assert capsys.readouterr().err == ""


def test_the_lock_of_an_op_this_process_has_loaded_does_not_matter_to_it(extensions, capsys):
    lock = lock_of(extensions, "cpu_adam", age_s=3600)
    library = lock.parent / "cpu_adam.so"
    shutil.copy(_bisect.__file__, library)  # any small library stands for the built op
    ctypes.CDLL(str(library))  # loaded, as the warm ranks' parent loads the ops before it forks
    wait_for_op_builds(show=True)
    assert capsys.readouterr().err == ""


def test_no_extensions_cache_is_no_wait(extensions):
    wait_for_op_builds(show=True)
    assert not extensions.exists()  # looked at, not made


def test_train_py_names_a_stale_build_lock_and_exits_2(extensions, tmp_path):
    """Without the check this run would wait in DeepSpeed's start-up for the CPU all-reduce op's lock for good."""
    lock = lock_of(extensions, "deepspeed_shm_comm", age_s=600)

    def waited(signum, frame):
        raise TimeoutError("train.py waited on the stale build lock")
    previous = signal.signal(signal.SIGALRM, waited)
    signal.alarm(120)
    try:
        result = train_in_process(["--recipe", "tiny_llama", "--output-dir", str(tmp_path / "run")])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"error: {lock} is the build lock of DeepSpeed's deepspeed_shm_comm op, made 10 min ago" in result.stderr
    assert not (tmp_path / "run").exists() and lock.exists()
