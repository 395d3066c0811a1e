"""Warm ranks: the slow tier's trainings without a launch each.

Starting a run through the `deepspeed` launcher costs seconds of imports in the launcher and in every rank before the
first step; most slow tests prove what a run computes, not how it starts. The pool keeps one process
(tests/helpers/warm_rank.py) alive for the whole pytest session that has imported the product once and forks the
ranks of each run from itself. Each rank gets the variables the launcher would set (a new MASTER_PORT each time, so a
new gloo group) and runs the script's main(args) in a process of its own, forked from a parent that never runs a
job: no run sees what another changed. What the launcher does around the ranks, the pool does too: each rank's
output is collected (rank 0's first), and the first rank to end with a non-zero code ends the others and gives the
run its exit code.

A rank killed by a probe (`--kill-after-deepspeed-save`) is a process SIGKILLed as under the launcher, and the pool
ends the others as the launcher does. Runs whose subject is the launch itself (a crash on one rank, signals, the
launcher's own output, a kill's effect on the launched run) go through a real launch: `run_train(..., launch=True)`,
or a probe in PROCESS_PROBES.
"""
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from training.parallel.launch import free_port

REPO = Path(__file__).resolve().parent.parent
WORKER = "tests/helpers/warm_rank.py"
SCRIPTS = ("train.py", *(f"tests/helpers/{name}.py" for name in  # those the ranks can run: their main(argv)
                          ("train_with_probes", "train_fp8_on_cpu", "lora_steps", "optimizer_steps", "pipeline_loss",
                           "sequence_parallel_row", "upstream_bugs")), "benchmarks/bare_loop.py")
PROCESS_PROBES = ("--fail-on-rank",)  # a crash on one rank: how the launcher ends the others is the subject
START_TIMEOUT_S = 1800.0  # imports, and on a clean machine the build of DeepSpeed's CPU ops (minutes)
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
                  "MASTER_PORT")


class WarmRanks:
    """The session's forking process (tests/helpers/warm_rank.py), started at the first run (in an xdist worker, once
    its tests are collected: conftest.py) and again if it ends."""

    def __init__(self, folder: Path, env: dict[str, str]):
        self.folder, self.env = folder, {k: v for k, v in env.items() if k not in RANK_VARIABLES}
        self.process: subprocess.Popen | None = None
        self.replies, self.pending, self.ready = -1, b"", False
        self.runs = 0

    def spawn(self) -> None:
        """The process started, not waited for (start() waits until it is ready)."""
        if self.process is None or self.process.poll() is not None:
            self.close()
            read, write = os.pipe()
            with open(self.folder / "warm_ranks.log", "ab") as log:
                self.process = subprocess.Popen([sys.executable, WORKER, str(write)], cwd=REPO, env=self.env,
                                                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                                pass_fds=(write,))
            os.close(write)
            self.replies, self.pending, self.ready = read, b"", False

    def start(self) -> None:
        """The process started and ready. Past START_TIMEOUT_S it raises TimeoutError and is left running: killing
        it might leave an op's build lock behind (tests/helpers/warm_rank.py); the next call waits again."""
        self.spawn()
        if not self.ready:
            if self.reply(time.monotonic() + START_TIMEOUT_S) is None:
                raise RuntimeError(f"the warm ranks died while starting (exit {self.process.returncode}): see "
                                   f"{self.folder / 'warm_ranks.log'}")
            self.ready = True

    def reply(self, deadline: float) -> dict | None:
        """The process's next reply; None once it has died. TimeoutError past the deadline."""
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.replies], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self.replies, 4096)
            if not chunk:
                self.process.wait()
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, script: str, args: list[str], ranks: int | None, timeout: float) -> subprocess.CompletedProcess:
        """`script args` as `deepspeed --num_gpus ranks script args` runs it (as `python script args` when ranks is
        None): exit code, stdout and stderr as the launcher leaves them."""
        self.start()
        self.runs += 1
        port, outputs, jobs = free_port(), [], []
        for rank in range(ranks or 1):
            env = {} if ranks is None else {
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_SIZE": str(ranks),
                "CROSS_RANK": "0", "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            files = [self.folder / f"run{self.runs}_rank{rank}.{name}" for name in ("stdout", "stderr")]
            outputs.append(files)
            jobs.append({"args": args if ranks is None else [f"--local_rank={rank}", *args], "env": env,
                         "stdout": str(files[0]), "stderr": str(files[1])})
        self.process.stdin.write((json.dumps({"script": script, "ranks": jobs}) + "\n").encode())
        self.process.stdin.flush()
        code = self.collect(timeout, [script, *args], outputs)
        stdout, stderr = ("".join(files[i].read_text(errors="replace") for files in outputs) for i in (0, 1))
        return subprocess.CompletedProcess([script, *args], code, stdout, stderr)

    def collect(self, timeout: float, command: list[str], outputs: list) -> int:
        """The run's exit code, as the launcher gives it: the first non-zero exit ends the other ranks. A run past
        its timeout, or a wait a test's own timeout interrupts (pytest-timeout), ends its ranks first."""
        deadline = time.monotonic() + timeout
        pids = self.reply(deadline)["pids"]
        running, code = set(range(len(pids))), 0
        try:
            while running:
                reply = self.reply(deadline)
                if reply is None:
                    raise RuntimeError(f"the warm ranks died during a run: see {self.folder / 'warm_ranks.log'}")
                running.discard(reply["rank"])
                if reply["code"] and not code:
                    code = reply["code"]
                    self.end_ranks(pids, running)  # the launcher ends the others
        except TimeoutError:
            self.end_run(pids, running)
            output = "".join(files[0].read_text(errors="replace") for files in outputs)
            raise subprocess.TimeoutExpired(command, timeout, output=output) from None
        except BaseException:
            self.end_run(pids, running)
            raise
        return code

    def end_run(self, pids: list[int], running: set[int]) -> None:
        """The run's remaining ranks killed and their ends read, so that the pool's next reply is the next run's.
        If the ends do not come within a minute, the pool is closed: the next run starts a new one."""
        self.end_ranks(pids, running)
        try:
            while running and (reply := self.reply(time.monotonic() + 60)) is not None:
                running.discard(reply["rank"])
        except TimeoutError:
            self.close()

    @staticmethod
    def end_ranks(pids: list[int], ranks: set[int]) -> None:
        for rank in ranks:
            try:
                os.kill(pids[rank], signal.SIGKILL)
            except ProcessLookupError:  # it has just ended
                pass

    def close(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.stdin.close()
                try:
                    self.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            os.close(self.replies)
            self.process, self.replies = None, -1


def extensions_dir() -> Path:
    """Where torch builds this interpreter's JIT ops on a CPU: the rule of torch 2.13's
    cpp_extension._get_build_directory (tests/test_warm_ranks.py fails if the ops are not found there)."""
    from torch.utils.cpp_extension import get_default_build_root
    if root := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(root)
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}_cpu"


def build_locks() -> list[str]:
    """The lock files of torch's JIT op builds now present (tests/helpers/warm_rank.py says why they matter)."""
    return sorted(str(lock) for lock in extensions_dir().glob("*/lock"))


pool: WarmRanks | None = None


def warm_ranks(env: dict[str, str]) -> WarmRanks:
    """The session's pool, started on first use (conftest.py closes it at the session's end)."""
    global pool
    if pool is None:
        pool = WarmRanks(Path(tempfile.mkdtemp(prefix="warm_ranks_")), env)
    return pool
