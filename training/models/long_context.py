"""ALST's memory savers for long rows (the `long_context` recipe section), from DeepSpeed's ulysses_sp module and
PyTorch's saved-tensor hooks.

With sequence parallelism a rank's activations shrink with its slice of each row, except two that scale with the
slice times a wide dimension: the MLP's [tokens, intermediate] activations, and the LM head's [tokens, vocab]
logits (with their fp32 copy in the loss, the largest tensors of a long-context step). Both are computed here in
tiles of the sequence and recomputed tile by tile in the backward pass, so only one tile's worth exists at a
time; each tile's weight gradients are added up before ZeRO reduces them (DeepSpeed's `ds_grad_is_ready`).
With activation checkpointing the largest activations left are the layers' saved inputs, layers x tokens x hidden;
`offload_checkpoints` keeps them in host memory until the backward pass recomputes their layer.
"""
import math

import torch
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP, sequence_tiled_compute
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from training.compat.torch import replace_forward
from training.compat.transformers import set_checkpointing_function
from training.config.sections import LongContextSection
from training.planning.precision import device_type


def apply_long_context(model: PreTrainedModel, section: LongContextSection) -> None:
    """Switch the model's MLPs and its head and loss to their tiled forms, as the recipe asks."""
    if section.tiled_mlp:
        for layer in model.model.layers:
            tile_mlp(layer.mlp, model.config.hidden_size)
    if section.logits_tile_tokens:
        tile_logits_and_loss(model, section.logits_tile_tokens)
    if section.offload_checkpoints:
        offload_checkpoints(model)


def offload_checkpoints(model: PreTrainedModel) -> None:
    """Activation checkpointing (already on) saving each layer's input in host memory: copied out in the forward
    pass, back in the backward pass before the layer is recomputed (pinned memory on CUDA). transformers' own
    `offload=True` asks for pinned memory on CPU-only machines too, which PyTorch refuses."""
    pinned = device_type() == "cuda"

    def checkpoint_on_host(function, *args, **kwargs):
        with torch.autograd.graph.save_on_cpu(pin_memory=pinned):
            return checkpoint(function, *args, use_reentrant=False, **kwargs)

    set_checkpointing_function(model, checkpoint_on_host)


def tile_mlp(mlp: torch.nn.Module, hidden_size: int) -> None:
    """The MLP on tiles of about hidden_size tokens (DeepSpeed's TiledMLP): its intermediate activations exist
    for one tile at a time, in the forward pass and again in the backward pass, which recomputes them."""
    untiled = mlp.forward
    parameters = list(mlp.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles = max(1, math.ceil(x.shape[-2] / hidden_size))  # the same on every rank: the slices are equal
        return TiledMLP.apply(lambda module, tile: untiled(tile), self, x, tiles, parameters)

    replace_forward(mlp, forward)


def tile_logits_and_loss(model: PreTrainedModel, tile_tokens: int) -> None:
    """The causal LM's forward pass returning its loss (and no logits) from the head and cross-entropy run on
    tiles of `tile_tokens` tokens (DeepSpeed's sequence_tiled_compute), so the [tokens, vocab] logits never exist
    whole. The loss is transformers' (the summed token loss over num_items_in_batch, labels shifted unless
    shift_labels are given); the gradient scale DeepSpeed applies (accumulation, fp16 loss scale) reaches every
    tile, since each is recomputed and back-propagated with the incoming gradient."""
    head = model.lm_head

    def tile_loss(hidden_states: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        logits = head(hidden_states).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100,
                               reduction="sum")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                shift_labels: torch.Tensor | None = None, num_items_in_batch: float | None = None,
                **kwargs) -> CausalLMOutputWithPast:
        hidden = self.model(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state
        if shift_labels is None:
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=-100)
        tokens = hidden.shape[0] * hidden.shape[1]  # batch and sequence as one row: DeepSpeed's efficient case
        loss_sum = sequence_tiled_compute(
            tile_loss, seqlen=tokens, shards=math.ceil(tokens / tile_tokens),
            kwargs_to_shard={"hidden_states": hidden.reshape(1, tokens, -1),
                             "shift_labels": shift_labels.reshape(1, tokens)},
            kwargs_to_pass={}, grad_requiring_tensor_key="hidden_states", compute_params=list(head.parameters()),
            output_unshard_dimension=0, output_reduction="sum")
        targets = num_items_in_batch if num_items_in_batch is not None else (shift_labels != -100).sum()
        return CausalLMOutputWithPast(loss=loss_sum / targets)

    replace_forward(model, forward)
