"""The run plan: everything decided before anything expensive runs (the recipe, model config, precision, DeepSpeed
config and layout), and the machine a `--dry-run` plans for. Its memory is estimated in training/planning/memory.py
and printed by training/planning/report.py."""
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import psutil
import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from training.base.errors import ConfigError
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.planning.ds_config import zero_setting, zero_stage
from training.planning.layout import Layout, ParallelDims
from training.planning.precision import device_type
from training.planning.shape import ModelShape, model_shape


@dataclass(frozen=True)
class RunPlan:
    """Everything decided before anything expensive runs; made once, in train.make_plan, and not changed after."""
    recipe: Recipe
    model_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None  # None only in a dry run whose hub tokenizer is not cached here
    precision: Precision
    ds_config: dict
    ds_config_path: Path
    dims: ParallelDims  # every parallel degree, the world size and the data-parallel ranks they leave
    accumulation_steps: int
    output_dir: Path
    resume_universal: bool = False  # --resume from a checkpoint of another layout, through a universal checkpoint
    chosen_for: "Machine | None" = None  # deepspeed.config=auto: the machine the DeepSpeed config was chosen for
    micro_batch: "MicroBatchChoice | None" = None  # training.micro_batch_size=auto: what was chosen, and why
    base_digest: str | None = None  # the weights at model.name_or_path (training.models.model.weights_digest)

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.ds_config)

    @property
    def planned_for(self) -> "Machine | None":
        """The machine an `auto` (DeepSpeed config, micro-batch) was chosen for: a run then prints its plan."""
        return self.chosen_for or (self.micro_batch.machine if self.micro_batch else None)

    @property
    def zero_setting(self) -> str:
        return zero_setting(self.ds_config)

    @cached_property
    def shape(self) -> ModelShape:
        """The model's parameter counts and widths (with LoRA's trainable count): computed once, for every estimate."""
        return model_shape(self.model_config, self.recipe.lora)

    def layout(self) -> Layout:
        """What the run's checkpoints belong to."""
        dims = self.dims
        return Layout(world_size=dims.world_size, zero_stage=self.zero_stage, precision=self.precision,
                      pipeline_stages=dims.pipeline_stages, tensor_parallel=dims.tensor_parallel,
                      sequence_parallel=dims.sequence_parallel, expert_parallel=dims.expert_parallel,
                      optimizer=self.recipe.optimizer.name, lora=self.recipe.lora.enabled)


@dataclass(frozen=True)
class Machine:
    """What the plan is for: this machine's ranks, or a --num-gpus/--num-nodes/--gpu-mem what-if."""
    gpus_per_node: int
    nodes: int
    memory_per_rank: float  # bytes
    memory_source: str


@dataclass(frozen=True)
class MicroBatchChoice:
    """training.micro_batch_size=auto (training/planning/micro_batch.py): the micro-batch and its planned peak per rank,
    and the next larger divisor of the rows per rank with its peak, which did not fit (None: there is none)."""
    size: int
    planned_bytes: float
    larger: tuple[int, float] | None
    machine: Machine
    kept: bool = False  # --resume: the micro-batch the checkpoint was trained with, kept


def planned_machine(num_gpus: int | None, num_nodes: int, gpu_mem: float | None, world_size: int) -> Machine:
    """The GPUs (or CPU ranks) and memory per rank a dry run plans for: the --num-gpus/--gpu-mem what-if, or
    this machine (its GPU's memory, or on a CPU its RAM shared by the ranks)."""
    gpus_per_node = num_gpus or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    nodes = num_nodes if num_gpus else world_size // gpus_per_node
    if gpu_mem is not None:
        return Machine(gpus_per_node, nodes, gpu_mem * 2**30, "--gpu-mem")
    if device_type() == "cuda":
        properties = torch.cuda.get_device_properties(0)
        return Machine(gpus_per_node, nodes, properties.total_memory, properties.name)
    if num_gpus:
        raise ConfigError("--num-gpus plans for GPUs this machine does not have: give their memory too, "
                          "e.g. --gpu-mem 80 for an H100 80GB")
    return Machine(gpus_per_node, nodes, psutil.virtual_memory().total / gpus_per_node,
                   f"this machine's RAM over {gpus_per_node} rank(s)")

