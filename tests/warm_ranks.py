"""Warm ranks: the slow tier's trainings without a launch each.

Starting a run through the `deepspeed` launcher costs seconds of imports in the launcher and in every rank before the
first step; most slow tests prove what a run computes, not how it starts. The pool keeps rank processes
(tests/helpers/warm_rank.py) alive for the whole pytest session, one set per world size (1, 2, 4), each having
imported the product once. A run is sent to every rank of a set with the variables the launcher would set (a new
MASTER_PORT each time, so a new gloo group); the worker runs the script's main(args) in-process, then puts back the
state its imports left. What the launcher does around the ranks, the pool does too: each rank's output is collected
(rank 0's first), and the first rank to end with a non-zero code ends the others and gives the run its exit code.

A worker that dies (a failure on one rank ends every rank with os._exit, as in a real run), is ended, or retires (its
run failed, or left tensors alive that the restore could not free) is replaced, with the rest of its set, by fresh
ones, started as soon as the run ends. Runs whose subject is the launch or the process life (a kill, a crash on one
rank, signals, the launcher's own output) go through a real launch: `run_train(..., launch=True)`, or a probe in
PROCESS_PROBES.
"""
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from training.parallel.distributed import free_port

REPO = Path(__file__).resolve().parent.parent
WORKER = "tests/helpers/warm_rank.py"
SCRIPTS = ("train.py", *(f"tests/helpers/{name}.py" for name in  # those a worker can run: their main(argv)
                          ("train_with_probes", "lora_steps", "optimizer_steps", "pipeline_loss",
                           "sequence_parallel_row")))
PROCESS_PROBES = ("--kill-after-deepspeed-save", "--fail-on-rank")  # a kill -9, a crash on one rank: real launches
START_TIMEOUT_S = 300.0
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
                  "MASTER_PORT")


class Worker:
    """One warm rank process and its reply pipe."""

    def __init__(self, env: dict[str, str], log: Path):
        read, write = os.pipe()
        with open(log, "ab") as out:
            self.process = subprocess.Popen([sys.executable, WORKER, str(write)], cwd=REPO, env=env,
                                            stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                            pass_fds=(write,))
        os.close(write)
        self.replies, self.pending, self.ready = read, b"", False

    def reply(self, deadline: float) -> dict | None:
        """The worker's next reply; None once it has died (its exit code is then self.process.returncode).
        TimeoutError past the deadline."""
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

    def wait_ready(self, deadline: float) -> None:
        if not self.ready:
            if self.reply(deadline) is None:
                raise RuntimeError(f"a warm rank died while starting (exit {self.process.returncode}): see its log")
            self.ready = True

    def send(self, job: dict) -> None:
        self.process.stdin.write((json.dumps(job) + "\n").encode())
        self.process.stdin.flush()

    def alive(self) -> bool:
        return self.process.poll() is None

    def end(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait()
        if self.replies >= 0:
            os.close(self.replies)
            self.replies = -1


class WarmRanks:
    """The session's rank sets, by world size; started at their first run."""

    def __init__(self, folder: Path, env: dict[str, str]):
        self.folder, self.env = folder, {k: v for k, v in env.items() if k not in RANK_VARIABLES}
        self.sets: dict[int, list[Worker]] = {}
        self.runs = 0

    def workers(self, size: int) -> list[Worker]:
        """The set of `size` ranks; all of it new if any rank has ended. A set's ranks start together: DeepSpeed's
        shared-memory all-reduce on a CPU binds each process to the MASTER_PORT of its first group for good (its C++
        `initialize` returns at once when called again, deepspeed/ops/csrc/cpu/comm/shm_interface.cpp), so a new rank
        beside old ones would wait on buffers they never write."""
        workers = self.sets.get(size, [])
        if len(workers) < size or not all(worker.alive() for worker in workers):
            for worker in workers:
                worker.end()
            workers = self.sets[size] = [Worker(self.env, self.folder / f"worker_{size}_{rank}.log")
                                         for rank in range(size)]
        return workers

    def run(self, script: str, args: list[str], ranks: int | None, timeout: float) -> subprocess.CompletedProcess:
        """`script args` as `deepspeed --num_gpus ranks script args` runs it (as `python script args` when ranks is
        None): exit code, stdout and stderr as the launcher leaves them."""
        workers = self.workers(ranks or 1)
        deadline = time.monotonic() + START_TIMEOUT_S
        for worker in workers:
            worker.wait_ready(deadline)
        self.runs += 1
        port, outputs = free_port(), []
        for rank, worker in enumerate(workers):
            env = {} if ranks is None else {
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_SIZE": str(ranks),
                "CROSS_RANK": "0", "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            files = [self.folder / f"run{self.runs}_rank{rank}.{name}" for name in ("stdout", "stderr")]
            outputs.append(files)
            worker.send({"script": script, "args": args if ranks is None else [f"--local_rank={rank}", *args],
                         "env": env, "stdout": str(files[0]), "stderr": str(files[1])})
        code = self.collect(workers, time.monotonic() + timeout, [script, *args], outputs)
        self.workers(len(workers))  # replacements start warming up now, while the test checks the run
        stdout, stderr = ("".join(files[i].read_text(errors="replace") for files in outputs) for i in (0, 1))
        return subprocess.CompletedProcess([script, *args], code, stdout, stderr)

    def collect(self, workers: list[Worker], deadline: float, command: list[str], outputs: list) -> int:
        """The run's exit code, as the launcher gives it: the first non-zero exit ends the other ranks."""
        waiting = {worker.replies: worker for worker in workers}
        code = 0
        while waiting:
            left = deadline - time.monotonic()
            ready = select.select(list(waiting), [], [], max(left, 0))[0]
            if not ready:
                for worker in waiting.values():
                    worker.end()
                output = "".join(files[0].read_text(errors="replace") for files in outputs)
                raise subprocess.TimeoutExpired(command, 0, output=output)
            for fd in ready:
                worker = waiting.pop(fd)
                reply = worker.reply(deadline)
                rank_code = worker.process.returncode if reply is None else reply["code"]
                if reply and reply["retire"]:
                    worker.end()
                if rank_code and not code:
                    code = rank_code
                    for other in waiting.values():  # the launcher kills the others
                        other.end()
                    waiting.clear()
        return code

    def close(self) -> None:
        for workers in self.sets.values():
            for worker in workers:
                if worker.alive():
                    worker.process.stdin.close()
                    try:
                        worker.process.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
                worker.end()


pool: WarmRanks | None = None


def warm_ranks(env: dict[str, str]) -> WarmRanks:
    """The session's pool, started on first use (conftest.py closes it at the session's end)."""
    global pool
    if pool is None:
        pool = WarmRanks(Path(tempfile.mkdtemp(prefix="warm_ranks_")), env)
    return pool
