"""When one rank fails, every rank stops within seconds: with that rank's exit code, its message printed once.

A rank that raises after the process group exists cannot just exit. Its peers would wait in their next
collective until a timeout (30 minutes on gloo, 10 on nccl) or until a launcher kills them, and DeepSpeed's
launcher does that only on its own node, after a 30-second grace. So the failing rank posts its exit code
in the process group's key-value store (the TCPStore at MASTER_ADDR:MASTER_PORT that every rank of every
node reaches), and a thread on every rank polls the store and ends its process when the code appears. The
first rank to fail prints its message; every other rank exits quietly with the same code. The failing rank
waits until the others have seen the code, so that no rank first meets a collective broken by a departed
peer and reports that instead; rank 0, which hosts the store, leaves after the failing rank is done with it.

A rank that cannot post anything (its node killed, stopped or cut off) is found by its heartbeat: every
rank's watch counts itself alive in the store each BEAT_S. Rank 0's watch ends the run once a rank's count
has not moved for LOST_AFTER_S (a node that hangs: its peers would wait in their collective until the
process group's timeout); a rank whose collective fails (a peer's sockets closed: a node killed) first looks
for ranks whose count stands still for STALL_CHECK_S, so that the message names the lost node, not the
transport error. Either way one message names the node and the last complete checkpoint, and the exit code is
LOST_CODE.
"""
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

POLL_S = 0.5  # how often each rank looks for a failure
LINGER_S = 15.0  # how long the failing rank and rank 0 wait for the others to see it
BEAT_S = 1.0  # how often each rank counts itself alive
LOST_AFTER_S = 20.0  # a rank whose count has not moved for this long is lost (rank 0's watch ends the run)
STALL_CHECK_S = 3.0  # how long a failing rank watches the counts for ranks that stand still
LOST_CODE = 4  # the exit code of a run that lost a node: resume it (a scheduler may retry without a human)
LOST_CAUSES = "the node was killed, hangs or is cut off from the network"
EXIT_WAIT_S = 5.0  # how long a failing run's rank waits in each of exit_waits for what other ranks must do
exit_waits: list[Callable[[float], None]] = []  # what a rank waits for before it ends: the completion of a checkpoint
# written in the background (training/state/saving.py), so that a failure just after a save keeps it


def leave(code: int) -> None:
    """End this process with `code`, once what must finish first has (`exit_waits`, each given EXIT_WAIT_S)."""
    for wait in exit_waits:
        try:
            wait(EXIT_WAIT_S)
        except Exception:  # noqa: BLE001 (the exit code and message stand as they are)
            pass
    os._exit(code)


def node_name() -> str:
    """This rank's node as messages name it: its host, and its node rank where the launcher gives one (DeepSpeed's
    CROSS_RANK, srun's SLURM_NODEID): two nodes may share a host name."""
    number = os.environ.get("CROSS_RANK", os.environ.get("SLURM_NODEID"))
    return socket.gethostname() if number is None else f"node {number} ({socket.gethostname()})"


