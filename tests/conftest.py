import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from functools import cache
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import warm_ranks as pool  # noqa: E402
from tests.warm_ranks import PROCESS_PROBES, warm_ranks  # noqa: E402
from tests.warm_ranks import SCRIPTS as WARM_SCRIPTS  # noqa: E402
from training.parallel.launch import launcher_command  # noqa: E402

# Each xdist worker takes its share of the cores (set before any test imports torch): with torch's default of one
# thread per core the 2 workers of CI ran 4 threads on 2 cores, and the fast tier's tests took 1.6x their time
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // int(workers))))

# The pytest session that owns test-results/ (xdist's workers and a pytest that a test starts inherit it): only it
# empties runs.jsonl and writes launches.json
OWNS_RESULTS = os.environ.setdefault("TESTS_RESULTS_OWNER", str(os.getpid())) == str(os.getpid())

# A 2-layer, 64-wide shrink of tiny_llama: the same code path in seconds.
SMALL_MODEL = ("model.config_overrides={num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
               "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}")


def train_command(args: list[str], ranks: int | None = None, script: str = "train.py") -> list[str]:
    """train.py (or a script that wraps it) as users run it: through the `deepspeed` launcher with `ranks`
    ranks, or with plain `python` when `ranks` is None."""
    return [sys.executable, script, *args] if ranks is None else launcher_command(ranks, script, args)


# glibc's malloc keeps freed blocks under 32 MiB for reuse instead of giving them back to the kernel after each use:
# half the page faults of a small model's run on 2 ranks, about a tenth less CPU time; the numbers are unchanged
TRAIN_ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MALLOC_MMAP_THRESHOLD_=str(32 << 20),
                 MALLOC_TRIM_THRESHOLD_=str(4 << 30), MALLOC_TOP_PAD_=str(256 << 20))


@cache
def on_gpu() -> bool:
    """Whether runs launch: warm ranks are forked from a parent that imported torch and DeepSpeed, and CUDA cannot be
    set up again in a fork ("Cannot re-initialize CUDA in forked subprocess", the first GPU run of the fp16 and fp8
    tests). torch is imported here, not with this file: xdist's controller imports it and runs no test."""
    import torch
    return torch.cuda.is_available()


def run_train(args: list[str], ranks: int | None = None, timeout: int = 600, script: str = "train.py",
              launch: bool = False) -> subprocess.CompletedProcess:
    """`train_command(args, ranks, script)`'s exit code and output. It runs on the session's warm ranks
    (tests/warm_ranks.py), unless `launch`, a probe of the process life (a kill, a crash on one rank) or a GPU asks
    for a real launch."""
    warm = not (launch or on_gpu() or script not in WARM_SCRIPTS or any(probe in args for probe in PROCESS_PROBES))
    start = time.monotonic()
    try:
        if warm:
            result = warm_ranks(TRAIN_ENV).run(script, args, ranks, timeout)
        else:
            deepspeed_ops_built()
            result = subprocess.run(train_command(args, ranks, script), cwd=REPO, env=TRAIN_ENV,
                                    capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as timeout_expired:
        if locks := pool.build_locks():
            raise RuntimeError(f"{timeout_expired}; these build locks of torch's JIT ops are present: {locks}. One "
                               "that a killed process left makes every load of its op wait forever: remove it "
                               "once no build runs") from timeout_expired
        raise
    log_run({"test": running[-1].nodeid if running else None, "script": script, "args": args, "ranks": ranks,
             "warm": warm, "seconds": round(time.monotonic() - start, 1), "code": result.returncode})
    return result


def deepspeed_ops_built() -> None:
    """DeepSpeed's CPU ops built before a launched run's ranks load them: the warm ranks' parent builds them, a
    process no test kills (why: tests/helpers/warm_rank.py). On a GPU the ranks JIT-build the CUDA ops themselves."""
    if not on_gpu():
        warm_ranks(TRAIN_ENV).start()


def log_run(record: dict) -> None:
    """test-results/runs.jsonl: every training a test starts, for finding where the time goes and runs repeated."""
    with open(REPO / "test-results" / "runs.jsonl", "a") as log:
        log.write(json.dumps(record) + "\n")


RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # a process group sets them


@contextmanager
def rank_of_its_own() -> Iterator[None]:
    """For a process group of this process alone (init_distributed sets the rank variables when they are missing):
    none may be set before, and none is left after, so that the next test starts from the same environment."""
    assert not any(key in os.environ for key in RANK_VARIABLES), \
        f"a test left {[key for key in RANK_VARIABLES if key in os.environ]} set: the next rank would join its group"
    try:
        yield
    finally:
        for key in RANK_VARIABLES:
            os.environ.pop(key, None)


def main_in_process(main: Callable[[list[str]], int], argv: list[str]) -> subprocess.CompletedProcess:
    """A command's main(argv) in this process, its exit code and output as the process would leave them (argparse's
    usage errors exit 2 through SystemExit): the fast tier's way to run a command without a process's imports."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
    return subprocess.CompletedProcess([main.__module__, *argv], code, out.getvalue(), err.getvalue())


def train_in_process(args: list[str]) -> subprocess.CompletedProcess:
    """train.py's main(args) in this process, on one rank (a gloo group of this process alone, as `python train.py`
    makes). The SIGTERM handler a run sets is put back, so that pytest still ends on SIGTERM."""
    import train
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with rank_of_its_own():
            return main_in_process(train.main, args)
    finally:
        signal.signal(signal.SIGTERM, handler)
        train.stop_requested.clear()


def save_small_checkpoint(path: Path, shape: dict | None = None, **save_options) -> None:
    """SMALL_MODEL's architecture (with `shape`'s config values in place of its own) with seeded random weights and
    tiny_llama's tokenizer, saved with save_pretrained: the checkpoint a user brings."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    config = AutoConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json", **{
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, **(shape or {})})
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, **save_options)
    AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer").save_pretrained(path)


