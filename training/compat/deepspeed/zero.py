"""How ZeRO holds the weights: each rank's fp32 share, how the weights are cut between ranks, a weight's whole shape,
and the whole weights gathered under ZeRO-3 (PATCHES, __init__.py)."""
import math
from collections.abc import Iterator
from contextlib import contextmanager

import deepspeed
import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from deepspeed.utils import safe_get_local_fp32_param


def local_fp32_shares(engine: DeepSpeedEngine,
                      parameters: list[torch.nn.Parameter]) -> list[tuple[int, int, torch.Tensor]]:
    """This rank's share of each parameter in the fp32 the optimizer updates, as (where the share starts in the
    flattened weight, the weight's size, the share): ZeRO-3's partitions, ZeRO-1/2's fragments of the fp32 master
    copy (also under the bf16 optimizer), or the whole weights without ZeRO (fp32 there: bf16/fp16 are autocast)."""
    if engine.zero_optimization_partition_weights():
        return [(dist.get_rank(group=p.ds_process_group) * p.ds_tensor.ds_numel, p.ds_numel,
                 safe_get_local_fp32_param(p)) for p in parameters]
    if engine.zero_optimization() or engine.bfloat16_enabled():
        return [(p._hp_mapping.lp_fragment_address.start, p.numel(), p._hp_mapping.get_hp_fragment())
                for p in parameters if p._hp_mapping is not None]
    return [(0, p.numel(), p) for p in parameters]


def zero_cuts(groups: list[list[int]], stage: int, ranks: int, rank: int) -> list[tuple[int, int, int]]:
    """How DeepSpeed cuts the trained weights (their sizes, per parameter group in order) between `ranks`: the parts
    `rank` holds, as (the weight's index over the groups, where the part starts in the flattened weight, its
    length). ZeRO-1/2 and the bf16 optimizer flatten each group, pad it to a multiple of 2 x ranks
    (nccl_start_alignment_factor) and give each rank an equal range; ZeRO-3 cuts every weight into ceil(size /
    ranks) pieces (the last rank's padded); ZeRO-0 keeps them whole."""
    if stage == 0 or ranks == 1:
        return [(index, 0, size) for index, size in enumerate(size for group in groups for size in group)]
    cuts, index = [], 0
    for group in groups:
        padded = math.ceil(sum(group) / (2 * ranks)) * 2 * ranks
        first, last, offset = rank * padded // ranks, (rank + 1) * padded // ranks, 0
        for size in group:
            if stage == 3:
                piece = math.ceil(size / ranks)
                begin, end = min(size, rank * piece), min(size, (rank + 1) * piece)
            else:
                begin, end = max(first, offset) - offset, min(last, offset + size) - offset
            if begin < end:
                cuts.append((index, begin, end - begin))
            offset += size
            index += 1
    return cuts


def weight_shape(parameter: torch.nn.Parameter) -> tuple[int, ...]:
    """A weight's whole shape, also under ZeRO-3 (where the parameter itself is empty; its ds_shape)."""
    return tuple(getattr(parameter, "ds_shape", parameter.shape))

@contextmanager
def zero3_whole_weights(engine: DeepSpeedEngine) -> Iterator[None]:
    """Under ZeRO-3, every weight whole on every rank for the duration (a full copy per rank, gathered once), the
    per-module fetch and release hooks off; both back as they were after."""
    offload = engine.optimizer.parameter_offload
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for parameter in engine.module.parameters():
            parameter.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            coordinator = offload.get_param_coordinator()
            if not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()
            offload._register_deepspeed_module(offload.module)


def gathered_16bit_state_dict(engine: DeepSpeedEngine, exclude_frozen_parameters: bool = False) -> dict:
    """The whole 16-bit weights on rank 0 under ZeRO-3 or AutoTP (every rank calls it)."""
    return engine._consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
