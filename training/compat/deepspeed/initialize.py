"""What deepspeed.initialize and its CPU communication set up: the batch size it checks before AutoTP makes its
groups, the parameters its Muon takes, and the shared memory the CPU all-reduce leaves behind (PATCHES,
__init__.py)."""
import os
from pathlib import Path

import torch
from deepspeed import set_optimizer_flags


def release_shared_memory_buffer(rank: int) -> None:
    """Unlink this rank's shared-memory all-reduce buffer (66 MB, left in /dev/shm until reboot otherwise). Every
    rank calls it once every rank has mapped every buffer (after init and a barrier); the memory stays mapped for
    the run and is freed when its processes exit, however they exit."""
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_{rank}"
    Path("/dev/shm", name).unlink(missing_ok=True)


def without_train_batch_size(ds_config: dict) -> dict:
    """The config without train_batch_size, which DeepSpeed then derives from the micro-batch and accumulation."""
    return {key: value for key, value in ds_config.items() if key != "train_batch_size"}


def muon_flags(model: torch.nn.Module) -> dict[str, bool]:
    """Which parameters DeepSpeed's Muon takes (by its name rule), by parameter name."""
    set_optimizer_flags(_MuonConfig(), model)
    return {name: p.use_muon for name, p in model.named_parameters()}


class _MuonConfig:
    """What set_optimizer_flags reads of DeepSpeed's config."""
    optimizer_name, optimizer_params = "muon", {}
