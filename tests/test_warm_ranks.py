"""The warm ranks (tests/warm_ranks.py) give what fresh processes give: a run in the pool after runs that patched
DeepSpeed and transformers (Ulysses' attention wrapper and ZeRO-3's summing reduce-scatter under sequence
parallelism; the probes' patches of train.py and DeepSpeedEngine in the earlier tests' runs) computes bit for bit what
a launch computes."""
import json
import shutil
import signal

import pytest

from tests.conftest import SMALL_MODEL, TRAIN_ENV, deepspeed_ops_built, on_gpu, run_train
from tests.warm_ranks import WarmRanks, extensions_dir, warm_ranks


def records(out) -> list[tuple]:
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, (out / "metrics.jsonl").open()) if "loss" in r]


@pytest.mark.slow
def test_a_run_after_other_runs_in_the_pool_computes_what_a_fresh_launch_computes(tmp_path, data_cache):
    common = ["--recipe", "tiny_llama", SMALL_MODEL, data_cache, "training.max_steps=3", "logging.every_steps=1",
              "deepspeed.config=zero3", "precision=fp32"]
    probed = ["--insert-poisoned-batches", "spike:1", "--record-logits"]
    # the probed run last in the pool, after runs that changed what a run can change (probes, another layout)
    runs = {"plain warm": ([], common, False), "sp warm": ([], [*common, "parallelism.sequence_parallel=2"], False),
            "probed warm": (probed, common, False), "probed launched": (probed, common, True)}
    for name, (probes, args, launch) in runs.items():
        out = tmp_path / name.replace(" ", "_")
        result = run_train([*probes, *args, "--output-dir", str(out)], ranks=2, launch=launch,
                           script="tests/helpers/train_with_probes.py" if probes else "train.py")
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        assert result.stdout.count("peak memory per rank") == 1  # rank 0's summary, once, as the launcher shows it
    warm, launched = records(tmp_path / "probed_warm"), records(tmp_path / "probed_launched")
    assert len(warm) == 3 and warm == launched
    flat = [[value for record in records(tmp_path / f"{kind}_warm") for value in record] for kind in ("sp", "plain")]
    assert flat[0] == pytest.approx(flat[1], rel=1e-5)  # tests/test_parallelism.py's tolerance for SP
    assert (tmp_path / "probed_warm" / "engine_logits.pt").exists()
    assert not (tmp_path / "plain_warm" / "engine_logits.pt").exists()


@pytest.mark.slow
def test_a_run_goes_through_the_lock_files_a_killed_build_leaves(tmp_path, data_cache):
    """torch holds an op's `lock` file while it checks or builds the op, and every later load waits for the file to
    go: a rank SIGKILLed in that window (a failing peer, a timeout) left it on a clean machine, and every later run
    of that CI session waited until the 90-minute cut. The pool's parent loads the ops before it forks, so its
    ranks never look at the locks."""
    deepspeed_ops_built()
    ops = {"deepspeed_shm_comm", "cpu_adam", "fused_adam"}
    assert ops <= {path.parent.name for path in extensions_dir().glob("*/*.so")}, "torch builds its ops elsewhere"
    copy = tmp_path / "torch_extensions"
    shutil.copytree(extensions_dir(), copy)
    pool = WarmRanks(tmp_path, dict(TRAIN_ENV, TORCH_EXTENSIONS_DIR=str(copy)))
    try:
        pool.start()
        for op in ops:
            (copy / op / "lock").touch()  # as a rank killed while loading it leaves it
        result = pool.run("train.py", ["--recipe", "tiny_llama", SMALL_MODEL, data_cache, "training.max_steps=1",
                                       "deepspeed.config=zero2_offload", "--output-dir", str(tmp_path / "out")],
                          ranks=2, timeout=120)
    finally:
        pool.close()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "peak memory per rank" in result.stdout


def test_on_a_gpu_runs_launch_instead_of_going_to_the_forked_warm_ranks(monkeypatch):
    """CUDA cannot start in a process forked from one that imported torch: on the first GPU run of the fp16 tests every
    warm rank stopped at torch.cuda.set_device. There the harness launches each run and starts no warm ranks."""
    import subprocess

    import tests.conftest as harness

    launched = []
    monkeypatch.setattr(harness, "on_gpu", lambda: True)
    monkeypatch.setattr(harness, "warm_ranks", lambda env: pytest.fail("a GPU run went to the warm ranks"))
    monkeypatch.setattr(harness, "log_run", lambda record: launched.append(record))
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(command, 0, "", ""))
    assert run_train(["--recipe", "tiny_llama"], ranks=1).returncode == 0
    assert [record["warm"] for record in launched] == [False]


class Interrupted(Exception):
    """What a test's timeout raises into the wait (pytest-timeout's signal method)."""


@pytest.mark.slow
def test_a_run_whose_wait_is_interrupted_is_ended_and_the_next_run_gets_its_own_result(tmp_path, data_cache):
    """A test's timeout (pytest-timeout) raises inside the pool's wait: the run's ranks are ended and their ends
    read, so that the next run's reply is its own, not a leftover of the interrupted one."""
    import psutil
    if on_gpu():
        pytest.skip("on a GPU runs launch")
    pool = warm_ranks(TRAIN_ENV)
    pool.start()

    def interrupt(signum, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 3)
    try:
        with pytest.raises(Interrupted):
            run_train(["--recipe", "tiny_llama", SMALL_MODEL, data_cache, "training.max_steps=100000",
                       "--output-dir", str(tmp_path / "long")], ranks=2)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert psutil.Process(pool.process.pid).children() == []  # both ranks ended and reaped
    result = run_train(["--recipe", "tiny_llama", "--help"])
    assert result.returncode == 0 and "--recipe" in result.stdout
