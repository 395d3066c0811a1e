"""Process-group set-up and the few collectives train.py needs (torch.distributed under DeepSpeed)."""
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size() -> int:
    """Known from the launcher's environment before the process group exists (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """Join the launcher's process group; `python train.py` without a launcher runs as rank 0 of 1."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False)
    if get_accelerator().device_name() == "cuda":
        torch.cuda.set_device(local_rank())
    else:
        release_shared_memory_buffer()


def release_shared_memory_buffer() -> None:
    """Work around a leak in DeepSpeed's CPU all-reduce: each rank creates a 66 MB shared-memory file,
    /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>, and never unlinks it, so every run
    of N ranks keeps N x 66 MB of RAM until reboot. By the end of init every rank has mapped every
    rank's buffer; after a barrier each rank unlinks its own name. The memory stays mapped for the
    run and is freed when its processes exit, however they exit."""
    dist.barrier()
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_{rank()}"
    Path("/dev/shm", name).unlink(missing_ok=True)


@contextmanager
def local_main_first() -> Iterator[None]:
    """Local rank 0 runs the block first (e.g. prepares and caches the data); the other ranks wait, then run it."""
    if local_rank() != 0:
        dist.barrier()
    yield
    if local_rank() == 0:
        dist.barrier()


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(tensor, op=op)
    return tensor


@cache
def host_group() -> dist.ProcessGroup | None:
    """A gloo group for small host-side values (token counts, a stop flag). Reducing them over nccl would
    put them on the GPU, and reading them back would make the host wait for the GPU every step."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def all_reduce_on_host(values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=op, group=host_group())
    return tensor.tolist()
