"""The fast tier's guard (tests/conftest.py pytest_configure): a test not marked slow that starts train.py,
the deepspeed or accelerate launcher or a datatrove job fails, naming itself and the fix."""
import subprocess
import sys
import time

import pytest

from tests.conftest import launch_in
from training.parallel.launch import launcher_command


@pytest.mark.parametrize("command, what", [
    ([sys.executable, "train.py", "--recipe", "tiny_llama"], "train.py"),
    ([sys.executable, "/repo/train.py", "--dry-run"], "train.py"),
    ([sys.executable, "tests/helpers/train_with_probes.py", "--slow-save", "3"], "train.py"),
    (launcher_command(2, "tests/helpers/optimizer_steps.py", ["lion"]), "the deepspeed launcher"),
    ([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "x.py"], "the deepspeed launcher"),
    ("deepspeed --num_gpus 2 train.py", "the deepspeed launcher"),
    ([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "-m", "training", "evaluate", "m"],
     "the accelerate launcher"),
    ("accelerate launch --num_processes 2 -m lm_eval --model hf", "the accelerate launcher"),
    ([sys.executable, "-m", "data_pipeline", "prepare", "--engine", "datatrove", "--tasks", "2"], "a datatrove job"),
    ([sys.executable, "-m", "data_pipeline", "prepare", "--engine=datatrove"], "a datatrove job"),
    ([sys.executable, "-m", "data_pipeline", "prepare", "--engine", "in-process"], None),
    ([sys.executable, "-m", "data_pipeline", "dedup", "in.jsonl", "out.jsonl"], None),
    ([sys.executable, "-m", "training", "export", "run/checkpoints", "out"], None),
    (["/venv/bin/ray", "start", "--head", "--block"], "a Ray node"),
    ("ray status --address 127.0.0.1:6379", None),
    (["git", "status"], None),
])
def test_the_guard_knows_what_only_the_slow_tier_starts(command, what):
    assert launch_in(command) == what


def test_a_fast_test_that_starts_train_py_fails_with_its_name_and_the_fix(request, only_slow_tests_launch):
    with pytest.raises(pytest.fail.Exception) as failure:
        subprocess.run([sys.executable, "train.py", "--recipe", "tiny_llama"], capture_output=True)
    message = str(failure.value)
    assert request.node.nodeid in message and "mark it @pytest.mark.slow" in message
    assert only_slow_tests_launch == [message]
    only_slow_tests_launch.clear()  # this test's launch was refused on purpose


@pytest.fixture(scope="module")
def launch_from_a_module_fixture() -> str | None:
    """A module fixture that starts train.py: it is set up within the first test that asks for it."""
    try:
        subprocess.run([sys.executable, "train.py", "--help"], capture_output=True)
    except pytest.fail.Exception as failure:
        return str(failure)
    return None


def test_a_launch_in_a_module_fixture_fails_the_test_that_sets_it_up(request, launch_from_a_module_fixture,
                                                                      only_slow_tests_launch):
    assert launch_from_a_module_fixture is not None and request.node.nodeid in launch_from_a_module_fixture
    assert only_slow_tests_launch == [launch_from_a_module_fixture]
    only_slow_tests_launch.clear()


def test_an_in_process_datatrove_job_fails_too(only_slow_tests_launch):
    executor = pytest.importorskip("datatrove.executor.local").LocalPipelineExecutor([], tasks=1, workers=1)
    with pytest.raises(pytest.fail.Exception, match="starts a datatrove job"):
        executor.run()
    only_slow_tests_launch.clear()


def test_a_process_that_is_no_launch_starts(only_slow_tests_launch):
    assert subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True).stdout == "ok\n"
    assert only_slow_tests_launch == []


@pytest.mark.slow
def test_a_slow_test_may_start_train_py(only_slow_tests_launch):
    result = subprocess.run([sys.executable, "train.py", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--recipe" in result.stdout


SPAWNS_A_RANK = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(rank.pid))
time.sleep(600)
"""


@pytest.mark.slow
def test_a_launch_past_its_timeout_is_ended_with_its_ranks(tmp_path):
    """subprocess.run kills a launch at its timeout: the whole process group, not the launcher alone, whose ranks
    would go on (a rank waiting for a peer in DeepSpeed's shared-memory all-reduce spins on a core)."""
    import psutil
    pid_file = tmp_path / "rank.pid"
    with pytest.raises(subprocess.TimeoutExpired):  # "train.py" makes it a launch to the guard
        subprocess.run([sys.executable, "-c", SPAWNS_A_RANK, str(pid_file), "train.py"], timeout=5)
    rank, deadline = int(pid_file.read_text()), time.monotonic() + 10

    def ended() -> bool:  # gone, or a zombie that no one reaps yet
        try:
            return psutil.Process(rank).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    while not ended() and time.monotonic() < deadline:  # SIGKILL is delivered, not awaited
        time.sleep(0.05)
    assert ended()
