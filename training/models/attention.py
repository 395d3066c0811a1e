"""Which attention kernel a run uses, and packed rows' document masks for each.

Packed rows hold several documents; each may attend only to its own earlier tokens. transformers builds that mask
from the rows' position_ids (which restart at 0 at every document): as a dense [seq, seq] boolean mask per row for
sdpa and eager, which costs sdpa its flash kernel (and its native GQA: transformers repeats K/V for a 4D mask), and
as a FlexAttention BlockMask for flex_attention, whose kernel skips the blocks no document reaches and keeps GQA
native. On a GPU FlexAttention with the document block mask runs at the speed of plain causal flash attention.

`auto` (the default) takes flex_attention on CUDA and sdpa elsewhere: torch 2.13 has no FlexAttention backward on a
CPU, and there sdpa with the dense mask is the fast path anyway. flex_attention has no attention dropout
(transformers refuses it in training), so a model with attention_dropout > 0 keeps sdpa under auto, as do heads of
fewer than 16 dimensions (the kernel's least) and an architecture transformers runs without flex_attention (GPT-2).
"""
import copy
from functools import cache

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.masking_utils import find_packed_sequence_indices

from training.base.errors import ConfigError
from training.config.recipe import Recipe
from training.planning.precision import device_type

MIN_FLEX_HEAD_DIM = 16  # torch's FlexAttention kernel refuses smaller heads


def resolve_attention(recipe: Recipe, config: PretrainedConfig, for_gpus: bool = False) -> Recipe:
    """The recipe with model.attn_implementation decided for this machine (for_gpus: a dry run planning for GPUs)."""
    chosen = attention_for(recipe.model.attn_implementation, config, for_gpus or device_type() == "cuda")
    return recipe.model_copy(update={"model": recipe.model.model_copy(update={"attn_implementation": chosen})})


def attention_for(requested: str, config: PretrainedConfig, on_gpu: bool) -> str:
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if requested == "auto":
        flex = on_gpu and not dropout and head_dim >= MIN_FLEX_HEAD_DIM and supports_flex(config)
        return "flex_attention" if flex else "sdpa"
    if requested == "flex_attention" and head_dim < MIN_FLEX_HEAD_DIM:
        raise ConfigError(f"model.attn_implementation=flex_attention: FlexAttention's GPU kernel needs heads of at "
                          f"least {MIN_FLEX_HEAD_DIM} dimensions, the model's have {head_dim}; use sdpa")
    if requested == "flex_attention" and dropout:
        raise ConfigError(f"model.attn_implementation=flex_attention: the model's attention_dropout is {dropout}, "
                          f"which FlexAttention does not apply in training; use sdpa, or set "
                          f"model.config_overrides.attention_dropout=0")
    if requested == "flex_attention" and not on_gpu:
        raise ConfigError("model.attn_implementation=flex_attention needs a CUDA GPU: torch has no FlexAttention "
                          "backward pass on a CPU; use sdpa (or auto, which picks sdpa here)")
    return requested


def supports_flex(config: PretrainedConfig) -> bool:
    """Whether transformers runs this architecture with flex_attention (GPT-2, for one, has no flex path): asked by
    building it on the meta device, which costs no memory."""
    try:
        with torch.device("meta"):  # a copy: from_config sets the attention on the config before it refuses
            AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="flex_attention")
    except ValueError:
        return False
    return True


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's document within its row, numbered from 0 ([batch, seq]), from position_ids that restart at 0
    at every document start (transformers' own reading of packed rows)."""
    found = find_packed_sequence_indices(position_ids)
    return torch.zeros_like(position_ids) if found is None else found


def document_block_mask(position_ids: torch.Tensor):
    """The causal document mask of packed rows as a FlexAttention BlockMask: token q sees token k when k <= q and
    both lie in the same document."""
    documents = document_ids(position_ids)

    def same_document_causal(batch, head, q, k):
        return (k <= q) & (documents[batch, q] == documents[batch, k])

    seq_len = position_ids.shape[1]
    return create_block_mask(same_document_causal, B=position_ids.shape[0], H=None, Q_LEN=seq_len, KV_LEN=seq_len,
                             device=position_ids.device)


def document_flex(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: object, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """FlexAttention over whole rows with each document of a packed row kept apart, its mask built from the rows'
    full position_ids (kwargs["position_ids"]); what Ulysses sequence parallelism runs after its all-to-all, where
    DeepSpeed's wrapper replaces the model's BlockMask with a plain causal one. K/V heads stay grouped (GQA)."""
    # a compiled region inlines flex_attention; on a CPU (forward passes only) its reference implementation runs
    flex = flex_attention if torch.compiler.is_compiling() or query.device.type == "cpu" else compiled_flex_attention()
    output = flex(query, key, value, block_mask=document_block_mask(kwargs["position_ids"]), scale=scaling,
                  enable_gqa=query.shape[1] != key.shape[1])
    return output.transpose(1, 2).contiguous(), None


@cache
def compiled_flex_attention():
    """FlexAttention's fused kernel: outside a compiled region flex_attention itself runs an unfused reference."""
    return torch.compile(flex_attention)
