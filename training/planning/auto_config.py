"""`deepspeed.config=auto`: the DeepSpeed config chosen from the memory plan, before anything is built.

The least-sharded setting whose model states plus one micro-batch's activations fit within the plan's
headroom of a rank's memory (a GPU's, or on a CPU the RAM its ranks share): ZeRO-0, then 1, 2, 3, then 3 with
offload; without activation checkpointing first, and with it only when nothing fits without (a recipe that
turns checkpointing on keeps it). Settings that the run's own checks refuse (Muon with offload, tensor
parallelism at ZeRO-0, ...) are passed over. Offload moves model states to the host, whose memory is not
checked here (the plan prints what it needs per node). DeepSpeed's autotuner answers the same question by
running experiments; this needs none.

For a mixture of experts whose recipe leaves parallelism.expert_parallel at 1, ZeRO-1 and then 2 with the experts
split over expert_parallel_size ranks come after ZeRO-2 and before ZeRO-3: each rank then keeps 1/N of the experts'
weights whole, and the all-to-alls of the tokens' hidden states replace ZeRO-3's all-gather of every layer's
weights, forward and backward. A recipe that sets expert_parallel keeps it (and the settings it runs with).
"""
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PretrainedConfig

from training.base.errors import ConfigError
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.planning.activations import Activations
from training.planning.memory import HEADROOM, fits, memory_plan
from training.planning.model_states import EXPERT_PARALLEL_SETTINGS, ModelStates
from training.planning.plan import Machine
from training.planning.report import format_bytes
from training.planning.shape import ModelShape, model_shape

AUTO_ORDER = ("0", "1", "2", "3", "3_offload")  # least sharded first, named as ds_configs/zero*.json


@dataclass(frozen=True)
class Need:
    setting: str
    checkpointing: bool
    states: ModelStates  # per rank
    activations: float  # bytes per rank
    expert_parallel: int = 1

    @property
    def total(self) -> float:
        return self.states.peak_with(self.activations)

    @property
    def layout(self) -> str:
        """The setting as the shortfall names it, e.g. 'ZeRO-3 + offload', 'ZeRO-2 + expert_parallel=8'."""
        return f"ZeRO-{self.setting.replace('_', ' + ')}{self.experts}"

    @property
    def experts(self) -> str:
        return f" + expert_parallel={self.expert_parallel}" if self.expert_parallel > 1 else ""


def choose_ds_config(recipe: Recipe, config: PretrainedConfig, precision: Precision, machine: Machine,
                     refusal: Callable[[Recipe], str | None]) -> Recipe:
    """The recipe with `deepspeed.config` (and `activation_checkpointing`) as chosen; a ConfigError naming
    the shortfall and what would fit when nothing does. refusal(recipe): why the run's checks refuse it, or None.
    With training.micro_batch_size=auto the plan is for micro-batch 1; the micro-batch is chosen under the config
    after (training/planning/micro_batch.py says why)."""
    if recipe.parallelism.pipeline_stages > 1:
        raise ConfigError("deepspeed.config=auto plans one model per rank; with pipeline stages choose zero0 or "
                          "zero1 yourself (--dry-run prints each stage's memory)")
    tensor = recipe.parallelism.tensor_parallel
    if tensor > machine.gpus_per_node:
        raise ConfigError(f"deepspeed.config=auto with parallelism.tensor_parallel={tensor}: the plan is for "
                          f"{machine.gpus_per_node} GPU(s) per node, and a tensor-parallel group splits each matrix "
                          f"over the GPUs of one node; choose parallelism.tensor_parallel of at most "
                          f"{machine.gpus_per_node}, or plan for nodes of {tensor} or more GPUs (--num-gpus {tensor})")
    shape = model_shape(config, recipe.lora)
    planned = with_training(recipe, micro_batch_size=1) if recipe.training.micro_batch_size == "auto" else recipe
    refused = []
    for need in memory_needs(planned, shape, precision, machine):
        if fits(need.total, machine.memory_per_rank):
            chosen = with_setting(recipe, need)
            why = refusal(chosen)
            if why is None:
                return chosen
            refused.append(f"  {chosen.deepspeed.config}{need.experts}: " + " ".join(why.split()))
    if refused:
        raise ConfigError("deepspeed.config=auto: what fits, the run's checks refuse:\n" + "\n".join(refused))
    raise ConfigError(shortfall(planned, shape, precision, machine))


def memory_needs(recipe: Recipe, shape: ModelShape, precision: Precision, machine: Machine) -> list[Need]:
    """Each candidate's bytes per rank, in the order of preference."""
    order = candidates(recipe, shape, machine)
    plans = {size: layout_bytes(with_parallelism(recipe, expert_parallel=size), shape, precision, machine)
             for size in {size for _, size in order}}
    return [Need(setting, checkpointing, plans[size][0][setting], plans[size][1].peak(checkpointing), size)
            for checkpointing in ([True] if recipe.activation_checkpointing else [False, True])
            for setting, size in order if setting in plans[size][0]]


