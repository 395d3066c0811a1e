"""Memory per rank, estimated before a run, and whether it fits: each ZeRO setting's model states
(training/planning/model_states.py) with DeepSpeed's own buffers and what the objective holds beside them (a
reference model, reward models, a generation's memory: the objective's memory term, reached through its spec
by training/planning/objective_memory.py), and the peak with one micro-batch's activations
(training/planning/activations.py), or with a generation's memory where that is larger (ModelStates.peak_with).
`fits` leaves 10% of a rank's memory for what the estimates leave out.

A layout's memory is worked out once, as a value (MemoryPlan, by memory_plan), for each layout a decision weighs:
deepspeed.config=auto one per candidate recipe (training/planning/auto_config.py), micro_batch_size=auto one for the
chosen setting (training/planning/micro_batch.py), --dry-run's table one for the machine it plans for
(training/planning/report.py). It is shaped by what those callers vary: every setting's model states are fixed by
the layout, while the activations are asked for under several settings (compiled layers run eager at ZeRO-3) and,
in the micro-batch search, of several sizes, so it keeps the one ActivationInputs the recipe gives and answers each
question from it, in place of re-reading the recipe at every site. The three are not one value passed from step to
step: they plan different things (micro-batch 1 of an auto micro-batch, shipped configs before the run's is resolved,
the run's own resolved config in the table). RunPlan does not hold one either: the run's own estimate
(planned_model_states, planned_peak: its ranks, the largest pipeline stage) is a quantity of its own, read once by
tools/compare.py and benchmarks/gpu_throughput.py.
"""
from dataclasses import dataclass, replace

from deepspeed.runtime.utils import partition_balanced, partition_uniform

from training.config.precision import Precision
from training.config.recipe import Recipe
from training.planning.activations import ActivationInputs, Activations, activation_bytes, activation_inputs
from training.planning.ds_config import zero_setting
from training.planning.model_states import (
    EXPERT_PARALLEL_SETTINGS,
    ZERO_SETTINGS,
    ModelStates,
    expert_parallel_states,
    lora_model_states,
    model_states,
    shipped_ds_config,
    whole_gradient_bytes,
    with_deepspeed_buffers,
    zero_arithmetic,
)
from training.planning.objective_memory import with_objective
from training.planning.optimizer_states import optimizer_state_bytes
from training.planning.plan import Machine, RunPlan
from training.planning.shape import ModelShape, tensor_parallel_shard

HEADROOM = 0.9  # share of a GPU's memory the estimate may fill



def fits(total: float, memory: float) -> bool:
    """Whether `total` bytes fit in a rank's `memory`, leaving HEADROOM's share for what the estimate leaves out."""
    return total <= HEADROOM * memory



def stage_bounds(layer_parameters: list[int], stages: int, method: str) -> list[int]:
    """Where each stage starts, as DeepSpeed's PipelineModule partitions the layers."""
    if method == "uniform":
        return partition_uniform(len(layer_parameters), stages)
    return partition_balanced(layer_parameters, stages)



