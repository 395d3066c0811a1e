"""DPO's memory beside the trained model's states, estimated before a run (its spec's `memory`, dpo_memory): the
frozen reference of dpo.sync_ref_model (training/objectives/reference_memory.py); without it the reference's
values are computed before step 1 and stored, and no reference model is held. Plan-time code, at the planning layer
(tests/test_import_order.py)."""
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.objectives.reference_memory import reference_bytes
from training.planning.objective_memory import ObjectiveMemory
from training.planning.shape import ModelShape


def dpo_memory(recipe: Recipe, precision: Precision, shape: ModelShape, stage: int, ranks: int) -> ObjectiveMemory:
    """What DPO holds per rank beside the trained model at ZeRO `stage` over `ranks` ranks: its synced reference,
    which each checkpoint holds whole."""
    live = recipe.dpo.sync_ref_model
    return ObjectiveMemory(reference=reference_bytes(live, recipe, precision, shape, stage, ranks),
                           saved_reference=reference_bytes(live, recipe, precision, shape, stage, 1))
