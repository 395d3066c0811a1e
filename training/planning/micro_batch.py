"""`training.micro_batch_size: auto`: the largest micro-batch whose planned memory fits, the global batch unchanged.

The candidates are the divisors m of the rows each data-parallel rank trains on per step (global_batch_size / ranks),
so that global = m x accumulation x ranks holds exactly: each step trains on the same rows whatever m is, and its
loss is the token mean of the whole global batch (train.py's train_step), so m changes the split of a step into
forward passes, not the curve. A candidate fits when the plan's peak per rank, the model states of the run's ZeRO
setting plus one micro-batch's activations (training/planning/memory.py), is within deepspeed.config=auto's headroom
of a rank's memory (memory.fits; a GPU's, on a CPU the RAM its ranks share, in a dry run --gpu-mem). The activations
grow with m, so every divisor up to the chosen one fits too. m counts the objective's unit, planned as the rows its
examples take at most (a preference pair: 2; docs/objectives.md).

With deepspeed.config=auto the DeepSpeed config is chosen first, as for micro-batch 1 (auto_config.choose_ds_config),
then the largest micro-batch under it: auto_config's promise, the least-sharded setting that runs at all (and
activation checkpointing only when nothing fits without), stands, since sharding and recomputation cost time on
every step (communication, a second forward pass) that a larger micro-batch need not win back. A recipe that
prefers a larger micro-batch under more sharding names its DeepSpeed config.

--resume keeps the micro-batch the checkpoint was trained with (its run_state.json) while it still divides the rows
per rank and fits, so the resumed run repeats the arithmetic of the run that wrote it, even where the plan would
now choose another; otherwise (other ranks, a smaller GPU) it chooses afresh, and the curve still continues, the
global batch being the recipe's.
"""
from collections.abc import Callable
from dataclasses import replace

from transformers import PretrainedConfig

from training.base.errors import ConfigError
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.planning.activations import activation_inputs, micro_batch_rows
from training.planning.auto_config import with_seq_len, with_training
from training.planning.memory import HEADROOM, MemoryPlan, fits, memory_plan
from training.planning.plan import Machine, MicroBatchChoice
from training.planning.report import format_bytes
from training.planning.shape import ModelShape, model_shape


def choose_micro_batch(recipe: Recipe, config: PretrainedConfig, precision: Precision, setting: str,
                       machine: Machine | None, dp_size: int,
                       saved: int | None = None) -> tuple[Recipe, MicroBatchChoice | None]:
    """The recipe with training.micro_batch_size chosen for the ZeRO `setting` (model_states.ZERO_SETTINGS' names) over
    `dp_size` data-parallel ranks on `machine` (None only when the recipe names a number), and the choice, for the
    plan's print; the recipe as it is, and None, when it names a number. `saved`: the micro-batch of the checkpoint
    a --resume continues. A ConfigError when micro-batch 1 does not fit."""
    training = recipe.training
    if training.micro_batch_size != "auto":
        return recipe, None
    if recipe.parallelism.pipeline_stages > 1:
        raise ConfigError("training.micro_batch_size=auto with parallelism.pipeline_stages > 1: a pipeline's bubble "
                          "shrinks with more micro-batches per step, so the largest micro-batch is the wrong goal; "
                          "choose training.micro_batch_size yourself (--dry-run prints each stage's memory)")
    if training.global_batch_size % dp_size:
        raise ConfigError(f"training.global_batch_size={training.global_batch_size} is not a multiple of the "
                          f"{dp_size} data-parallel ranks: training.micro_batch_size=auto chooses a divisor of each "
                          f"rank's rows per step; choose a global batch size that {dp_size} divides")
    rows = training.global_batch_size // dp_size
    sizes = [size for size in range(1, rows + 1) if rows % size == 0]
    shape = model_shape(config, recipe.lora)
    memory = memory_plan(with_training(recipe, micro_batch_size=1), precision, shape, machine)
    peak = peak_per_rank(memory, recipe, precision, setting)
    kept = saved in sizes and fits(peak(saved), machine.memory_per_rank)
    chosen = saved if kept else max((size for size in sizes if fits(peak(size), machine.memory_per_rank)), default=0)
    if not chosen:
        raise ConfigError(nothing_fits(memory, recipe, shape, precision, setting, machine, peak(1)))
    larger = next((size for size in sizes if size > chosen), None)
    choice = MicroBatchChoice(chosen, peak(chosen), (larger, peak(larger)) if larger and not kept else None, machine,
                              kept)
    return with_training(recipe, micro_batch_size=chosen), choice