def candidates(recipe: Recipe, shape: ModelShape, machine: Machine) -> list[tuple[str, int]]:
    """(ZeRO setting, expert_parallel) in the order of preference (module docstring)."""
    size = recipe.parallelism.expert_parallel
    split = expert_parallel_size(shape, machine) if size == 1 else 1
    before = AUTO_ORDER.index("3")
    return ([(setting, size) for setting in AUTO_ORDER[:before]]
            + [(setting, split) for setting in EXPERT_PARALLEL_SETTINGS if split > 1]
            + [(setting, size) for setting in AUTO_ORDER[before:]])


def expert_parallel_size(shape: ModelShape, machine: Machine) -> int:
    """The expert parallelism tried for a mixture of experts: the most ranks of one node that split each layer's
    experts evenly, so that every MoE layer's all-to-alls, forward and backward, stay on the node's own links
    (NVLink), not the network between nodes; 1 for a dense model. (A divisor of the GPUs per node divides the world
    size, and DeepSpeed's expert-parallel groups, consecutive ranks, then do not cross nodes.)"""
    if not shape.num_experts:
        return 1
    return max(size for size in range(1, machine.gpus_per_node + 1)
               if machine.gpus_per_node % size == 0 and shape.num_experts % size == 0)


def layout_bytes(recipe: Recipe, shape: ModelShape, precision: Precision, machine: Machine) -> tuple[dict, Activations]:
    """The model states per setting and one micro-batch's activations of the recipe's layout (its memory plan)."""
    memory = memory_plan(recipe, precision, shape, machine)
    acts = memory.activations()
    if acts is None:
        raise ConfigError(f"deepspeed.config=auto: the plan has no activation rule for model type {shape.model_type}; "
                          f"choose a config under ds_configs/ yourself")
    return memory.states, acts


def with_setting(recipe: Recipe, need: Need) -> Recipe:
    deepspeed = recipe.deepspeed.model_copy(update={"config": f"zero{need.setting}"})
    return with_parallelism(recipe, expert_parallel=need.expert_parallel).model_copy(
        update={"deepspeed": deepspeed, "activation_checkpointing": need.checkpointing})


def shortfall(recipe: Recipe, shape: ModelShape, precision: Precision, machine: Machine) -> str:
    """Why nothing fits, with the smallest need, and what would fit: more GPUs, a smaller micro-batch, shorter
    rows (each tried alone, the rest as the recipe says)."""
    budget = HEADROOM * machine.memory_per_rank
    smallest = min(memory_needs(recipe, shape, precision, machine), key=lambda need: need.total)
    lines = [f"deepspeed.config=auto: nothing fits in {format_bytes(budget)} per rank ({HEADROOM:.0%} of "
             f"{format_bytes(machine.memory_per_rank)}, {machine.memory_source}); the smallest is "
             f"{smallest.layout}{' with activation checkpointing' if smallest.checkpointing else ''}"
             f": {format_bytes(smallest.total)} ({format_bytes(smallest.states.device_bytes)} model states + "
             f"{format_bytes(smallest.activations)} activations"
             + (f", of which {format_bytes(smallest.states.device_bytes + smallest.activations - smallest.total)} of "
                f"gradients are made as activations are freed" if smallest.total < smallest.states.device_bytes
                + smallest.activations else "") + "). What would fit:"]
    for nodes in (2, 4, 8, 16, 32, 64):
        more = Machine(machine.gpus_per_node, machine.nodes * nodes, machine.memory_per_rank, machine.memory_source)
        if anything_fits(recipe, shape, precision, more):
            lines.append(f"  {more.nodes} node(s) x {more.gpus_per_node} GPU(s) (ZeRO-3 shards the model states "
                         f"over more ranks)")
            break
    training = recipe.training
    if training.micro_batch_size > 1 and anything_fits(with_training(recipe, micro_batch_size=1), shape, precision,
                                                       machine):
        lines.append("  training.micro_batch_size=1 (the global batch stays: more accumulation steps)")
    seq_len = recipe.data.seq_len // 2
    while seq_len >= 128 and not anything_fits(with_seq_len(recipe, seq_len), shape, precision, machine):
        seq_len //= 2
    if seq_len >= 128:
        lines.append(f"  data.seq_len={seq_len}")
    if len(lines) == 1:
        lines.append("  none of more GPUs (up to 64x), micro-batch 1 or shorter rows alone: a smaller model")
    return "\n".join(lines)


def anything_fits(recipe: Recipe, shape: ModelShape, precision: Precision, machine: Machine) -> bool:
    return any(fits(need.total, machine.memory_per_rank) for need in memory_needs(recipe, shape, precision, machine))


def with_parallelism(recipe: Recipe, **changes) -> Recipe:
    return recipe.model_copy(update={"parallelism": recipe.parallelism.model_copy(update=changes)})


def with_training(recipe: Recipe, **changes) -> Recipe:
    return recipe.model_copy(update={"training": recipe.training.model_copy(update=changes)})


def with_seq_len(recipe: Recipe, seq_len: int) -> Recipe:
    return recipe.model_copy(update={"data": recipe.data.model_copy(update={"seq_len": seq_len})})
