"""`--dry-run`: the run's plan (batch arithmetic, parameter count, memory per rank by ZeRO stage) with nothing built."""
from dataclasses import dataclass
from pathlib import Path

import torch
from deepspeed.runtime.utils import partition_balanced, partition_uniform
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerBase

from training.ds_config import zero_stage
from training.recipe import Recipe


@dataclass
class RunPlan:
    """Everything decided before anything expensive runs."""
    recipe: Recipe
    model_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    precision: str
    ds_config: dict
    ds_config_path: Path
    world_size: int
    accumulation_steps: int
    output_dir: Path

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.ds_config)

    @property
    def pipeline_stages(self) -> int:
        return self.recipe.parallelism.pipeline_stages

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the world size over the pipeline stages."""
        return self.world_size // self.pipeline_stages


def count_parameters(config: PretrainedConfig) -> int:
    """Parameters of the model the config describes, built on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def pipeline_layer_parameters(config: PretrainedConfig) -> list[int]:
    """Parameters of each pipeline layer (training/pipeline.py): embedding, decoder layers, final norm, LM
    head (a tied head is the embedding again, held by the last stage too)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    embedding = count(model.get_input_embeddings())
    return [embedding, *(count(layer) for layer in model.model.layers), count(model.model.norm),
            embedding if config.tie_word_embeddings else count(model.get_output_embeddings())]


def stage_bounds(layer_parameters: list[int], stages: int, method: str) -> list[int]:
    """Where each stage starts, as DeepSpeed's PipelineModule partitions the layers."""
    if method == "uniform":
        return partition_uniform(len(layer_parameters), stages)
    return partition_balanced(layer_parameters, stages)


def model_state_bytes(params: int, stage: int, ranks: int, precision: str) -> float:
    """Per-rank bytes of weights + gradients + AdamW states (ZeRO paper arithmetic).

    Mixed precision keeps 16-bit weights and gradients (2 + 2 bytes) and fp32 master weights, momentum
    and variance (12 bytes); fp32 keeps 4 + 4 + 8. ZeRO-1 shards the optimizer states over the ranks,
    ZeRO-2 the gradients too, ZeRO-3 the weights too. (ZeRO-0 mixed precision runs as torch autocast:
    4 + 4 + 8, the same 16 bytes.)"""
    weights, grads, optimizer = (2, 2, 12) if precision in ("bf16", "fp16") else (4, 4, 8)
    shard = [(1, 1, 1), (1, 1, ranks), (1, ranks, ranks), (ranks, ranks, ranks)][stage]
    return params * (weights / shard[0] + grads / shard[1] + optimizer / shard[2])


def format_bytes(count: float) -> str:
    return f"{count / 2**30:,.2f} GiB" if count >= 2**30 else f"{count / 2**20:,.1f} MiB"


def print_plan(plan: RunPlan) -> None:
    recipe, training = plan.recipe, plan.recipe.training
    params = count_parameters(plan.model_config)
    ranks = plan.dp_size
    print(f"{recipe.name} ({recipe.path})")
    print(f"model: {recipe.model.config or recipe.model.name_or_path} ({type(plan.model_config).__name__}), "
          f"{params:,} parameters")
    print(f"batch: {training.micro_batch_size} rows/rank x {plan.accumulation_steps} accumulation x {ranks} ranks = "
          f"{training.global_batch_size} rows x {recipe.data.seq_len} tokens = "
          f"{training.global_batch_size * recipe.data.seq_len:,} tokens per step")
    print(f"DeepSpeed: {plan.ds_config_path.name} (ZeRO-{plan.zero_stage}), precision {plan.precision}, "
          f"activation checkpointing {'on' if recipe.activation_checkpointing else 'off'}")
    print(f"weights + gradients + AdamW per rank, {ranks} data-parallel rank(s), whole model:")
    table = Table()
    table.add_column("ZeRO stage")
    table.add_column("model states", justify="right")
    for stage in range(4):
        marker = " (this run)" if stage == plan.zero_stage else ""
        table.add_row(f"{stage}{marker}", format_bytes(model_state_bytes(params, stage, ranks, plan.precision)))
    Console(width=100).print(table)
    if plan.pipeline_stages > 1:
        print_pipeline_plan(plan)
    print(f"output: {plan.output_dir}")


def print_pipeline_plan(plan: RunPlan) -> None:
    layers = pipeline_layer_parameters(plan.model_config)
    bounds = stage_bounds(layers, plan.pipeline_stages, plan.recipe.parallelism.partition_method)
    print(f"pipeline: {plan.pipeline_stages} stages x {plan.dp_size} data-parallel rank(s), partitioned by "
          f"{plan.recipe.parallelism.partition_method}; per rank of each stage, ZeRO-{plan.zero_stage} over the "
          f"data-parallel ranks:")
    table = Table()
    for column in ("stage", "layers", "parameters", "model states per rank"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for stage in range(plan.pipeline_stages):
        start, end = bounds[stage], bounds[stage + 1]
        params = sum(layers[start:end])
        table.add_row(str(stage), f"{start}-{end - 1}", f"{params:,}",
                      format_bytes(model_state_bytes(params, plan.zero_stage, plan.dp_size, plan.precision)))
    Console(width=100).print(table)
