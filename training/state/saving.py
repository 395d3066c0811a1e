"""A run's checkpoint saves, synchronous or written in the background (checkpointing.asynchronous).

Asynchronous: the step waits while each rank copies its states to host memory (DeepSpeed's files go through
training/compat/deepspeed/background_save.py); a thread writes and syncs them while training goes on, then counts
the rank's files written in the launch's key-value store. A thread of rank 0's completes the save (the run state,
`latest`, `keep_last`) once every rank has counted, so `latest` moves only to a save whose every file is on disk: a
kill meanwhile leaves the previous checkpoint `latest` and whole. A save waits for the one before it, and
the end of the run, a rewind and a stop wait for the one being written (`finish`).
"""
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from deepspeed import DeepSpeedEngine

from training.compat.deepspeed.background_save import write_in_background
from training.parallel import failure
from training.parallel.failure import attempt_key, launch_store
from training.state.checkpoint import complete, save_checkpoint, write_files
from training.state.run_state import RunState

STORE_TIMEOUT = timedelta(seconds=60)
POLL_S = 0.1  # how often rank 0 looks whether every rank has written its files


def counted(store, key: str) -> None:
    """This rank's files of the save are on disk (the ones written before the background's too): count them."""
    os.sync()
    store.add(key, 1)


@dataclass
class Pending:
    """The save being written: what completes it, and when it started and how long the step waited for it."""
    run_state: RunState
    keep_last: int | None
    key: str
    started: float
    stall_seconds: float


class Saving:
    def __init__(self, engine: DeepSpeedEngine, checkpoint_dir: Path, asynchronous: bool):
        self.engine, self.checkpoint_dir = engine, checkpoint_dir
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.writer = write_in_background(engine) if asynchronous else None
        self.store = launch_store(STORE_TIMEOUT) if asynchronous else None
        self.pending: Pending | None = None
        self.started = 0  # saves started, the same count on every rank
        self.completer: threading.Thread | None = None  # rank 0's: completes the pending save once it is written
        self.completed: queue.SimpleQueue = queue.SimpleQueue()  # rank 0: the records of saves completed since

    def save(self, run_state: RunState, data_state: dict, hf_files: tuple, keep_last: int | None,
             write_more) -> list[dict]:
        """Every rank, after finish(). Synchronous: the save's record (`seconds`, `stall_seconds`, `bytes` on rank 0,
        `step`). Asynchronous: none; its record comes from a later poll() or finish()."""
        if self.writer is None:
            record = save_checkpoint(self.engine, self.checkpoint_dir, run_state, data_state, hf_files, keep_last,
                                     write_more)
            return [{**record, "stall_seconds": record["seconds"], "step": run_state.step}]
        assert self.pending is None, "finish() the save being written first"
        started = time.perf_counter()
        self.started += 1  # not the step: a rewind saves a step again
        key = attempt_key(f"checkpoint-written/{self.started}")
        write_files(self.engine, self.checkpoint_dir, run_state, data_state, hf_files, write_more,
                    self.writer.defer)
        self.writer.start()
        self.pending = Pending(run_state, keep_last, key, started, time.perf_counter() - started)
        self.writer.when_written(lambda: counted(self.store, key))  # this rank's every file of the save
        failure.exit_waits.append(self.drain)  # while it is written
        if self.rank == 0:
            self.completer = threading.Thread(target=self.complete_when_written, args=(self.pending,),
                                              name="checkpoint-completer", daemon=True)
            self.completer.start()
        return []

    def complete_when_written(self, pending: Pending) -> None:
        """Rank 0's thread: once every rank has counted its files written, the run state and `latest`."""
        self.all_counted(pending.key)
        size = complete(self.checkpoint_dir, pending.run_state, pending.keep_last)
        self.store.set(f"{pending.key}/complete", "1")  # a failing run's other ranks wait for this (drain)
        self.completed.put({"seconds": time.perf_counter() - pending.started, "bytes": size,
                               "stall_seconds": pending.stall_seconds, "step": pending.run_state.step})

    def all_counted(self, key: str, timeout: float = float("inf")) -> bool:
        """Whether every rank has counted its files of the save at `key`, waiting up to `timeout` for it."""
        deadline = time.monotonic() + timeout
        while self.store.add(key, 0) < self.world_size:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def drain(self, timeout: float) -> None:
        """A failing run, before its ranks end: this rank's files of the save being written are written to the end,
        however long that takes (a synchronous save would have taken as long, and every rank writes its share at
        the same time); then up to `timeout` for every rank to count its files (a lost node's ranks never do:
        `latest` then stays at the save before); once they all have, until rank 0 has completed the save, however
        long its writes take on a loaded disk. Every rank waits for that, not rank 0 alone: the launcher kills a
        run's other ranks as soon as one ends with an error, rank 0 among them."""
        if self.writer.thread is not None and self.writer.thread.is_alive():
            if self.rank == 0:
                print(f"the checkpoint of step {self.pending.run_state.step} is being written: the run ends once "
                      "it is", file=sys.stderr, flush=True)
            self.writer.thread.join()
        if not self.all_counted(self.pending.key, timeout):
            return
        if self.completer is not None:
            self.completer.join()
        else:
            self.store.wait([f"{self.pending.key}/complete"])  # raises once rank 0's store is gone (leave() goes on)

    def poll(self) -> list[dict]:
        """Every rank, after each step: a failed write raises here; rank 0 returns the saves completed since."""
        if self.writer is not None and self.writer.error is not None:
            self.writer.wait()  # raises it
        done = []
        while not self.completed.empty():
            done.append(self.completed.get())
        return done

    def finish(self) -> list[dict]:
        """Every rank, at the same point of the run: wait for the save being written to be complete (rank 0 returns
        the records of the saves completed since the last poll)."""
        if self.pending is None:
            return self.poll()
        self.writer.wait()
        dist.barrier()  # every rank has counted its files
        if self.completer is not None:
            self.completer.join()
            self.completer = None
        dist.barrier()  # `latest` names the save on every rank's view of the folder
        self.pending = None
        failure.exit_waits.remove(self.drain)
        return self.poll()
