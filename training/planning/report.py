"""What `--dry-run` prints (and a run chosen by `deepspeed.config=auto`): the plan's model, layout, batch, FLOPs, memory
per rank under each ZeRO setting (per pipeline stage too) and checkpoint size."""
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from training.planning.activations import (
    Activations,
    activation_bytes,
    activation_inputs,
    all_to_all_bytes_per_token,
    micro_batch_rows,
)
from training.planning.checkpoint_size import LAUNCHER_GRACE_S, async_host_bytes, planned_checkpoint
from training.planning.flops import flops_per_token
from training.planning.memory import HEADROOM, MemoryPlan, fits, memory_plan, stage_bounds, state_bytes
from training.planning.model_states import ModelStates, whole_gradient_bytes, zero_arithmetic
from training.planning.plan import Machine, RunPlan
from training.planning.shape import ModelShape, tensor_parallel_shard


def format_bytes(count: float) -> str:
    return f"{count / 2**30:,.2f} GiB" if count >= 2**30 else f"{count / 2**20:,.1f} MiB"


def memory_cells(states: ModelStates, acts: Activations | None, memory: float, in_flight: int = 1) -> list[str]:
    """The '+ activations', '+ act. (ckpt)' and 'fits' cells: the peak of model states with the activations of the
    micro-batches in flight, without and with checkpointing ('?' for a model type without a rule)."""
    if acts is None:
        return ["?", "?", "?"]
    without, with_checkpointing = (states.peak_with(in_flight * acts.peak(checkpointing))
                                   for checkpointing in (False, True))
    verdict = "yes" if fits(without, memory) else "with checkpointing" if fits(with_checkpointing, memory) else "no"
    return [format_bytes(without), format_bytes(with_checkpointing), verdict]


def shown(path: str | Path) -> str:
    """A local path as the user would type it here: relative to the current folder when it is under it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def print_plan(plan: RunPlan, machine: Machine, objective_lines: list[str]) -> None:
    """objective_lines: the objective's batch and what it adds (training/objectives/, describe)."""
    recipe = plan.recipe
    shape = plan.shape
    print(f"{recipe.name} ({shown(recipe.path)})")
    print(f"model: {shown(recipe.model.config or recipe.model.name_or_path)} ({type(plan.model_config).__name__}), "
          f"{shape.parameters:,} parameters ({shape.matmul_parameters:,} in matrix multiplies"
          + (f" per token: {shape.experts_per_token} of {shape.num_experts} experts" if shape.num_experts else "")
          + ")")
    if plan.tokenizer is None:
        print(f"tokenizer: {recipe.tokenizer_path} is not in the local Hugging Face cache; not checked here "
              f"(the run downloads it)")
    dims = plan.dims
    print(f"layout: {dims.world_size} rank(s) = {dims.dp_size} data-parallel x {dims.tensor_parallel} "
          f"tensor-parallel x {dims.sequence_parallel} sequence-parallel x {dims.pipeline_stages} pipeline stage(s)"
          + (f"; experts: {dims.expert_parallel} expert-parallel x {dims.world_size // dims.expert_parallel} "
             f"expert-data-parallel ({shape.num_experts // dims.expert_parallel} of each layer's {shape.num_experts} "
             f"experts per rank)" if dims.expert_parallel > 1 else ""))
    for line in objective_lines:
        print(line)
    if plan.micro_batch:
        print_micro_batch_choice(plan)
    chosen = " chosen by deepspeed.config=auto: the least-sharded that fits" if plan.chosen_for else ""
    print(f"DeepSpeed: {plan.ds_config_path.name} (ZeRO-{plan.zero_stage}{chosen}), optimizer {recipe.optimizer.name}, "
          f"precision {plan.precision}, "
          f"activation checkpointing {'on' if recipe.activation_checkpointing else 'off'}")
    trainable = shape.lora_parameters
    if trainable is not None:
        print(f"LoRA: rank {recipe.lora.rank}, alpha {recipe.lora.alpha:g}, on {recipe.lora.target_modules}"
              f"{', base model in nf4 (QLoRA)' if recipe.lora.quantize == 'nf4' else ''}: "
              f"{trainable:,} trainable parameters ({trainable / shape.parameters:.2%} of the model's), "
              "the rest frozen")
    model_flops, hardware_flops = flops_per_token(shape, recipe.data.seq_len, recipe.activation_checkpointing)
    print(f"training FLOPs per token: {model_flops:.3e} ({'4N + 6N_LoRA' if trainable else '6N'} + attention), "
          f"{hardware_flops:.3e} with recomputation")
    if plan.dims.pipeline_stages > 1:
        print_pipeline_plan(plan, shape, machine)
    else:
        print_memory_plan(plan, shape, machine)
        print_checkpoint_size(plan, machine.gpus_per_node)
    print(f"output: {plan.output_dir}")


