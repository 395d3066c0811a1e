"""Ulysses sequence parallelism for Hugging Face models (DeepSpeed's ALST, `parallelism.sequence_parallel: N`).

Each group of N consecutive ranks trains on the same rows, every rank on its 1/N slice of the sequence. In each
attention layer DeepSpeed's `UlyssesSPAttentionHF` trades the slices for heads with one all-to-all (each rank
then holds the whole sequence for heads/N), runs the model's own attention, and trades back. Everything else in
the model works on the slice. DeepSpeed reduces the gradients over all ranks and divides by the data-parallel
ranks only, so the group's slices add up to the row's gradient, as one rank would compute it.

Packed rows: DeepSpeed's wrapper gathers the full `position_ids` and drops the attention mask, which transformers
built for the slice (a FlexAttention BlockMask it replaces with a plain causal one). flash_attention_2 finds the
documents from those position_ids by itself; sdpa and flex_attention would attend across them, so under those the
attention here builds the document mask from the gathered position_ids with transformers' own
`find_packed_sequence_indices`: the same mask as without sequence parallelism (for sdpa a [seq, seq] mask per row
when the row holds more than one document, for flex_attention a BlockMask, training/models/attention.py).

ZeRO-3 (DeepSpeed 0.19.8): its all-reduce path divides the summed gradients by the data-parallel ranks, but its
reduce-scatter path (the default, `reduce_scatter: true`) by all ranks, so under sequence parallelism the
gradients come out N times too small. AdamW's update barely notices a constant factor, so the losses agree,
but the gradient norm, clipping, and any scale-sensitive optimizer do not: `sum_sequence_slices` puts the
factor back.
"""
import torch
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from transformers import PretrainedConfig, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import find_packed_sequence_indices

from training.base.errors import ConfigError
from training.compat.deepspeed.sequence_parallel import sum_sequence_slices, use_attention_under_ulysses
from training.compat.transformers import attention_implementation
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.models.attention import document_flex
from training.planning.shape import head_counts, rank_groups_problem

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2", "flex_attention")


def check_sequence_parallel(recipe: Recipe, config: PretrainedConfig, world_size: int, zero_stage: int,
                            precision: Precision) -> None:
    """Whether the model, the rows and the ranks split N ways, in a layout DeepSpeed runs: before anything is
    built."""
    size, seq_len, problems = recipe.parallelism.sequence_parallel, recipe.data.seq_len, []
    attn_implementation = recipe.model.attn_implementation
    heads, kv_heads = head_counts(config)
    if heads % size:
        problems.append(f"the model's {heads} attention heads do not divide into {size} groups: choose a "
                        f"parallelism.sequence_parallel that divides {heads}")
    if kv_heads % size and size % kv_heads:
        problems.append(f"the model's {kv_heads} key/value heads neither divide into {size} groups nor into "
                        f"{size} copies: choose a parallelism.sequence_parallel that divides {kv_heads} or is a "
                        f"multiple of it")
    if seq_len % size:
        problems.append(f"data.seq_len={seq_len} does not split into {size} equal slices: choose a data.seq_len "
                        f"divisible by {size}")
    problems += rank_groups_problem(world_size, size, "sequence")
    if attn_implementation not in SUPPORTED_ATTENTION:
        problems.append(f"model.attn_implementation={attn_implementation}: Ulysses runs sdpa, flash_attention_2 or "
                        f"flex_attention "
                        f"(eager builds a [seq, seq] mask per head); set model.attn_implementation=sdpa")
    if precision in (Precision.BF16, Precision.FP8) and zero_stage == 1:
        problems.append(f"precision={precision} with ZeRO-1: DeepSpeed's BF16_Optimizer takes the sequence-parallel "
                        f"group for a tensor-parallel one and fails computing the gradient norm; use "
                        f"deepspeed.config=zero2 (ZeRO-1's memory and more) or zero3")
    if problems:
        raise ConfigError(f"parallelism.sequence_parallel={size}:\n" + "\n".join(f"  {p}" for p in problems))


def document_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention on the whole sequence, each document of a packed row attending only to its
    own earlier tokens (the mask from the full position_ids); plain causal when every row is one document."""
    documents = find_packed_sequence_indices(kwargs["position_ids"])
    if documents is not None:
        causal = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
        attention_mask = (documents[:, :, None] == documents[:, None, :]) & causal
        attention_mask = attention_mask[:, None]  # [batch, 1, seq, seq]: every head the same
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def enable_sequence_parallel(model: PreTrainedModel, size: int, micro_batch_size: int, seq_len: int):
    """Route the model's attention through DeepSpeed's Ulysses wrapper and return the `mpu` (DeepSpeed's
    sequence-parallel groups) for deepspeed.initialize (None for size 1: no groups, attention as it is). Under
    sdpa the wrapped attention is `document_sdpa`, under flex_attention `document_flex`."""
    if size == 1:
        return None
    sum_sequence_slices(size)
    implementation = attention_implementation(model.config)
    documents_apart = {"sdpa": document_sdpa, "flex_attention": document_flex}.get(implementation)
    if documents_apart:
        use_attention_under_ulysses(implementation, documents_apart)
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=implementation, sequence_parallel_size=size,
        micro_batch_size=micro_batch_size, seq_length=seq_len, seq_length_is_variable=False)
