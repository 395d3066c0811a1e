"""What the objective holds per rank beside the trained model's states, estimated before a run. Each objective counts
its own in its folder (training/objectives/<name>/memory.py: e.g. a frozen reference, reward models, a generation;
docs/objectives.md), named by its spec's `memory` ("module:function", as `runtime` names its class); planning
reaches it only through the spec (objective_memory), and with_objective adds it to a ZeRO setting's model states
(training/planning/model_states.py). A generation's memory comes between the steps, in place of the activations: the
peak counts the larger (ModelStates.peak_with)."""
from dataclasses import dataclass, replace

from training.base.loader import load
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.planning.ds_config import params_offloaded, zero_stage
from training.planning.model_states import ModelStates
from training.planning.shape import ModelShape


@dataclass(frozen=True)
class ObjectiveMemory:
    """What an objective's memory term (its spec's `memory`) returns: bytes per rank, and what a checkpoint holds."""
    reference: float = 0.0  # the frozen reference model (distill: the teacher): on the device, or in the nodes'
    # memory where ZeRO-3 offloads the parameters
    reward_models: float = 0.0  # on the device
    generation: float = 0.0  # between the steps, in place of the activations
    saved_reference: float = 0.0  # the synced reference each checkpoint holds, whole (reference.safetensors)


def objective_memory(recipe: Recipe, precision: Precision, shape: ModelShape, stage: int,
                     ranks: int) -> ObjectiveMemory:
    """The run's objective's memory at ZeRO `stage` over `ranks` data-parallel ranks: its spec's `memory` term, loaded
    by name (training/base/loader.py, as objective_class loads its class), or none where the spec names none (lm)."""
    named = recipe.training.spec.memory
    if named is None:
        return ObjectiveMemory()
    return load(named)(recipe, precision, shape, stage, ranks)


def with_objective(states: ModelStates, ds_config: dict, recipe: Recipe, precision: Precision, shape: ModelShape,
                   ranks: int, nodes: int) -> ModelStates:
    """`states` with what the objective holds beside the trained model under `ds_config` (objective_memory): its
    reference model on the device, or, where ZeRO-3 offloads the parameters (zero3_offload.json does; the
    reference's config keeps it), in the nodes' memory; its reward models on the device; and its generation's
    memory."""
    memory = objective_memory(recipe, precision, shape, zero_stage(ds_config), ranks)
    states = replace(states, generation_bytes=memory.generation,
                     device_bytes=states.device_bytes + memory.reward_models)
    if params_offloaded(ds_config):
        return replace(states, host_bytes=states.host_bytes + memory.reference * ranks / nodes)
    return replace(states, device_bytes=states.device_bytes + memory.reference)
