"""Process-group set-up and the few collectives train.py needs (torch.distributed under DeepSpeed)."""
import errno
import itertools
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import cache
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from training.base.errors import ConfigError, failure, report
from training.compat.deepspeed.initialize import release_shared_memory_buffer
from training.parallel.failure import FailureWatch, attempt_key, launch_store, node_name
from training.parallel.launch import free_port

started_by_srun = threading.Event()  # set once adopt_srun_environment has taken the ranks from SLURM


def adopt_srun_environment() -> None:
    """Ranks started by `srun` (one task per GPU, so that SLURM's signals reach each rank directly, with no
    launcher between them to cut the grace period short) learn their place from SLURM_PROCID, SLURM_LOCALID
    and SLURM_STEP_NUM_TASKS; torch.distributed reads RANK, LOCAL_RANK and WORLD_SIZE. The job script sets
    MASTER_ADDR and MASTER_PORT (docs/launching.md)."""
    if "RANK" in os.environ or int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) < 2:
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ConfigError(f"started by srun without {' and '.join(missing)}: add to the job script, before srun, "
                          f"export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) "
                          f"MASTER_PORT=29500")
    os.environ.update(RANK=os.environ["SLURM_PROCID"], LOCAL_RANK=os.environ["SLURM_LOCALID"],
                      WORLD_SIZE=os.environ["SLURM_STEP_NUM_TASKS"])
    started_by_srun.set()