def print_micro_batch_choice(plan: RunPlan) -> None:
    """Why training.micro_batch_size=auto took this micro-batch (training/planning/micro_batch.py): its planned peak per
    rank, and the next larger divisor's, which did not fit."""
    choice, training = plan.micro_batch, plan.recipe.training
    machine, unit = choice.machine, training.spec.unit
    budget = (f"{format_bytes(choice.planned_bytes)} per rank within "
              f"{format_bytes(HEADROOM * machine.memory_per_rank)} "
              f"({HEADROOM:.0%} of {format_bytes(machine.memory_per_rank)}, {machine.memory_source})")
    if choice.kept:
        print(f"micro-batch: {choice.size}, the checkpoint's, kept by training.micro_batch_size=auto on --resume: "
              f"{budget}")
        return
    rows = training.global_batch_size // plan.dims.dp_size
    larger = (f"{choice.larger[0]} would need {format_bytes(choice.larger[1])}" if choice.larger else
              f"that is all {rows}: no accumulation")
    print(f"micro-batch: {choice.size} chosen by training.micro_batch_size=auto, the largest divisor of the {rows} "
          f"{unit} per rank and step that fits: {budget}; {larger}")


def print_checkpoint_size(plan: RunPlan, gpus_per_node: int) -> None:
    """What a save writes, against the time a preempted run has to write it (docs/checkpoints.md#preemption), and
    the host memory an asynchronous save's copies hold on the busiest node while they are written."""
    size = planned_checkpoint(plan)
    print(f"checkpoint: {format_bytes(size.total)} per save, {format_bytes(size.largest_rank)} from the busiest rank; "
          f"under the deepspeed launcher a SIGTERM save must finish within its {LAUNCHER_GRACE_S} s "
          f"({format_bytes(size.largest_rank / LAUNCHER_GRACE_S)}/s per rank), under srun within SLURM's grace")
    checkpointing, max_steps = plan.recipe.checkpointing, plan.recipe.training.max_steps
    if checkpointing.asynchronous:
        print(f"checkpoint saves in the background (checkpointing.asynchronous): their copies hold "
              f"{format_bytes(async_host_bytes(size, plan.dims.world_size, gpus_per_node))} of host memory on the "
              f"busiest node while they are written")
    if checkpointing.average_last and max_steps:
        saves = checkpointing.save_steps(max_steps)
        print(f"checkpoint averaging (checkpointing.average_last): hf_average/, the mean of the checkpoints of steps "
              f"{', '.join(f'{step:,}' for step in saves[-checkpointing.average_last:])}")


