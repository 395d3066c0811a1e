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
from functools import partial

import torch
import torch.distributed as dist
from deepspeed.utils import set_z3_leaf_modules
from transformers import PretrainedConfig

from training.base.errors import ConfigError
from training.config.recipe import Recipe
from training.config.sections import MoeSection
from training.planning.shape import expert_count

SPARSE_BLOCK_SUFFIX = "SparseMoeBlock"
ROUTER_SUFFIX = "TopKRouter"  # transformers' MixtralTopKRouter, Qwen3MoeTopKRouter; AutoEP's TokenChoiceTopKRouter
AUTOEP_ROUTER = "TokenChoiceTopKRouter"


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
    if recipe.long_context.tiled_mlp:  # the parallel degrees: training/parallel/support.py's table
        raise ConfigError(f"{config.model_type} is a mixture of experts, which runs here with data parallelism and "
                          f"ZeRO 0-3 (not tested with long_context.tiled_mlp): remove those settings")


def mark_sparse_blocks(model: torch.nn.Module) -> None:
    """Mark the model's sparse MoE blocks as ZeRO-3 leaf modules (a dense model has none)."""
    classes = sorted({type(m) for m in model.modules() if type(m).__name__.endswith(SPARSE_BLOCK_SUFFIX)},
                     key=lambda cls: cls.__name__)
    if classes:
        set_z3_leaf_modules(model, classes)


class RouterMeter:
    """What an MoE model's routers did in training: the load-balancing loss of the last optimizer step's
    micro-batches (the model output's `aux_loss`, read by a forward hook when the run trains with it) and the tokens
    each layer's experts were sent since the last logging step (forward hooks on the routers: transformers' and, under
    expert parallelism, AutoEP's). Each micro-batch is counted once: activation checkpointing's recomputation in the
    backward pass runs the routers again, after the model's forward has finished, and is not counted."""

    def __init__(self, model: torch.nn.Module, micro_batches: int, coefficient: float, experts: int):
        self.values, self.coefficient = deque(maxlen=micro_batches), coefficient
        routers = [m for m in model.modules() if type(m).__name__.endswith(ROUTER_SUFFIX)]
        self.tokens = torch.zeros(len(routers), experts, dtype=torch.int64)  # moved to the routers' device
        self.in_forward = False
        model.register_forward_pre_hook(lambda *_: setattr(self, "in_forward", True))
        model.register_forward_hook(self.record)
        for layer, router in enumerate(routers):
            router.register_forward_hook(partial(self.count, layer))

    def record(self, module: torch.nn.Module, args, output) -> None:
        self.in_forward = False
        if module.training and self.coefficient and getattr(output, "aux_loss", None) is not None:
            self.values.append(output.aux_loss.detach())

    def count(self, layer: int, module: torch.nn.Module, args, output) -> None:
        if module.training and self.in_forward:
            experts = routed_experts(module, output)
            self.tokens = self.tokens.to(experts.device)  # a no-op after the first count: no host sync per layer
            self.tokens[layer] += torch.bincount(experts.reshape(-1), minlength=self.tokens.shape[1])

    def step_mean(self) -> float:
        """The load-balancing loss's mean over the step's micro-batches and the data-parallel ranks."""
        mean = torch.stack(list(self.values)).mean() / dist.get_world_size()
        dist.all_reduce(mean)
        return mean.item()

    def metrics(self) -> dict:
        """For metrics.jsonl, every rank calling: `aux_loss` (when trained with it), `expert_tokens` (by layer, the
        tokens each expert was sent since the last call, summed over the ranks) and `expert_load_max` (the busiest
        expert's tokens over the layer's mean: 1 is a perfect balance, num_experts / top-k the worst)."""
        tokens = self.tokens.clone()
        dist.all_reduce(tokens)
        tokens = tokens.cpu().double()
        self.tokens.zero_()
        load = (tokens / tokens.mean(dim=1, keepdim=True).clamp(min=1)).max().item()
        return {**({"aux_loss": self.step_mean()} if self.coefficient else {}),
                "expert_tokens": tokens.long().tolist(), "expert_load_max": load}


def routed_experts(router: torch.nn.Module, output: tuple) -> torch.Tensor:
    """The experts a router picked for each token (tokens x top-k): transformers' routers return (logits, weights,
    experts), AutoEP's (weights, experts, tokens per expert)."""
    return output[1] if type(router).__name__ == AUTOEP_ROUTER else output[2]


def router_meter(model: torch.nn.Module, micro_batches: int) -> RouterMeter | None:
    """The router meter of an MoE model; None for a dense one (and a pipeline's PipelineModule, which has no config:
    MoE models run without pipeline stages)."""
    config = getattr(model, "config", None)
    if config is None or not is_moe(config):
        return None
    coefficient = config.router_aux_loss_coef if config.output_router_logits else 0.0
    return RouterMeter(model, micro_batches, coefficient, expert_count(config))


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