def peak_per_rank(memory: MemoryPlan, recipe: Recipe, precision: Precision, setting: str) -> Callable[[int], float]:
    """micro-batch -> the plan's peak bytes per rank: the setting's model states plus that micro-batch's activations
    (`memory`: the recipe's memory plan at micro-batch 1), with activation checkpointing as the recipe says, or
    the objective's generation where that is larger (the numbers --dry-run's memory table adds up)."""
    states = memory.states.get(setting)
    if states is None:
        raise ConfigError(f"training.micro_batch_size=auto: the memory plan has no estimate for ZeRO-{setting} in "
                          f"{precision}; set training.micro_batch_size to a number")
    if memory.activations(setting) is None:
        raise ConfigError(f"training.micro_batch_size=auto: the memory plan has no activation rule for model type "
                          f"{memory.shape.model_type}; set training.micro_batch_size to a number")

    def peak(size: int) -> float:
        acts = memory.activations(setting, rows=micro_batch_rows(with_training(recipe, micro_batch_size=size)))
        return states.peak_with(acts.peak(recipe.activation_checkpointing))
    return peak


def nothing_fits(plan: MemoryPlan, recipe: Recipe, shape: ModelShape, precision: Precision, setting: str,
                 machine: Machine, planned: float) -> str:
    """Why micro-batch 1 does not fit, with its numbers, and which change alone would make it fit (`plan`: the
    recipe's memory plan at micro-batch 1)."""
    one, memory = with_training(recipe, micro_batch_size=1), machine.memory_per_rank
    checkpointing = recipe.activation_checkpointing
    states, acts = plan.states, plan.activations(setting)
    lines = [f"training.micro_batch_size=auto: even micro-batch 1 does not fit in {format_bytes(HEADROOM * memory)} "
             f"per rank ({HEADROOM:.0%} of {format_bytes(memory)}, {machine.memory_source}): the plan is "
             f"{format_bytes(planned)} ({format_bytes(states[setting].device_bytes)} model states at "
             f"ZeRO-{setting.replace('_', ' + ')} + {format_bytes(acts.peak(checkpointing))} activations of "
             f"{micro_batch_rows(one)} row(s) x {recipe.data.seq_len} tokens, activation checkpointing "
             f"{'on' if checkpointing else 'off'}). What would fit:"]
    sharded = next((other for other, other_states in states.items() if other != setting and fits(
        other_states.peak_with(plan.activations(other).peak(checkpointing)), memory)), None)
    if sharded:
        lines.append(f"  deepspeed.config=zero{sharded} (or auto: the least-sharded that fits)")
    if not checkpointing and fits(states[setting].peak_with(acts.with_checkpointing), memory):
        lines.append("  activation_checkpointing=true")

    def with_rows_of(seq_len: int) -> float:
        """The peak with micro-batch 1 of rows of `seq_len` tokens, the model states as they are."""
        shorter = replace(plan, inputs=activation_inputs(with_seq_len(one, seq_len), precision, shape))
        return states[setting].peak_with(shorter.activations(setting).peak(checkpointing))
    seq_len = recipe.data.seq_len // 2
    while seq_len >= 128 and not fits(with_rows_of(seq_len), memory):
        seq_len //= 2
    if seq_len >= 128:
        lines.append(f"  data.seq_len={seq_len}")
    if len(lines) == 1:
        lines.append("  none of a more sharded ZeRO setting, checkpointing or shorter rows alone: "
                     "deepspeed.config=auto (each ZeRO setting, with checkpointing where needed), more GPUs or a "
                     "smaller model")
    generating = states[setting].generation_bytes
    if generating > acts.peak(checkpointing):  # the spec's words: its unit, the setting of a generation's length
        spec = recipe.training.spec
        lines.append(f"  a generation holds more than the activations, between the steps ("
                     f"{format_bytes(generating)}): fewer {spec.unit} per rank in training.global_batch_size, or a "
                     f"shorter data.seq_len or {spec.generation_length}")
    return "\n".join(lines)
