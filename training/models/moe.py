"""Mixture-of-experts models (Mixtral, Qwen3-MoE): ZeRO-3 leaf modules and the router's load-balancing loss.

transformers 5 keeps each layer's experts as 3-D weights of one module and calls it whatever the routing, but
ZeRO-3 would still fetch the router's and the experts' weights in separate hook calls whose order and prefetch
depend on the data each rank routes. Marking each sparse block (`...SparseMoeBlock`) as a ZeRO-3 leaf module
(DeepSpeed's set_z3_leaf_modules) gathers the whole block at once on every rank, the same collectives in the
same order. The load-balancing loss (Switch Transformer's, as transformers computes it) is added to the
training loss with `moe.aux_loss_coef`; metrics.jsonl logs the language-model loss and the router's loss apart.
"""
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from deepspeed.utils import set_z3_leaf_modules
from transformers import PretrainedConfig

from training.parallel import distributed
from training.config.errors import ConfigError
from training.config.recipe import MoeSection, Recipe

SPARSE_BLOCK_SUFFIX = "SparseMoeBlock"


def is_moe(config: PretrainedConfig) -> bool:
    return getattr(config, "num_experts_per_tok", None) is not None and hasattr(config, "router_aux_loss_coef")


def with_router_loss(config: PretrainedConfig, section: MoeSection) -> PretrainedConfig:
    """The config of an MoE model set to add the router's loss to the training loss at moe.aux_loss_coef (by default
    the checkpoint's own router_aux_loss_coef; 0 turns it off); a dense model's unchanged."""
    if is_moe(config):
        coefficient = config.router_aux_loss_coef if section.aux_loss_coef is None else section.aux_loss_coef
        config.router_aux_loss_coef, config.output_router_logits = coefficient, coefficient > 0
    return config


def check_moe(recipe: Recipe, config: PretrainedConfig) -> None:
    if not is_moe(config):
        if recipe.moe.model_fields_set:
            raise ConfigError(f"moe.* is set, but {config.model_type} is not a mixture-of-experts model: remove "
                              f"the moe section")
        return
    parallelism = recipe.parallelism
    if recipe.training.objective == "dpo" and config.output_router_logits:
        raise ConfigError("training.objective=dpo with the router's load-balancing loss: DPO's loss has no place for "
                          "it; set moe.aux_loss_coef=0")
    refused = [reason for condition, reason in (
        (parallelism.pipeline_stages > 1, "parallelism.pipeline_stages > 1"),
        (parallelism.tensor_parallel > 1, "parallelism.tensor_parallel > 1 (AutoTP does not split 3-D expert "
                                          "weights)"),
        (parallelism.sequence_parallel > 1, "parallelism.sequence_parallel > 1"),
        (recipe.long_context.tiled_mlp, "long_context.tiled_mlp"),
    ) if condition]
    if refused:
        raise ConfigError(f"{config.model_type} is a mixture of experts, which runs here with data parallelism and "
                          f"ZeRO 0-3 (not tested with {'; '.join(refused)}): remove those settings")


def mark_sparse_blocks(model: torch.nn.Module) -> None:
    """Mark the model's sparse MoE blocks as ZeRO-3 leaf modules (a dense model has none)."""
    classes = sorted({type(m) for m in model.modules() if type(m).__name__.endswith(SPARSE_BLOCK_SUFFIX)},
                     key=lambda cls: cls.__name__)
    if classes:
        set_z3_leaf_modules(model, classes)


class RouterLoss:
    """The router's load-balancing loss of the last optimizer step's micro-batches, read from the model's output
    (`aux_loss`) by a forward hook while training; evaluation runs without it (`without_router_loss`)."""

    def __init__(self, model: torch.nn.Module, micro_batches: int, coefficient: float):
        self.values, self.coefficient = deque(maxlen=micro_batches), coefficient
        model.register_forward_hook(self.record)

    def record(self, module: torch.nn.Module, args, output) -> None:
        if module.training and getattr(output, "aux_loss", None) is not None:
            self.values.append(output.aux_loss.detach())

    def step_mean(self) -> float:
        """The mean over the step's micro-batches and the data-parallel ranks."""
        mean = torch.stack(list(self.values)).mean() / dist.get_world_size()
        return distributed.all_reduce(mean).item()


def router_loss(model: torch.nn.Module, micro_batches: int) -> RouterLoss | None:
    """The router's loss meter of an MoE model trained with it; None otherwise (a pipeline's PipelineModule has no
    config: MoE models run without pipeline stages)."""
    config = getattr(model, "config", None)
    if config is None or not (is_moe(config) and config.output_router_logits):
        return None
    return RouterLoss(model, micro_batches, config.router_aux_loss_coef)


@contextmanager
def without_router_loss(config: PretrainedConfig) -> Iterator[None]:
    """Evaluation's loss is the language model's alone: an MoE model skips the router's loss meanwhile."""
    if not is_moe(config):
        yield
        return
    saved, config.output_router_logits = config.output_router_logits, False
    try:
        yield
    finally:
        config.output_router_logits = saved
