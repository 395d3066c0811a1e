"""When one rank fails, every rank stops within seconds: with that rank's exit code, its message printed once.

A rank that raises after the process group exists cannot just exit. Its peers would wait in their next
collective until a timeout (30 minutes on gloo, 10 on nccl) or until a launcher kills them, and DeepSpeed's
launcher does that only on its own node, after a 30-second grace. So the failing rank posts its exit code
in the process group's key-value store (the TCPStore at MASTER_ADDR:MASTER_PORT that every rank of every
node reaches), and a thread on every rank polls the store and ends its process when the code appears. The
first rank to fail prints its message; every other rank exits quietly with the same code. The failing rank
waits until the others have seen the code, so that no rank first meets a collective broken by a departed
peer and reports that instead; rank 0, which hosts the store, leaves after the failing rank is done with it.
"""
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

POLL_S = 0.5  # how often each rank looks for a failure
LINGER_S = 15.0  # how long the failing rank and rank 0 wait for the others to see it


def launch_store(timeout: timedelta) -> dist.TCPStore:
    """A client of the launch's key-value store: the TCPStore at MASTER_ADDR:MASTER_PORT that every rank of every
    node reaches. `timeout`: how long its blocking calls (and its connection) may wait."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         wait_for_workers=False, timeout=timeout)


def attempt_key(name: str) -> str:
    """`name` for this launch attempt only: an elastic agent's store outlives a restart."""
    return f"{name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class FailureWatch:
    """Started once the process group exists; `fail` ends every rank, `stop` ends the watching."""

    def __init__(self, rank: int, local_rank: int, world_size: int):
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        prefix = attempt_key("train-failure")
        self.code_key, self.count_key = f"{prefix}/code", f"{prefix}/count"
        self.seen_key, self.done_key = f"{prefix}/seen", f"{prefix}/done"
        self.store = launch_store(timedelta(seconds=LINGER_S))
        self.failing, self.stopped = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self.watch, name="failure-watch", daemon=True)
        self.thread.start()

    def watch(self) -> None:
        while not self.stopped.wait(POLL_S):
            try:
                posted = self.store.check([self.code_key])
            except Exception:  # noqa: BLE001 (any store error means the same: rank 0 and its store are gone)
                if not (self.stopped.is_set() or self.failing.is_set()):
                    self.lost_rank_0()
                return
            if posted and not self.failing.is_set():
                self.follow()

    def fail(self, code: int, message: str) -> None:
        """Called by a rank whose main thread failed: never returns."""
        self.failing.set()
        try:
            first = self.store.add(self.count_key, 1) == 1
        except Exception:  # noqa: BLE001 (rank 0 and its store are gone: nobody is left to tell)
            first = True
        if not first:
            self.follow()  # another rank failed first (often the cause of this rank's error): leave quietly, as it says
        print(message, file=sys.stderr, flush=True)
        try:
            self.store.set(self.code_key, str(code))
            self.linger(lambda: self.store.add(self.seen_key, 0) >= self.world_size - 1)
            self.store.set(self.done_key, "1")  # rank 0 may now take the store down
        except Exception:  # noqa: BLE001 (the store went away meanwhile: the others are ending anyway)
            pass
        os._exit(code)

    def follow(self) -> None:
        """Leave with the code another rank posted, once it is posted; rank 0, which hosts the store, only once
        the failing rank is done with it."""
        try:
            self.store.wait([self.code_key])
            code = int(self.store.get(self.code_key))
            self.store.add(self.seen_key, 1)
            if self.rank == 0:
                self.linger(lambda: self.store.check([self.done_key]))
        except Exception:  # noqa: BLE001 (the store went away while reading: the failing rank has left)
            code = 1
        os._exit(code)

    @staticmethod
    def linger(until: Callable[[], bool]) -> None:
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline and not until():
            time.sleep(POLL_S / 5)

    def lost_rank_0(self) -> None:
        if self.local_rank == 0:
            print(f"error: rank 0 is gone (the process group's store at {os.environ['MASTER_ADDR']}:"
                  f"{os.environ['MASTER_PORT']} stopped answering); stopping this node's ranks", file=sys.stderr,
                  flush=True)
        os._exit(1)

    def stop(self) -> None:
        """Stop watching (every rank, before the process group is torn down: then a vanished store is no failure)."""
        self.stopped.set()
        self.thread.join()