def launch_store(timeout: timedelta) -> dist.TCPStore:
    """A client of the launch's key-value store: the TCPStore at MASTER_ADDR:MASTER_PORT that every rank of every
    node reaches. `timeout`: how long its blocking calls (and its connection) may wait."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         wait_for_workers=False, timeout=timeout)


def attempt_key(name: str) -> str:
    """`name` for this launch attempt only: an elastic agent's store outlives a restart."""
    return f"{name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class FailureWatch:
    """Started once the process group exists; `fail` ends every rank, `stop` ends the watching. `resume_hint`: where
    the run continues from (the last complete checkpoint), for the message of a lost node."""

    def __init__(self, rank: int, local_rank: int, world_size: int, resume_hint: Callable[[], str] = lambda: ""):
        self.rank, self.local_rank, self.world_size, self.resume_hint = rank, local_rank, world_size, resume_hint
        prefix = attempt_key("train-failure")
        self.code_key, self.count_key = f"{prefix}/code", f"{prefix}/count"
        self.seen_key, self.done_key = f"{prefix}/seen", f"{prefix}/done"
        self.beat_keys = [f"{prefix}/beat/{other}" for other in range(world_size)]
        self.node_keys = [f"{prefix}/node/{other}" for other in range(world_size)]
        self.store = launch_store(timedelta(seconds=LINGER_S))
        self.store.set(self.node_keys[rank], node_name())
        self.store.add(self.beat_keys[rank], 1)
        self.counts: dict[int, tuple[int, float]] = {}  # rank 0's watch: each rank's count, and since when
        self.failing, self.stopped = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self.watch, name="failure-watch", daemon=True)
        self.thread.start()

    def watch(self) -> None:
        next_beat = time.monotonic()
        while not self.stopped.wait(POLL_S):
            lost = []
            try:
                posted = self.store.check([self.code_key])
                if time.monotonic() >= next_beat:
                    next_beat += BEAT_S
                    self.store.add(self.beat_keys[self.rank], 1)
                    if self.rank == 0:
                        lost = self.standing_still(LOST_AFTER_S)
            except Exception:  # noqa: BLE001 (any store error means the same: rank 0 and its store are gone)
                if not (self.stopped.is_set() or self.failing.is_set()):
                    self.lost_rank_0()
                return
            if self.failing.is_set():
                continue  # the main thread is failing: the watch only keeps this rank's count moving
            if posted:
                self.follow()
            if lost:
                self.fail(LOST_CODE, self.lost_message(lost, LOST_AFTER_S), lost)

    def standing_still(self, seconds: float) -> list[int]:
        """The ranks whose count has not moved for `seconds` (rank 0's watch, each BEAT_S)."""
        now = time.monotonic()
        for other, count in enumerate(int(value) for value in self.store.multi_get(self.beat_keys)):
            if self.counts.get(other, (None,))[0] != count:
                self.counts[other] = count, now
        return [other for other, (_, since) in self.counts.items() if now - since >= seconds]

    def stalled_ranks(self) -> list[int]:
        """The ranks whose count stands still for STALL_CHECK_S: those of a node that is gone."""
        before = self.store.multi_get(self.beat_keys)
        time.sleep(STALL_CHECK_S)
        return [other for other, (old, new) in enumerate(zip(before, self.store.multi_get(self.beat_keys)))
                if old == new and other != self.rank]

    def lost_message(self, lost: list[int], seconds: float) -> str:
        nodes: dict[str, list[int]] = {}
        for other, name in zip(lost, self.store.multi_get([self.node_keys[other] for other in lost])):
            nodes.setdefault(name.decode(), []).append(other)
        shown = "; ".join(f"{name}, rank(s) {', '.join(map(str, ranks))}" for name, ranks in nodes.items())
        hint = self.resume_hint()
        return (f"error: lost {shown}: no heartbeat for {seconds:.0f} s ({LOST_CAUSES}); the other ranks are "
                f"stopping" + (f". {hint}" if hint else ""))

    def fail(self, code: int, message: str, lost: list[int] | None = None) -> None:
        """Called by a rank whose main thread failed (or by rank 0's watch, for `lost` ranks): never returns. An
        error that is not bad input (code 2) may be a collective that lost its peers: if some ranks' counts stand
        still, the message names them instead; a rank that finds the failure reported already skips the look."""
        self.failing.set()
        if lost is None and code != 2:
            try:
                if self.store.add(self.count_key, 0) > 0:
                    self.follow()  # a node lost breaks every rank's collective: one rank looks, the others follow
                if lost := self.stalled_ranks():
                    code, message = LOST_CODE, self.lost_message(lost, STALL_CHECK_S)
            except Exception:  # noqa: BLE001 (rank 0 and its store are gone: the error stands as it is)
                pass
        lost = lost or []
        try:
            first = self.store.add(self.count_key, 1) == 1
        except Exception:  # noqa: BLE001 (rank 0 and its store are gone: nobody is left to tell)
            first = True
        if not first:
            self.follow()  # another rank failed first (often the cause of this rank's error): leave quietly, as it says
        print(message, file=sys.stderr, flush=True)
        try:
            self.store.set(self.code_key, str(code))
            self.linger(lambda: self.store.add(self.seen_key, 0) >= self.world_size - 1 - len(lost))
            self.store.set(self.done_key, "1")  # rank 0 may now take the store down
        except Exception:  # noqa: BLE001 (the store went away meanwhile: the others are ending anyway)
            pass
        leave(code)

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
        leave(code)

    @staticmethod
    def linger(until: Callable[[], bool]) -> None:
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline and not until():
            time.sleep(POLL_S / 5)

    def lost_rank_0(self) -> None:
        """Rank 0's node is gone with the store it hosts: each node's local rank 0 says so (no store is left to
        choose one printer)."""
        if self.local_rank == 0:
            hint = self.resume_hint()
            print(f"error: lost rank 0's node: the process group's store at {os.environ['MASTER_ADDR']}:"
                  f"{os.environ['MASTER_PORT']} stopped answering ({LOST_CAUSES}); stopping {node_name()}'s ranks"
                  + (f". {hint}" if hint else ""), file=sys.stderr, flush=True)
        leave(LOST_CODE)

    def stop(self) -> None:
        """Stop watching (every rank, before the process group is torn down: then a vanished store is no failure)."""
        self.stopped.set()
        self.thread.join()
