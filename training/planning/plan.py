"""`--dry-run`: the run's plan with nothing built: batch arithmetic, parameter count, FLOPs per token, memory
per rank under each ZeRO setting (model states and activations) and whether it fits, per pipeline stage too."""
import os
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import torch

from deepspeed.runtime.utils import partition_balanced, partition_uniform
from rich.console import Console
from rich.table import Table
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from training.config.ds_config import zero_stage
from training.config.errors import ConfigError
from training.planning.flops import flops_per_token
from training.planning.memory import (HEADROOM, LAUNCHER_GRACE_S, ZERO_SETTINGS, Activations, ModelStates, activation_bytes,
                             checkpoint_bytes, lora_model_states, model_states, zero_arithmetic,
                             zero_setting)
from training.loop.optimizer import optimizer_state_bytes
from training.planning.precision import DTYPES
from training.config.recipe import Recipe
from training.planning.shape import ModelShape, model_shape


@dataclass
class RunPlan:
    """Everything decided before anything expensive runs."""
    recipe: Recipe
    model_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None  # None only in a dry run whose hub tokenizer is not cached here
    precision: str
    ds_config: dict
    ds_config_path: Path
    world_size: int
    accumulation_steps: int
    output_dir: Path
    resume_universal: bool = False  # --resume from a checkpoint of another layout, through a universal checkpoint
    chosen_for: "Machine | None" = None  # deepspeed.config=auto: the machine the DeepSpeed config was chosen for
    base_digest: str | None = None  # the weights at model.name_or_path (training.models.model.weights_digest)

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.ds_config)

    @property
    def pipeline_stages(self) -> int:
        return self.recipe.parallelism.pipeline_stages

    @property
    def sequence_parallel(self) -> int:
        return self.recipe.parallelism.sequence_parallel

    @property
    def tensor_parallel(self) -> int:
        return self.recipe.parallelism.tensor_parallel

    def layout(self) -> dict:
        """What the run's checkpoints belong to (training/state/run_state.py's LAYOUT_KEYS)."""
        return {"world_size": self.world_size, "zero_stage": self.zero_stage, "precision": self.precision,
                "pipeline_stages": self.pipeline_stages, "tensor_parallel": self.tensor_parallel,
                "sequence_parallel": self.sequence_parallel, "optimizer": self.recipe.optimizer.name,
                "lora": self.recipe.lora.enabled}

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the world size over the pipeline stages, sequence- or tensor-parallel ranks."""
        return self.world_size // (self.pipeline_stages * self.sequence_parallel * self.tensor_parallel)

    def dp_rank(self, rank: int) -> int:
        """A rank's data-parallel rank: DeepSpeed numbers pipeline ranks stage-major, and a sequence- or
        tensor-parallel group is N consecutive ranks."""
        group = self.sequence_parallel * self.tensor_parallel
        return rank // group if group > 1 else rank % self.dp_size

    def sequence_shard(self, rank: int) -> tuple[int, int]:
        """(the rank's slice of each row, slices per row)."""
        return rank % self.sequence_parallel, self.sequence_parallel


@dataclass(frozen=True)
class Machine:
    """What the plan is for: this machine's ranks, or a --num-gpus/--num-nodes/--gpu-mem what-if."""
    gpus_per_node: int
    nodes: int
    memory_per_rank: float  # bytes
    memory_source: str


def planned_machine(num_gpus: int | None, num_nodes: int, gpu_mem: float | None, world_size: int) -> Machine:
    """The GPUs (or CPU ranks) and memory per rank a dry run plans for: the --num-gpus/--gpu-mem what-if, or
    this machine (its GPU's memory, or on a CPU its RAM shared by the ranks)."""
    gpus_per_node = num_gpus or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    nodes = num_nodes if num_gpus else world_size // gpus_per_node
    if gpu_mem is not None:
        return Machine(gpus_per_node, nodes, gpu_mem * 2**30, "--gpu-mem")
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        return Machine(gpus_per_node, nodes, properties.total_memory, properties.name)
    if num_gpus:
        raise ConfigError("--num-gpus plans for GPUs this machine does not have: give their memory too, "
                          "e.g. --gpu-mem 80 for an H100 80GB")
    return Machine(gpus_per_node, nodes, psutil.virtual_memory().total / gpus_per_node,
                   f"this machine's RAM over {gpus_per_node} rank(s)")


def stage_bounds(layer_parameters: list[int], stages: int, method: str) -> list[int]:
    """Where each stage starts, as DeepSpeed's PipelineModule partitions the layers."""
    if method == "uniform":
        return partition_uniform(len(layer_parameters), stages)
    return partition_balanced(layer_parameters, stages)


def format_bytes(count: float) -> str:
    return f"{count / 2**30:,.2f} GiB" if count >= 2**30 else f"{count / 2**20:,.1f} MiB"


def fits(total_without: float, total_with: float, memory: float) -> str:
    if total_without <= HEADROOM * memory:
        return "yes"
    return "with checkpointing" if total_with <= HEADROOM * memory else "no"


def memory_cells(states: float, acts: Activations | None, memory: float, in_flight: int = 1) -> list[str]:
    """The '+ activations', '+ act. (ckpt)' and 'fits' cells: model states plus the activations of the
    micro-batches in flight, without and with checkpointing ('?' for a model type without a rule)."""
    if acts is None:
        return ["?", "?", "?"]
    totals = [states + in_flight * acts.peak(checkpointing) for checkpointing in (False, True)]
    return [*map(format_bytes, totals), fits(*totals, memory)]


def activations(recipe: Recipe, precision: str, shape: ModelShape, **stage) -> Activations | None:
    """One micro-batch's activations on a rank: its slice of the rows under sequence parallelism, its share of
    the heads and the MLP width under tensor parallelism."""
    seq_len, long_context, parallelism = recipe.data.seq_len, recipe.long_context, recipe.parallelism
    shape = tensor_parallel_shard(shape, parallelism.tensor_parallel)
    return activation_bytes(shape, recipe.training.micro_batch_size * seq_len // parallelism.sequence_parallel, seq_len,
                            DTYPES[precision].itemsize, recipe.model.attn_implementation,
                            sequence_parallel=parallelism.sequence_parallel, tiled_mlp=long_context.tiled_mlp,
                            logits_tile_tokens=long_context.logits_tile_tokens,
                            offload_checkpoints=long_context.offload_checkpoints, **stage)


def shown(path: str | Path) -> str:
    """A local path as the user would type it here: relative to the current folder when it is under it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def print_plan(plan: RunPlan, machine: Machine) -> None:
    recipe, training = plan.recipe, plan.recipe.training
    shape = model_shape(plan.model_config, recipe.lora)
    print(f"{recipe.name} ({shown(recipe.path)})")
    print(f"model: {shown(recipe.model.config or recipe.model.name_or_path)} ({type(plan.model_config).__name__}), "
          f"{shape.parameters:,} parameters ({shape.matmul_parameters:,} in matrix multiplies"
          + (f" per token: {shape.experts_per_token} of {shape.num_experts} experts" if shape.num_experts else "") + ")")
    if plan.tokenizer is None:
        print(f"tokenizer: {recipe.tokenizer_path} is not in the local Hugging Face cache; not checked here "
              f"(the run downloads it)")
    print(f"layout: {plan.world_size} rank(s) = {plan.dp_size} data-parallel x {plan.tensor_parallel} "
          f"tensor-parallel x {plan.sequence_parallel} sequence-parallel x {plan.pipeline_stages} pipeline stage(s)")
    print(f"batch: {training.micro_batch_size} rows/rank x {plan.accumulation_steps} accumulation x {plan.dp_size} "
          f"data-parallel ranks = {training.global_batch_size} rows x {recipe.data.seq_len} tokens = "
          f"{training.global_batch_size * recipe.data.seq_len:,} tokens per step"
          + (f"; each row split over {plan.sequence_parallel} ranks, {recipe.data.seq_len // plan.sequence_parallel:,} "
             f"tokens each" if plan.sequence_parallel > 1 else ""))
    chosen = " chosen by deepspeed.config=auto: the least-sharded that fits" if plan.chosen_for else ""
    print(f"DeepSpeed: {plan.ds_config_path.name} (ZeRO-{plan.zero_stage}{chosen}), optimizer {recipe.optimizer.name}, "
          f"precision {plan.precision}, "
          f"activation checkpointing {'on' if recipe.activation_checkpointing else 'off'}")
    trainable = shape.lora_parameters
    if trainable is not None:
        print(f"LoRA: rank {recipe.lora.rank}, alpha {recipe.lora.alpha:g}, on {recipe.lora.target_modules}"
              f"{', base model in nf4 (QLoRA)' if recipe.lora.quantize == 'nf4' else ''}: "
              f"{trainable:,} trainable parameters ({trainable / shape.parameters:.2%} of the model's), the rest frozen")
    model_flops, hardware_flops = flops_per_token(shape, recipe.data.seq_len, recipe.activation_checkpointing)
    print(f"training FLOPs per token: {model_flops:.3e} ({'4N + 6N_LoRA' if trainable else '6N'} + attention), "
          f"{hardware_flops:.3e} with recomputation")
    if plan.pipeline_stages > 1:
        print_pipeline_plan(plan, shape, machine)
    else:
        print_memory_plan(plan, shape, machine)
        print_checkpoint_size(plan, shape)
    print(f"output: {plan.output_dir}")


def print_checkpoint_size(plan: RunPlan, shape: ModelShape) -> None:
    """What a save writes, against the time a preempted run has to write it (docs/checkpoints.md#preemption)."""
    size = checkpoint_bytes(shape.lora_parameters or shape.parameters, plan.zero_stage, plan.world_size // plan.pipeline_stages, plan.precision,
                            state_bytes(plan, shape))
    print(f"checkpoint: {format_bytes(size.total)} per save, {format_bytes(size.largest_rank)} from the busiest rank; "
          f"under the deepspeed launcher a SIGTERM save must finish within its {LAUNCHER_GRACE_S} s "
          f"({format_bytes(size.largest_rank / LAUNCHER_GRACE_S)}/s per rank), under srun within SLURM's grace")


def print_memory_plan(plan: RunPlan, shape: ModelShape, machine: Machine) -> None:
    """Model states per ZeRO setting over the data-parallel ranks, plus one micro-batch's activations."""
    acts = activations(plan.recipe, plan.precision, shape)
    current = zero_setting(plan.ds_config)
    print(f"memory per rank, {machine.gpus_per_node} GPU(s) x {machine.nodes} node(s), micro-batch "
          f"{plan.recipe.training.micro_batch_size} x {plan.recipe.data.seq_len // plan.sequence_parallel} tokens "
          f"on each rank; fits = within "
          f"{HEADROOM:.0%} of {format_bytes(machine.memory_per_rank)} ({machine.memory_source}):")
    if acts:
        print(f"activations: {format_bytes(acts.without_checkpointing)} without checkpointing, "
              f"{format_bytes(acts.with_checkpointing)} with"
              + (f" (and {format_bytes(acts.host)} of saved layer inputs in host memory per rank, "
                 f"{format_bytes(acts.host * machine.gpus_per_node)} per node)" if acts.host else ""))
    else:
        print(f"activations: no estimate for model type {shape.model_type}")
    table = Table()
    for column in ("ZeRO", "model states", "CPU per node", "estimated by", "+ activations", "+ act. (ckpt)", "fits"):
        table.add_column(column, justify="left" if column in ("ZeRO", "estimated by", "fits") else "right")
    for setting, states in states_per_setting(plan.recipe, plan.precision, shape, machine).items():
        marker = " (this run)" if setting == current else ""
        table.add_row(setting.replace("_", " + ") + marker, format_bytes(states.device_bytes),
                      format_bytes(states.host_bytes) if states.host_bytes else "-", states.source,
                      *memory_cells(states.device_bytes, acts, machine.memory_per_rank))
    Console(width=140).print(table)


def print_pipeline_plan(plan: RunPlan, shape: ModelShape, machine: Machine) -> None:
    """Per stage: its layers, parameters, model states (ZeRO-0/1 over the data-parallel ranks; the pipeline
    engine supports no more) and activations of the micro-batches in flight: with DeepSpeed's 1F1B schedule
    stage k holds up to (stages - k) of them."""
    layers = shape.pipeline_layer_parameters
    stages, method = plan.pipeline_stages, plan.recipe.parallelism.partition_method
    bounds = stage_bounds(layers, stages, method)
    print(f"pipeline: {stages} stages x {plan.dp_size} data-parallel rank(s), partitioned by {method}; per rank "
          f"of each stage, ZeRO-{plan.zero_stage} over the data-parallel ranks; fits = within {HEADROOM:.0%} of "
          f"{format_bytes(machine.memory_per_rank)} ({machine.memory_source}):")
    table = Table()
    for column in ("stage", "layers", "parameters", "model states", "+ activations", "+ act. (ckpt)", "fits"):
        table.add_column(column, justify="left" if column in ("stage", "fits") else "right")
    for stage in range(stages):
        start, end = bounds[stage], bounds[stage + 1]
        params = sum(layers[start:end])
        states = zero_arithmetic(params, plan.zero_stage, plan.dp_size, plan.precision, state_bytes(plan, shape))
        decoder_layers = sum(1 <= index <= shape.num_layers for index in range(start, end))
        acts = activations(plan.recipe, plan.precision, shape, layers=decoder_layers, with_head=stage == stages - 1)
        in_flight = min(stages - stage, plan.accumulation_steps)
        table.add_row(str(stage), f"{start}-{end - 1}", f"{params:,}", format_bytes(states),
                      *memory_cells(states, acts, machine.memory_per_rank, in_flight))
    Console(width=140).print(table)


def tensor_parallel_shard(shape: ModelShape, size: int) -> ModelShape:
    """What one rank of a tensor-parallel group holds and computes: AutoTP splits the decoder layers' matrices
    (their norms, a small part, are counted split too) and so their heads and MLP width; the embedding, the
    head and the hidden-wide activations stay whole."""
    if size == 1:
        return shape
    layers = tuple(count // size for count in shape.layer_parameters)
    return replace(shape, parameters=shape.parameters - sum(shape.layer_parameters) + sum(layers),
                   layer_parameters=layers, num_heads=shape.num_heads // size,
                   num_kv_heads=shape.num_kv_heads // size, intermediate_size=shape.intermediate_size // size)


def states_per_setting(recipe: Recipe, precision: str, shape: ModelShape, machine: Machine) -> dict[str, ModelStates]:
    """Each ZeRO setting's model states per rank on `machine` (a rank's slice under tensor parallelism, ZeRO over
    the data-parallel ranks; with LoRA, the shape's lora_parameters on frozen weights); offload only in mixed precision
    (DeepSpeed's offload keeps 16-bit weights on the GPU)."""
    tp, state_bytes = recipe.parallelism.tensor_parallel, optimizer_state_bytes(recipe.optimizer.name, shape)
    settings = [setting for setting in ZERO_SETTINGS if not (precision == "fp32" and setting.endswith("_offload"))]
    if shape.lora_parameters is not None:
        return {setting: lora_model_states(setting, shape, shape.lora_parameters, machine.gpus_per_node, machine.nodes,
                                           precision, state_bytes, recipe.lora.quantize == "nf4")
                for setting in settings}
    return {setting: model_states(setting, tensor_parallel_shard(shape, tp), machine.gpus_per_node // tp,
                                  machine.nodes, precision, zero_init=recipe.model.name_or_path is not None,
                                  state_bytes=state_bytes) for setting in settings}


def planned_model_states(plan: RunPlan) -> ModelStates:
    """The run's model-state estimate per rank: its ZeRO setting over its data-parallel ranks (one node), or
    with pipeline stages the largest stage's share. ValueError where there is no estimate (offload in fp32)."""
    shape = model_shape(plan.model_config, plan.recipe.lora)
    if shape.lora_parameters is not None:
        return lora_model_states(zero_setting(plan.ds_config), shape, shape.lora_parameters, plan.world_size, 1,
                                 plan.precision, state_bytes(plan, shape), plan.recipe.lora.quantize == "nf4")
    if plan.pipeline_stages == 1:
        return model_states(zero_setting(plan.ds_config), tensor_parallel_shard(shape, plan.tensor_parallel),
                            plan.world_size // plan.tensor_parallel, 1, plan.precision,
                            zero_init=plan.recipe.model.name_or_path is not None, state_bytes=state_bytes(plan, shape))
    layers = shape.pipeline_layer_parameters
    bounds = stage_bounds(layers, plan.pipeline_stages, plan.recipe.parallelism.partition_method)
    largest = max(sum(layers[start:end]) for start, end in zip(bounds, bounds[1:]))
    return ModelStates(zero_arithmetic(largest, plan.zero_stage, plan.dp_size, plan.precision, state_bytes(plan, shape)),
                       0.0, "ZeRO arithmetic")


def state_bytes(plan: RunPlan, shape: ModelShape) -> float:
    """The run's optimizer-state bytes per parameter."""
    return optimizer_state_bytes(plan.recipe.optimizer.name, shape)
