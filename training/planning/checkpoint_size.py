"""What a run writes to disk, estimated before it starts: one checkpoint save (DeepSpeed's files, and a synced
reference) and the finished run's export, and the time a SIGTERM save has under DeepSpeed's launcher."""
from dataclasses import dataclass

from training.config.precision import Precision
from training.planning.memory import state_bytes
from training.planning.objective_memory import objective_memory
from training.planning.plan import RunPlan
from training.planning.precision import DTYPES, is_mixed

LAUNCHER_GRACE_S = 30  # DeepSpeed's launcher, on SIGTERM: passes it to the ranks, SIGKILLs them 30 s later



@dataclass(frozen=True)
class CheckpointSize:
    total: float  # bytes of one save, all ranks
    largest_rank: float  # bytes the busiest rank writes (rank 0, where it writes the weights)



def checkpoint_bytes(params: float, stage: int, ranks: int, precision: Precision,
                     state_bytes: float = 8.0) -> CheckpointSize:
    """DeepSpeed's files for one save, as measured on its checkpoints with AdamW (tests/test_train_distributed.py;
    `state_bytes` of optimizer states per parameter, AdamW's 8). ZeRO-0: rank 0 writes the fp32 weights
    (train.py's ZeRO-0 keeps fp32 weights, also under autocast) and the states, 12 bytes per parameter with
    AdamW. ZeRO-1/2: rank 0 writes the weights in the run's dtype, and every rank its 1/N of the fp32 master
    weights and states (12/N). ZeRO-3: only those shards (the master copy is the weights). The model config and
    tokenizer, and each rank's data and RNG state, add a few MB."""
    shards = (4 + state_bytes) * params
    if stage == 0:
        return CheckpointSize(shards, shards)
    weights = 0 if stage == 3 else params * (2 if is_mixed(precision) else 4)
    return CheckpointSize(weights + shards, weights + shards / ranks)



def async_host_bytes(size: CheckpointSize, ranks: int, gpus_per_node: int) -> float:
    """The host memory an asynchronous save's copies hold on the busiest node (the first: it holds the busiest rank)
    while they are written: the busiest rank's share and its node's other ranks' (the rest, shared evenly)."""
    others = (size.total - size.largest_rank) / (ranks - 1) if ranks > 1 else 0.0
    return size.largest_rank + others * (min(gpus_per_node, ranks) - 1)


def planned_checkpoint(plan: RunPlan) -> CheckpointSize:
    """What one save of this run writes (a LoRA run's checkpoints leave the frozen base weights out), with what the
    objective saves beside it (e.g. a synced reference: reference.safetensors, whole, written by rank 0; its memory
    term's saved_reference, objective_memory)."""
    shape, recipe = plan.shape, plan.recipe
    size = checkpoint_bytes(shape.lora_parameters or shape.parameters, plan.zero_stage,
                            plan.dims.world_size // plan.dims.pipeline_stages, plan.precision, state_bytes(plan))
    reference = objective_memory(recipe, plan.precision, shape, plan.zero_stage, 1).saved_reference  # whole: ranks=1
    if not reference:
        return size
    return CheckpointSize(size.total + reference, size.largest_rank + reference)



def planned_export(plan: RunPlan) -> float:
    """What the finished run's export writes: hf/ in the run's dtype, a LoRA run's adapters (and hf/ when merged)."""
    shape, dtype_bytes = plan.shape, DTYPES[plan.precision].itemsize
    adapters = shape.lora_parameters or 0
    whole = shape.parameters if not plan.recipe.lora.enabled or plan.recipe.export.merge else 0
    return (whole + adapters) * dtype_bytes