def small_grpo_run(model: Path, folder: Path, steps: int) -> list[str]:
    """The small GRPO runs' command line (tests/test_grpo.py, tests/test_grpo_vllm.py): tiny_llama_grpo from `model`
    on folder/prompts.jsonl, 4 prompts x 4 generations a step of at most 10 tokens, 16 completions a step, fp32,
    constant lr 1e-3 and beta 0.04, every step logged."""
    return ["--recipe", "tiny_llama_grpo", f"model.name_or_path={model}",
            f"data.sources=[{{path: {folder / 'prompts.jsonl'}}}]", f"data.cache_dir={folder / 'cache'}",
            "data.seq_len=20", "grpo.num_generations=4", "grpo.max_completion_length=10",
            "training.micro_batch_size=8", "training.global_batch_size=16", "training.lr=1e-3",
            "training.schedule=constant", "training.warmup_steps=0", "logging.every_steps=1", "precision=fp32",
            "logging.report_to=[]", f"training.max_steps={steps}", "grpo.beta=0.04"]


def save_small_reward_model(path: Path) -> None:
    """A reward model of SMALL_MODEL's architecture: a sequence classifier with one label (TRL's), seeded random
    weights whose score head gives completions rewards of different sizes, and tiny_llama's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    config = AutoConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json", num_hidden_layers=2, hidden_size=64,
                                        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, num_labels=1)
    torch.manual_seed(11)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer").save_pretrained(path)


def launch_in(command) -> str | None:
    """What a command line starts that only the slow tier may start: train.py or a script of tests/helpers/ (which
    wrap train.py or run under the launcher), the deepspeed or accelerate launcher, a datatrove job or a Ray node;
    None for anything else."""
    words = [command] if isinstance(command, (str, bytes, os.PathLike)) else list(command)
    words = [str(word) for word in words]
    if len(words) == 1:  # a shell command line
        words = words[0].split()
    names = [Path(word).name for word in words]
    if "deepspeed" in names or any(word.startswith("deepspeed.launcher") for word in words):
        return "the deepspeed launcher"
    if "accelerate" in names or "accelerate.commands.launch" in words:
        return "the accelerate launcher"
    if "train.py" in names or any("tests/helpers/" in word for word in words):
        return "train.py"
    if "--engine=datatrove" in words or any(pair == ("--engine", "datatrove") for pair in zip(words, words[1:])):
        return "a datatrove job"
    if "ray" in names and "start" in words:
        return "a Ray node"
    return None


running: list[pytest.Item] = []  # the test whose setup, call or teardown runs now (fixtures of every scope included)
refused: list[str] = []  # the unmarked launches of that test
started: list["GuardedPopen"] = []  # the launches of that test that have a process group of their own


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    running.append(item)
    refused.clear()
    try:
        return (yield)
    finally:
        running.pop()
        while started:  # what a failed test left running: a rank left waiting for its peer would spin for good
            if (launch := started.pop()).poll() is None:
                launch.kill()


def refuse_unmarked_launch(what: str, command) -> None:
    """Fail the running test if it is not marked slow: it starts `what` (launch_in), itself or through a fixture."""
    if not running or running[-1].get_closest_marker("slow"):
        return
    shown = command if isinstance(command, str) else " ".join(map(str, command))
    refused.append(f"{running[-1].nodeid} starts {what} ({shown}) but is not marked slow: mark it "
                   f"@pytest.mark.slow, or test its logic in-process")
    pytest.fail(refused[-1], pytrace=False)


launches: Counter[str] = Counter()  # the session's real launches by what they start (warm ranks apart)


class GuardedPopen(subprocess.Popen):
    """A launch (launch_in) runs in a process group of its own unless its caller chose one, and kill() ends the
    group: subprocess.run kills on a timeout, and the launcher killed alone leaves its ranks running, where a rank
    waiting for its peer in DeepSpeed's shared-memory all-reduce spins on a core without end. The warm ranks' parent
    outlives the test that starts it, and keeps its group."""

    def __init__(self, args, *more, **options):
        self.group = False
        if what := launch_in(args):
            refuse_unmarked_launch(what, args)
            warm = pool.WORKER in map(str, args)
            launches["the warm ranks" if warm else what] += 1
            if not warm and options.get("process_group") is None:
                self.group = options.setdefault("start_new_session", True)
        super().__init__(args, *more, **options)
        if self.group:
            started.append(self)

    def kill(self) -> None:
        if not self.group:
            return super().kill()
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group has ended
            pass
        self.wait()


def pytest_configure(config: pytest.Config) -> None:
    """The fast tier (-m "not slow") stays fast: a test not marked slow that starts train.py, the deepspeed or
    accelerate launcher or a datatrove job (a process, or datatrove's local executor in-process), in its body or in
    a fixture of any scope, fails, naming itself. Installed for the whole session, so module and session fixtures are
    watched too. test-results/runs.jsonl starts empty (log_run)."""
    subprocess.Popen = GuardedPopen
    (REPO / "test-results").mkdir(exist_ok=True)
    if OWNS_RESULTS:
        (REPO / "test-results" / "runs.jsonl").write_text("")
    try:
        from datatrove.executor.local import LocalPipelineExecutor
    except ImportError:
        return
    run = LocalPipelineExecutor.run

    def guarded_run(executor: LocalPipelineExecutor):
        refuse_unmarked_launch("a datatrove job", "LocalPipelineExecutor.run, in-process")
        return run(executor)

    LocalPipelineExecutor.run = guarded_run


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with slow tests first, each file's tests together and in their order: xdist's loadfile hands the
    files out in this order, so the fast files (a minute of both workers) fill the end, where one worker used to run
    the last slow file alone for about 100 s while the other had nothing left."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def pytest_collection_finish(session: pytest.Session) -> None:
    """An xdist worker with trainings to run starts its warm ranks now, unwaited: their imports and, on a clean
    machine, the build of DeepSpeed's CPU ops (about 100 s of both cores) go on beside the worker's first tests,
    which before waited for them idle. (A pytest that a test starts is no worker: it starts none.)"""
    if hasattr(session.config, "workerinput") and not on_gpu() and any(
            item.get_closest_marker("slow") for item in session.items):
        warm_ranks(TRAIN_ENV).spawn()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Closes the warm ranks; test-results/launches.json keeps the session's launches and warm runs (docs/testing.md
    quotes them). Under pytest-xdist each worker hands its count to the controller, which writes the sum."""
    if pool.pool is not None:
        pool.pool.close()
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["launches"] = launch_record()
    elif OWNS_RESULTS:
        (REPO / "test-results" / "launches.json").write_text(json.dumps(launch_record(), indent=1))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """An xdist worker's launches, added to this controller's."""
    record = getattr(node, "workeroutput", {}).get("launches", {"launches": {}, "warm_runs": 0})
    launches.update(record["launches"])
    worker_warm_runs.append(record["warm_runs"])


def pytest_terminal_summary(terminalreporter) -> None:
    record = launch_record()
    real = sum(count for what, count in record["launches"].items() if what != "the warm ranks")
    terminalreporter.write_line(f"launches: {real} real ({record['launches']}), {record['warm_runs']} runs on warm "
                                "ranks")


worker_warm_runs: list[int] = []  # the warm runs of each xdist worker that has ended


def launch_record() -> dict:
    own = pool.pool.runs if pool.pool is not None else 0
    return {"launches": dict(launches), "warm_runs": own + sum(worker_warm_runs)}


@pytest.fixture
def no_model_building(monkeypatch):
    """Fail the test if train.py gets as far as building a model or a process group."""
    import train

    def forbidden(*args, **kwargs):
        raise AssertionError("train.py went past validation")
    monkeypatch.setattr(train, "build_run_model", forbidden)
    monkeypatch.setattr(train.distributed, "init_distributed", forbidden)


@pytest.fixture(autouse=True)
def only_slow_tests_launch() -> list[str]:
    """The launches refused to this test; it fails at teardown also when it caught the failure raised at the launch."""
    yield refused
    if refused:
        pytest.fail(refused[0], pytrace=False)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """One prepared-data cache for the whole session, so each run does not re-tokenize the corpus."""
    return f"data.cache_dir={tmp_path_factory.mktemp('data_cache')}"


def left_in_session(leader: int, wait_s: float = 10.0) -> list[psutil.Process]:
    """The processes of the session `leader` started still alive (a zombie is gone) after up to `wait_s` (a SIGKILLed
    process takes a moment to end)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for process in psutil.process_iter():
            try:
                if os.getsid(process.pid) == leader and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
            except (ProcessLookupError, psutil.Error):
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def strict_loads(text: str):
    """json.loads as jq and JavaScript's JSON.parse read: NaN, Infinity and -Infinity are not JSON."""
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def tree_state(*folders: Path) -> dict[Path, tuple[int, str]]:
    """Every file under the folders: (size, sha256), by absolute path."""
    import hashlib
    return {path: (path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
            for folder in folders for path in Path(folder).rglob("*") if path.is_file() and not path.is_symlink()}


def assert_only_created(before: dict[Path, tuple[int, str]], after: dict[Path, tuple[int, str]],
                        replaceable: tuple[Path, ...] = ()) -> None:
    """The tree guard: every file that was there before is there after, unchanged, except under `replaceable` (an
    earlier output of the same command, given with --overwrite). New files are what the command created."""
    def may_change(path: Path) -> bool:
        return any(path == place or place in path.parents for place in replaceable)

    lost = sorted(str(path) for path in before if path not in after and not may_change(path))
    changed = sorted(str(path) for path in before if path in after and after[path] != before[path]
                     and not may_change(path))
    assert not lost and not changed, f"deleted: {lost[:10]}; changed: {changed[:10]}"


@pytest.fixture
def tree_guard(tmp_path):
    """Call it around a command: `with tree_guard(): ...` fails the test if the command deleted or changed a file under
    the test's folder (tmp_path) or the repository's recipes and ds_configs, apart from `replaceable` places."""
    @contextmanager
    def guard(*replaceable: Path, folders: tuple[Path, ...] = ()):
        watched = (tmp_path, REPO / "recipes", REPO / "ds_configs", *folders)
        before = tree_state(*watched)
        yield
        assert_only_created(before, tree_state(*watched), tuple(Path(p).absolute() for p in replaceable))

    return guard


@pytest.fixture
def earlier_run(tmp_path) -> Path:
    """An output folder holding a run with two checkpoints, as train.py leaves it."""
    run = tmp_path / "run"
    for step in (2, 4):
        tag = run / "checkpoints" / f"global_step{step}"
        tag.mkdir(parents=True)
        (tag / "run_state.json").write_text(json.dumps({"step": step, "tokens_seen": 100 * step, "world_size": 1,
                                                        "zero_stage": 1, "precision": "fp32"}))
        (tag / "mp_rank_00_model_states.pt").write_bytes(b"weights")
        (tag / "rank_state0.pt").write_bytes(b"data position and RNG")
    (run / "checkpoints" / "latest").write_text("global_step4")
    (run / "metrics.jsonl").write_text('{"step": 4, "loss": 5.0}\n')
    (run / "resolved_recipe.yaml").write_text("model: {}\n")
    (run / ".written-by.json").write_text('{"command": "train.py"}\n')
    return run


@pytest.fixture
def one_rank():
    """A process group of this process alone (gloo on CPU), for code that needs one in-process; torn down
    through deepspeed.comm, so that DeepSpeed forgets the groups it cached for the next test's engine."""
    import deepspeed.comm

    from training.parallel import distributed
    with rank_of_its_own():
        distributed.init_distributed()
        yield
        deepspeed.comm.destroy_process_group()
