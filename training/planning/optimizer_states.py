"""The optimizer states a rank keeps, counted before a run as the optimizers keep them (the model-state census of
tests/test_optimizers.py measures them).

Each optimizer's record (training/config/optimizers.py) names the rule its states are counted by. AdamW, Lion and
Muon keep fixed bytes per parameter, which ZeRO 1-3 shard evenly. The memory-lean optimizers' (shaped) bytes depend
on the shape they see (training/loop/shaped_optimizer.py), so they are counted tensor by tensor on each rank's shares,
as DeepSpeed cuts the weights (training/compat/deepspeed/zero.py zero_cuts), part by part (share_parts). Per share:
  "quantized", AdamW8bit (torchao): 8-bit codes for both moments with an fp32 scale per 256-value block and a
     256-entry fp32 code table each, for a share of at least 4096 values that is a whole number of blocks; fp32
     moments (8 bytes per value) otherwise, and on the embeddings (the matrices of weight_decay_groups' no-decay
     group);
  "factored", Adafactor (torch): an fp32 row and column factor of a matrix's second moment, a whole fp32 second
     moment of a vector.
"""
import math

from training.compat.deepspeed.zero import zero_cuts
from training.config.optimizers import OPTIMIZERS
from training.planning.shape import ModelShape

QUANTIZED_BLOCK, QUANTIZED_MIN = 256, 4096  # torchao's block size and smallest quantized tensor (bitsandbytes')


def share_parts(shape: tuple[int, ...], start: int, numel: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """How a share of `numel` values from `start` in the flattened weight of `shape` is stepped, as (where the part
    starts in the share, its length, its shape): whole, in the weight's shape; else its whole rows as rows, and the
    pieces of a row before and after them flat."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 0
    if numel == math.prod(shape) or not row:
        return [(0, numel, tuple(shape) if numel == math.prod(shape) else (numel,))]
    head = min(numel, -start % row)
    rows = (numel - head) // row
    tail = numel - head - rows * row
    parts = [(0, head, (head,)), (head, rows * row, (rows, *shape[1:])), (head + rows * row, tail, (tail,))]
    return [part for part in parts if part[1]]


def share_state_bytes(name: str, shape: tuple[int, ...], embedding: bool = False) -> int:
    """The bytes of `name`'s states for one tensor (share) of `shape`, a share of an embedding or not."""
    numel = math.prod(shape)
    if OPTIMIZERS[name].state_rule == "quantized":
        if numel >= QUANTIZED_MIN and numel % QUANTIZED_BLOCK == 0 and not embedding:
            return 2 * (numel + 4 * numel // QUANTIZED_BLOCK + 4 * 256)
        return 8 * numel
    if len(shape) > 1:
        return 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1])
    return 4 * numel


def rank_shares(groups: tuple[tuple[tuple[int, ...], ...], ...], stage: int, ranks: int,
                rank: int) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """What the shaped optimizer steps on `rank`, part by part, as (the weight's index over the groups, where the
    part starts in the flattened weight, its length, the shape it is stepped in)."""
    weights = [shape for group in groups for shape in group]
    cuts = zero_cuts([[math.prod(shape) for shape in group] for group in groups], stage, ranks, rank)
    return [(index, start + offset, length, part) for index, start, numel in cuts
            for offset, length, part in share_parts(weights[index], start, numel)]


def rank_state_bytes(name: str, shape: ModelShape, stage: int, ranks: int) -> list[int]:
    """Each rank's bytes of the shaped optimizer `name`'s states."""
    weights = [(group, len(shape_) > 1) for group, shapes in enumerate(shape.trained_shapes) for shape_ in shapes]
    embeddings = {i for i, (group, matrix) in enumerate(weights) if group == 1 and matrix}  # no decay, 2-D
    return [sum(share_state_bytes(name, share, index in embeddings)
                for index, *_, share in rank_shares(shape.trained_shapes, stage, ranks, rank)) for rank in range(ranks)]


def optimizer_state_bytes(name: str, shape: ModelShape, stage: int = 0, ranks: int = 1) -> float:
    """Optimizer-state bytes per trained parameter, such that the ZeRO arithmetic (these bytes x the trained
    parameters, over the ranks under ZeRO 1-3) gives the busiest rank's: AdamW's two fp32 moments (8), Lion's one
    momentum (4), Muon's momentum on the decoder layers' matrices (4) and AdamW's moments on the rest (8); the
    shaped optimizers' counted share by share (module docstring)."""
    record = OPTIMIZERS[name]
    if record.shaped:
        trained = sum(math.prod(s) for group in shape.trained_shapes for s in group)
        shards = ranks if stage else 1
        return max(rank_state_bytes(name, shape, stage, shards)) * shards / trained
    if record.state_rule == "layer_matrices":  # AdamW's 8 on the rest
        matrices = shape.layer_matrix_parameters
        return (record.state_bytes * matrices + 8 * (shape.parameters - matrices)) / shape.parameters
    return record.state_bytes