@dataclass(frozen=True)
class MemoryPlan:
    """A layout's memory per rank, worked out once from (recipe, precision, shape, machine) by memory_plan and read
    by each decision and print that needs it: each ZeRO setting's model states, and the one ActivationInputs of the
    recipe's micro-batch on the rank's tensor-parallel slice, from which `activations` gives a setting's (its
    layers eager under ZeRO-3) and another micro-batch's. It holds inputs, not Activations, because the two searches
    vary what the arithmetic reads: micro_batch.py the rows, auto_config.py and the report the setting."""
    states: dict[str, ModelStates]  # per ZeRO setting the layout runs with (states_per_setting)
    shape: ModelShape  # what the activations are counted on: a rank's slice under tensor parallelism
    inputs: ActivationInputs  # the recipe's micro-batch, its layers compiled where the recipe compiles them

    def activations(self, setting: str | None = None, rows: int | None = None) -> Activations | None:
        """One micro-batch's activations under the ZeRO `setting` (None: compiled as the recipe says, whatever the
        setting), of `rows` rows (None: the recipe's micro-batch); None for a model type without a rule."""
        inputs = self.inputs if setting is None else self.inputs.at_setting(setting)
        if rows is not None:  # counted as activation_inputs counts the recipe's
            inputs = replace(inputs, tokens=rows * inputs.seq_len // inputs.sequence_parallel)
        return activation_bytes(self.shape, inputs)



def memory_plan(recipe: Recipe, precision: Precision, shape: ModelShape, machine: Machine,
                ds_config: dict | None = None) -> MemoryPlan:
    """The recipe's layout's memory per rank on `machine` (states_per_setting; `ds_config`: the run's resolved
    config, for the setting it is), and its micro-batch's activation inputs (a whole number of examples)."""
    return MemoryPlan(states_per_setting(recipe, precision, shape, machine, ds_config),
                      tensor_parallel_shard(shape, recipe.parallelism.tensor_parallel),
                      activation_inputs(recipe, precision, shape))



def states_per_setting(recipe: Recipe, precision: Precision, shape: ModelShape, machine: Machine,
                       ds_config: dict | None = None) -> dict[str, ModelStates]:
    """Each ZeRO setting's model states per rank on `machine` (a rank's slice under tensor parallelism, ZeRO over
    the data-parallel ranks; with LoRA, the shape's lora_parameters on frozen weights; under expert parallelism only
    the settings it runs with, a rank's share of the experts); offload only in mixed precision (DeepSpeed's offload
    keeps 16-bit weights on the GPU). Each with the gradient buckets of the setting's shipped ds_configs file, or
    of `ds_config` (the run's resolved config) for the setting it is, and the objective's reference and generation
    (with_objective)."""
    tp, ep = recipe.parallelism.tensor_parallel, recipe.parallelism.expert_parallel
    mixed = precision != Precision.FP32
    settings = [setting for setting in ZERO_SETTINGS if mixed or not setting.endswith("_offload")]
    if ep > 1:
        settings = [setting for setting in settings if setting in EXPERT_PARALLEL_SETTINGS]
    ranks = machine.gpus_per_node * machine.nodes // tp
    optimizer = {setting: optimizer_state_bytes(recipe.optimizer.name, shape, int(setting[0]), ranks)
                 for setting in settings}
    if shape.lora_parameters is not None:
        states = {setting: lora_model_states(setting, shape, shape.lora_parameters, machine.gpus_per_node,
                                             machine.nodes, precision, optimizer[setting],
                                             recipe.lora.quantize == "nf4")
                  for setting in settings}
    elif ep > 1:
        states = {setting: expert_parallel_states(setting, shape, machine.gpus_per_node, machine.nodes, ep, precision,
                                                  optimizer[setting]) for setting in settings}
    else:
        states = {setting: model_states(setting, tensor_parallel_shard(shape, tp), machine.gpus_per_node // tp,
                                        machine.nodes, precision, zero_init=recipe.model.name_or_path is not None,
                                        state_bytes=optimizer[setting]) for setting in settings}
    own = zero_setting(ds_config) if ds_config else None
    for setting, state in states.items():
        config = ds_config if setting == own else shipped_ds_config(setting, shape.hidden_size)
        state = with_deepspeed_buffers(state, config, precision, recipe.optimizer.name, shape, ranks)
        states[setting] = with_objective(state, config, recipe, precision, shape, ranks, machine.nodes)
    return states



def planned_model_states(plan: RunPlan) -> ModelStates:
    """The run's model-state estimate per rank: its ZeRO setting over its data-parallel ranks (one node), a rank's
    share of the experts under expert parallelism, or with pipeline stages the largest stage's share; with the
    gradient buckets of its resolved DeepSpeed config (and Muon's staged momentum) and the objective's reference and
    generation (with_objective). ValueError where there is no estimate (offload in fp32)."""
    states = with_deepspeed_buffers(weights_gradients_and_states(plan), plan.ds_config, plan.precision,
                                    plan.recipe.optimizer.name, plan.shape, plan.dims.dp_size)
    return with_objective(states, plan.ds_config, plan.recipe, plan.precision, plan.shape, plan.dims.dp_size, 1)



def planned_peak(plan: RunPlan, states: ModelStates) -> float | None:
    """The run's peak per rank, --dry-run's table cell for its setting: its model states (planned_model_states) with
    one micro-batch's activations, checkpointed as the recipe says, or the objective's generation where larger; None
    under pipeline parallelism (planned per stage) or for a model type without an activation rule."""
    acts = activation_bytes(tensor_parallel_shard(plan.shape, plan.dims.tensor_parallel),
                            activation_inputs(plan.recipe, plan.precision, plan.shape).at_setting(plan.zero_setting))
    if acts is None or plan.dims.pipeline_stages > 1:
        return None
    return states.peak_with(acts.peak(plan.recipe.activation_checkpointing))



def weights_gradients_and_states(plan: RunPlan) -> ModelStates:
    """planned_model_states without DeepSpeed's own buffers (with_deepspeed_buffers)."""
    shape = plan.shape
    if shape.lora_parameters is not None:
        return lora_model_states(plan.zero_setting, shape, shape.lora_parameters, plan.dims.world_size, 1,
                                 plan.precision, state_bytes(plan), plan.recipe.lora.quantize == "nf4")
    if plan.dims.expert_parallel > 1:
        return expert_parallel_states(plan.zero_setting, shape, plan.dims.world_size, 1, plan.dims.expert_parallel,
                                      plan.precision, state_bytes(plan))
    if plan.dims.pipeline_stages == 1:
        return model_states(plan.zero_setting, tensor_parallel_shard(shape, plan.dims.tensor_parallel),
                            plan.dims.world_size // plan.dims.tensor_parallel, 1, plan.precision,
                            zero_init=plan.recipe.model.name_or_path is not None, state_bytes=state_bytes(plan))
    layers = shape.pipeline_layer_parameters
    bounds = stage_bounds(layers, plan.dims.pipeline_stages, plan.recipe.parallelism.partition_method)
    largest = max(sum(layers[start:end]) for start, end in zip(bounds, bounds[1:]))
    return ModelStates(zero_arithmetic(largest, plan.zero_stage, plan.dims.dp_size, plan.precision, state_bytes(plan)),
                       0.0, "ZeRO arithmetic", whole_gradient_bytes(largest, plan.zero_stage, plan.precision))



def state_bytes(plan: RunPlan) -> float:
    """The run's optimizer-state bytes per trained parameter (training/planning/optimizer_states.py)."""
    return optimizer_state_bytes(plan.recipe.optimizer.name, plan.shape, plan.zero_stage, plan.dims.dp_size)