def print_memory_plan(plan: RunPlan, shape: ModelShape, machine: Machine) -> None:
    """Model states per ZeRO setting over the data-parallel ranks, plus one micro-batch's activations."""
    current, memory = plan.zero_setting, memory_plan(plan.recipe, plan.precision, shape, machine, plan.ds_config)
    acts = memory.activations(current)
    print(f"memory per rank, {machine.gpus_per_node} GPU(s) x {machine.nodes} node(s), micro-batch "
          f"{micro_batch_rows(plan.recipe)} x {plan.recipe.data.seq_len // plan.dims.sequence_parallel} tokens "
          f"on each rank; fits = within "
          f"{HEADROOM:.0%} of {format_bytes(machine.memory_per_rank)} ({machine.memory_source}):")
    if acts:
        print(f"activations: {format_bytes(acts.without_checkpointing)} without checkpointing, "
              f"{format_bytes(acts.with_checkpointing)} with"
              + (f" (and {format_bytes(acts.host)} of saved layer inputs in host memory per rank, "
                 f"{format_bytes(acts.host * machine.gpus_per_node)} per node)" if acts.host else ""))
    else:
        print(f"activations: no estimate for model type {shape.model_type}")
    eager = memory.activations("3")
    if acts and eager and eager != acts:
        print(f"  with the layers compiled (compile), at ZeRO 0-2; the ZeRO-3 rows count them eager, as compile: auto "
              f"runs them there: {format_bytes(eager.without_checkpointing)} without checkpointing, "
              f"{format_bytes(eager.with_checkpointing)} with")
    if plan.dims.expert_parallel > 1:
        print_expert_parallel_memory(plan, memory, machine)
    table = Table()
    for column in ("ZeRO", "model states", "CPU per node", "estimated by", "+ activations", "+ act. (ckpt)", "fits"):
        table.add_column(column, justify="left" if column in ("ZeRO", "estimated by", "fits") else "right")
    for setting, states in memory.states.items():
        marker = " (this run)" if setting == current else ""
        table.add_row(setting.replace("_", " + ") + marker, format_bytes(states.device_bytes),
                      format_bytes(states.host_bytes) if states.host_bytes else "-", states.source,
                      *memory_cells(states, memory.activations(setting), machine.memory_per_rank))
    Console(width=140).print(table)


def print_expert_parallel_memory(plan: RunPlan, memory: MemoryPlan, machine: Machine) -> None:
    """What a rank keeps of the experts (model_states.py's and activations.py's expert-parallel formulas), and its
    all-to-all buffers."""
    size, ranks, shape = plan.dims.expert_parallel, machine.gpus_per_node * machine.nodes, plan.shape
    buffers = memory.inputs.tokens * all_to_all_bytes_per_token(shape, memory.inputs.dtype_bytes, size)
    print(f"experts: {shape.expert_parameters:,} parameters / {size} per rank, which ZeRO shards over the "
          f"{ranks // size} rank(s) holding the same experts, the other {shape.parameters - shape.expert_parameters:,} "
          f"over all {ranks}; the activations include one MoE layer's all-to-all buffers ({format_bytes(buffers)}); "
          f"only ZeRO-1 and 2 run with expert parallelism")


def print_pipeline_plan(plan: RunPlan, shape: ModelShape, machine: Machine) -> None:
    """Per stage: its layers, parameters, model states (ZeRO-0/1 over the data-parallel ranks; the pipeline
    engine supports no more) and activations of the micro-batches in flight: with DeepSpeed's 1F1B schedule
    stage k holds up to (stages - k) of them."""
    layers = shape.pipeline_layer_parameters
    stages, method = plan.dims.pipeline_stages, plan.recipe.parallelism.partition_method
    bounds = stage_bounds(layers, stages, method)
    inputs = activation_inputs(plan.recipe, plan.precision, shape)  # each stage's: its layers, the last with the head
    shard = tensor_parallel_shard(shape, plan.dims.tensor_parallel)
    print(f"pipeline: {stages} stages x {plan.dims.dp_size} data-parallel rank(s), partitioned by {method}; per rank "
          f"of each stage, ZeRO-{plan.zero_stage} over the data-parallel ranks; fits = within {HEADROOM:.0%} of "
          f"{format_bytes(machine.memory_per_rank)} ({machine.memory_source}):")
    table = Table()
    for column in ("stage", "layers", "parameters", "model states", "+ activations", "+ act. (ckpt)", "fits"):
        table.add_column(column, justify="left" if column in ("stage", "fits") else "right")
    for stage in range(stages):
        start, end = bounds[stage], bounds[stage + 1]
        params = sum(layers[start:end])
        states = ModelStates(zero_arithmetic(params, plan.zero_stage, plan.dims.dp_size, plan.precision,
                                             state_bytes(plan)),
                             0.0, "ZeRO arithmetic", whole_gradient_bytes(params, plan.zero_stage, plan.precision))
        decoder_layers = sum(1 <= index <= shape.num_layers for index in range(start, end))
        acts = activation_bytes(shard, replace(inputs, layers=decoder_layers, with_head=stage == stages - 1))
        in_flight = min(stages - stage, plan.accumulation_steps)
        table.add_row(str(stage), f"{start}-{end - 1}", f"{params:,}", format_bytes(states.device_bytes),
                      *memory_cells(states, acts, machine.memory_per_rank, in_flight))
    Console(width=140).print(table)