def check_master_port() -> None:
    """Rank 0 hosts the launch's key-value store on MASTER_PORT (under the deepspeed launcher and srun; torchrun's
    agent hosts its own, TORCHELASTIC_USE_AGENT_STORE). A port another process listens on, as another run on this
    node started with the launcher's default 29500 does, would end the start in a DistNetworkError traceback
    (EADDRINUSE) while the other ranks wait on a store that is not theirs."""
    if rank() != 0 or "MASTER_PORT" not in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    port = int(os.environ["MASTER_PORT"])
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's: a closed run's port is free
        try:
            probe.bind(("", port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                return
            raise ConfigError(f"MASTER_PORT {port} is in use on {socket.gethostname()}, by another run on this node "
                              f"most likely (the deepspeed launcher's default port is 29500): start this one on "
                              f"another port, e.g. deepspeed --master_port {free_port()} train.py ...") from None


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size() -> int:
    """Known from the launcher's environment before the process group exists (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed() -> None:
    """Join the launcher's process group; `python train.py` without a launcher runs as rank 0 of 1."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False)
    if get_accelerator().device_name() == "cuda":
        torch.cuda.set_device(local_rank())
    else:
        dist.barrier()  # by now every rank has mapped every rank's buffer
        release_shared_memory_buffer(rank())  # DeepSpeed's CPU all-reduce leaks it (compat/deepspeed/initialize.py)


REPORT_WAIT_S = 60.0  # how long a rank that does not print a user error waits for its local rank 0 to end it


def report_once(error: BaseException) -> int:
    """Exit code 2 for a user error found before the process group exists, its message printed exactly once per node
    (every rank checks the same inputs): by local rank 0. Under a launcher (deepspeed's, torchrun) the node's other
    ranks print nothing and wait: the launcher ends them once local rank 0 has printed and exited, whereas a rank that
    left first would get local rank 0 killed before it printed. A rank still alive after REPORT_WAIT_S, whose local
    rank 0 found nothing wrong (inputs that differ between ranks), prints its own message. Ranks that srun started
    leave at once: srun ends no task for another's exit (unless told to, --kill-on-bad-exit). A bug is raised again."""
    printing = local_rank() == 0
    code = report(error, printing)
    if not printing and not started_by_srun.is_set():
        time.sleep(REPORT_WAIT_S)
        report(error)
    return code


def run_in_process_group(body: Callable[[], int], resume_hint: Callable[[], str] = lambda: "") -> int:
    """Run `body` in the launcher's process group and return its exit code. An exception on any rank ends
    every rank within seconds with one exit code (2 for a user error, 1 for a bug, 4 for a lost node) and its
    message printed once (training/parallel/failure.py); `resume_hint` says where the run continues from after a
    lost node. The group is torn down either way."""
    init_distributed()
    watch = FailureWatch(rank(), local_rank(), world_size(), resume_hint) if world_size() > 1 else None
    try:
        code = body()
    except BaseException as error:  # noqa: BLE001 (every failure must end every rank)
        code, message = failure(error)
        if watch:
            watch.fail(code, message)  # does not return
        print(message, file=sys.stderr, flush=True)
    if watch:
        watch.stop()
        dist.barrier()  # every rank has stopped watching before rank 0's store can go away
    # a process group left for interpreter exit to tear down can abort the process ("terminate called ...");
    # DeepSpeed's own teardown also forgets the groups it cached
    deepspeed.comm.destroy_process_group()
    return code


@contextmanager
def local_main_first() -> Iterator[None]:
    """Local rank 0 runs the block first (e.g. prepares and caches the data); the other ranks wait, then run it,
    however long the preparation takes (patient_barrier). If it fails on local rank 0, the waiting ranks are ended
    by run_in_process_group's failure watch (a barrier in a `finally` would release them to run the block
    themselves)."""
    if local_rank() != 0:
        patient_barrier()
    yield
    if local_rank() == 0:
        patient_barrier()


PATIENT_POLL_S = (0.01, 1.0)  # the first and the longest pause between two looks at the count
patient_barriers = itertools.count()  # every rank passes the same barriers in the same order


def patient_barrier() -> None:
    """A barrier of every rank without a time limit, for ranks that wait while one rank works for as long as its work
    takes: a data preparation, a universal conversion, an export. A collective barrier fails once the process group's
    timeout passes (DeepSpeed's: 30 minutes), with a transport error on the ranks that waited ("Timed out waiting
    10000ms for recv operation") and "Connection closed by peer" on the one that worked. Here each rank counts itself
    in the store and looks at the count until every rank is in; a rank that fails meanwhile ends every rank through
    the failure watch (training/parallel/failure.py)."""
    if world_size() == 1:
        return
    key, store = f"{attempt_key('patient-barrier')}/{next(patient_barriers)}", launch_store(timedelta(minutes=5))
    pause = PATIENT_POLL_S[0]
    store.add(key, 1)
    while store.add(key, 0) < world_size():
        time.sleep(pause)
        pause = min(2 * pause, PATIENT_POLL_S[1])


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(tensor, op=op)
    return tensor


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's tensor (of the same shape) in `group` (default: all), concatenated along the first dimension in
    rank order."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


def all_gather_ragged(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-d tensor, of whatever length, concatenated in rank order."""
    lengths = all_gather(torch.tensor([len(tensor)], device=tensor.device)).tolist()
    longest = max(lengths)
    if longest == 0:
        return tensor
    parts = all_gather(torch.cat([tensor, tensor.new_zeros(longest - len(tensor))])).view(len(lengths), longest)
    return torch.cat([part[:length] for part, length in zip(parts, lengths)])


@cache
def host_group() -> dist.ProcessGroup | None:
    """A gloo group for small host-side values (token counts, a stop flag). Reducing them over nccl would
    put them on the GPU, and reading them back would make the host wait for the GPU every step."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def all_reduce_on_host(values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=op, group=host_group())
    return tensor.tolist()


def check_shared_folder(folder: Path) -> None:
    """Every rank writes checkpoints under the output folder and reads them back on resume, so on several nodes
    it must be on a file system they all see. Rank 0 writes a marker under a fresh name; the first rank of every
    node must find it, else every rank stops, naming the nodes that cannot see it (within seconds, not at the
    first resume)."""
    name = [f".shared-check-{uuid.uuid4().hex}" if rank() == 0 else None]
    dist.broadcast_object_list(name, src=0, group=host_group())
    marker = folder / name[0]
    if rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        marker.write_text(node_name())
    dist.barrier(group=host_group())
    blind = [None] * dist.get_world_size()
    dist.all_gather_object(blind, None if local_rank() != 0 or marker_seen(marker) else node_name(),
                           group=host_group())
    if rank() == 0:
        marker.unlink()
    blind = sorted({host for host in blind if host})
    if blind:
        raise ConfigError(f"--output-dir {folder} is not on a file system every node sees: {', '.join(blind)} cannot "
                          f"read the file rank 0 wrote there. Every rank writes its share of each checkpoint there "
                          f"and reads it back on resume: put --output-dir on a shared file system (NFS, Lustre, ...)")


def marker_seen(marker: Path, wait_s: float = 5.0) -> bool:
    """Whether this node sees the marker, allowing a network file system a few seconds to show a new file."""
    deadline = time.monotonic() + wait_s
    while not marker.is_file():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
