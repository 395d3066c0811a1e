"""The frozen reference model's memory per rank, estimated before a run: plan-time code, at the planning layer
(tests/test_import_order.py). The reference of GRPO with beta > 0 and of DPO with dpo.sync_ref_model, whose
memory.py each says whether theirs is live (grpo/memory.py, dpo/memory.py); the run holds it as
training/objectives/reference.py loads it."""
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.planning.precision import weights_dtype
from training.planning.shape import ModelShape


def reference_bytes(live: bool, recipe: Recipe, precision: Precision, shape: ModelShape, stage: int,
                    ranks: int) -> float:
    """The reference model per rank (training/objectives/reference.py, load_reference) where the objective holds
    one (`live`), without LoRA: the starting checkpoint, frozen, in the trained weights' dtype (weights_dtype: fp32
    at ZeRO-0, where 16-bit precision is torch autocast), partitioned over the `ranks` data-parallel ranks at ZeRO-3
    and a full copy on each at 0-2. 0 where there is none to hold: GRPO's beta 0, DPO's stored reference values, or
    LoRA (the base with its adapters disabled)."""
    if not live or recipe.lora.enabled:
        return 0.0
    whole = shape.parameters * weights_dtype(precision, stage).itemsize
    return whole / ranks if stage == 3 else whole
