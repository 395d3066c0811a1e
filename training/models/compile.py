"""torch.compile, one decoder layer at a time (`compile`; regional compilation).

Compiling the whole model traced and optimized every layer anew (39 s before the first step of a 16-layer 1B Llama on
an H200). The layers of a decoder share their code, so compiling each layer as its own region traces and optimizes
one layer's graph once and reuses it for the others (dynamo guards on the code, not on each module's identity):
the first step pays for one layer. Inside a layer inductor fuses the norms, rotary embeddings, SwiGLU and FP8's
scaling and casts around the matmuls; the embedding, the head and the loss (training/models/fused_loss.py) stay
outside, so the target count that changes every step never reaches a compiled graph.

`auto` (the default) compiles where it is proven faster: on CUDA, with ZeRO 0-2 and data parallelism alone. On a CPU
compiling costs more than it saves for the small models trained there; under ZeRO-3 DeepSpeed's parameter hooks
break each layer into many graphs; pipeline, tensor, sequence and expert parallelism put collectives or their own
modules inside the layers. `compile: true` compiles the layers in any layout, graph breaks and all.

What compiling makes is kept in `compile_cache_dir` (torch's FX-graph cache of inductor's code, its AOT-autograd cache
of the forward and backward graphs, on a GPU Triton's kernels: all under TORCHINDUCTOR_CACHE_DIR), so the next run of
the recipe on the machine, or a resume, traces its layers again but compiles nothing: summary.json's
`kernels.compile_cache` counts what the run found there and what it compiled anew.
"""
import os
from pathlib import Path

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from training.compat.torch import compile_cache_counts
from training.config.recipe import Recipe
from training.planning.precision import device_type

DEFAULT_CACHE_DIR = "~/.cache/deepspeed-recipes/compile"


def resolve_compile(recipe: Recipe, zero_stage: int, for_gpus: bool = False) -> Recipe:
    """The recipe with `compile` decided for this machine and layout (for_gpus: a dry run planning for GPUs)."""
    if recipe.compile != "auto":
        return recipe
    parallelism = recipe.parallelism
    plain_layout = max(parallelism.pipeline_stages, parallelism.tensor_parallel, parallelism.sequence_parallel,
                       parallelism.expert_parallel) == 1
    chosen = (for_gpus or device_type() == "cuda") and zero_stage < 3 and plain_layout
    return recipe.model_copy(update={"compile": chosen})


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers, wherever they sit (a peft wrapper, a pipeline's stage): transformers' decoder
    layers are GradientCheckpointingLayers."""
    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def compile_layers(model: torch.nn.Module, **options) -> int:
    """Compile every decoder layer in place (nn.Module.compile: the module, its parameters and hooks stay what they
    are, so DeepSpeed and activation checkpointing see the same layer). Returns the number of layers compiled."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(**options)
    return len(layers)


def use_compile_cache(folder: str | None) -> Path:
    """Where this process's compiles look for and keep what they make: `folder`, else TORCHINDUCTOR_CACHE_DIR where it
    is set, else DEFAULT_CACHE_DIR. torch reads the variable when it first compiles (the first step), so setting it
    before then is enough."""
    path = Path(folder or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or DEFAULT_CACHE_DIR).expanduser()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def with_cache_counts(kernels: dict) -> dict:
    """The run's kernels with what its compiles found in the compile cache and compiled anew, at the end of the run
    (its graphs compile at the first step, and again where a guard fails)."""
    return {**kernels, "compile_cache": compile_cache_counts()}
