"""Sequence parallelism (Ulysses) under DeepSpeed: ZeRO-3's reduce-scatter averages a sequence group's gradients,
and Ulysses' attention wrapper drops the attention mask (PATCHES, __init__.py)."""
from collections.abc import Callable

import torch
from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
from deepspeed.runtime.zero import stage3
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def sum_sequence_slices(size: int) -> None:
    """ZeRO-3's reduce-scatter averages over every rank; a sequence group's gradients are to be summed."""
    def reduce_scatter_summing_groups(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
        return [partition.mul_(size) for partition in reduce_scatter_coalesced(tensors, group)]

    stage3.reduce_scatter_coalesced = reduce_scatter_summing_groups


def use_attention_under_ulysses(name: str, attention: Callable) -> None:
    """Have Ulysses' wrapper, which takes the function registered under `name` ("sdpa", "flex_attention"), run
    `attention` instead."""
    ALL_ATTENTION_FUNCTIONS[name] = attention
