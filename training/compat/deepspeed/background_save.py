"""Checkpoints written while training goes on: DeepSpeed's own files, through a checkpoint engine set in place of its
TorchCheckpointEngine (PATCHES, __init__.py).

engine.save_checkpoint hands each file's state dict to `engine.checkpoint_engine.save(state_dict, path)` and calls
its `commit(info)` at the end (DeepSpeed 0.19.8, runtime/engine.py). BackgroundWriter's save() copies the state dict
to host memory, the only part the step waits for; start() hands the copies, and the caller's other writes of the
save (`defer`), to a thread that writes them with torch.save, as TorchCheckpointEngine does, and syncs them.
DeepSpeed's own asynchronous engine (`checkpoint.writer.decoupled`) instead hands the live tensors to a process of
its own and waits for it before the next optimizer step changes them, so a save overlaps one forward and backward at
most (docs/checkpoints.md).
"""
import copy
import os
import threading
from collections.abc import Callable, Iterator
from functools import partial

import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


def tensors_in(item: object) -> Iterator[torch.Tensor]:
    if torch.is_tensor(item):
        yield item
    elif isinstance(item, dict):
        for value in item.values():
            yield from tensors_in(value)
    elif isinstance(item, (list, tuple)):
        for value in item:
            yield from tensors_in(value)


def host_copy(state: object) -> object:
    """`state` with every tensor copied to host memory, each once (a tensor held twice, as tied weights are, stays
    one), and its containers and other values deep-copied."""
    copies = {}
    for tensor in tensors_in(state):
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.detach().to("cpu", copy=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return copy.deepcopy(state, memo=copies)


class BackgroundWriter(TorchCheckpointEngine):
    """One save at a time: `wait()` before the next (and before anything reads the files)."""

    def __init__(self, zipfile_serialization: bool):
        super().__init__(None)
        self.zipfile_serialization = zipfile_serialization
        self.jobs: list[Callable[[], object]] = []  # the writes of the save being handed over
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.lock, self.done = threading.Lock(), True  # done: the files handed over last are on disk
        self.on_written: Callable[[], object] | None = None

    def preserves_storage_sharing(self) -> bool:
        return False  # save() copies every tensor apart: DeepSpeed need not clone them first

    def save(self, state_dict: object, path: str) -> None:
        self.defer(partial(torch.save, host_copy(state_dict), path,
                           _use_new_zipfile_serialization=self.zipfile_serialization))

    def defer(self, job: Callable[[], object]) -> None:
        """A write of the save for the thread (its data must not change meanwhile: a copy, or an object that
        training leaves alone)."""
        self.jobs.append(job)

    def commit(self, info) -> bool:
        return True  # the end of DeepSpeed's part of the save: start() writes it

    def start(self) -> None:
        """Write the save's files handed over since the last start, in a thread."""
        jobs, self.jobs = self.jobs, []
        self.done, self.on_written = False, None
        self.thread = threading.Thread(target=self.write, args=(jobs,), name="checkpoint-writer", daemon=True)
        self.thread.start()

    def write(self, jobs: list[Callable[[], object]]) -> None:
        try:
            for job in jobs:
                job()
            os.sync()
            with self.lock:
                self.done, callback = True, self.on_written
            if callback:
                callback()
        except BaseException as error:  # noqa: BLE001 (wait() raises it on the training thread)
            self.error = error

    def when_written(self, callback: Callable[[], object]) -> None:
        """`callback()` once the files handed over last are on disk: now, if they are, else on the writing thread
        (never, if the writing fails: wait() raises that)."""
        with self.lock:
            if not self.done:
                self.on_written = callback
                return
        callback()

    def wait(self) -> None:
        """Until the save being written is on disk; raises what stopped its writing."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def write_in_background(engine: DeepSpeedEngine) -> BackgroundWriter:
    """Set a BackgroundWriter as the engine's checkpoint engine (its file format setting kept) and return it."""
    writer = BackgroundWriter(engine.checkpoint_engine.zipfile_serialization)
    engine.checkpoint_engine = writer
    return writer
