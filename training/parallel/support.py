"""What each feature runs with in each layout: one table, walked by one check before anything is built, and
rendered in docs/parallelism.md (What runs in each layout).

A row is a feature (an objective, LoRA, a mixture of experts, an optimizer, or a parallel degree itself, for the
degrees that do not run together), how a recipe turns it on, and for each parallel degree (parallelism.<key>) that
it does not run with above 1, why; a degree absent runs. An objective's refusals are in its spec (`refused_layouts`,
training/objectives/<name>/spec.py), an optimizer's in its record (training/config/optimizers.py), so that this layer
names neither. A pair of degrees that do not run together is a row of the pair's first degree only; the docs' table
shows it both ways. The other checks of a layout (divisibility, ZeRO stages, precision, the model's family) stay with
each feature's own check."""
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PretrainedConfig

from training.base.errors import ConfigError
from training.config.optimizers import OPTIMIZERS
from training.config.recipe import Recipe
from training.models.moe import is_moe
from training.objectives.registry import SPECS
from training.planning.layout import ParallelDims

DEGREES = ("pipeline_stages", "tensor_parallel", "sequence_parallel", "expert_parallel")  # parallelism.<key>


@dataclass(frozen=True)
class Feature:
    name: str  # how the error and the docs name it
    on: Callable[[Recipe, PretrainedConfig], bool]  # whether the recipe (with its model) turns it on
    refused: dict[str, str]  # a degree -> why the feature does not run with it above 1
    off: str | None = None  # the setting that turns it off: the other way out
    degree: str | None = None  # the degree it is, for the degrees that do not run together


LAYOUT_PAIRS = {  # the degrees that do not run together, each pair once
    ("pipeline_stages", "tensor_parallel"): "tensor parallelism with pipeline stages is not built",
    ("tensor_parallel", "sequence_parallel"): "DeepSpeed 0.19.8 replaces the sequence-parallel groups with its "
                                              "tensor-parallel ones under AutoTP",
    ("pipeline_stages", "sequence_parallel"): "DeepSpeed's pipeline engine cannot run Ulysses attention (ZeRO-3 "
                                              "with sequence parallelism holds large models too)",
}


def degree_feature(degree: str) -> Feature:
    """A degree as a row: the degrees of the pairs it is the first of (render shows the pairs both ways)."""
    refused = {second: reason for (first, second), reason in LAYOUT_PAIRS.items() if first == degree}
    return Feature(f"parallelism.{degree} > 1", lambda recipe, config: getattr(recipe.parallelism, degree) > 1,
                   refused, f"parallelism.{degree}=1", degree)


def objective_feature(name: str) -> Feature:
    return Feature(f"training.objective={name}", lambda recipe, config: recipe.training.objective == name,
                   SPECS[name].refused_layouts)


def optimizer_feature(name: str) -> Feature:
    return Feature(f"optimizer.name={name}", lambda recipe, config: recipe.optimizer.name == name,
                   OPTIMIZERS[name].refused_layouts, "optimizer.name=adamw")


TABLE = [
    *(objective_feature(name) for name in SPECS),
    Feature("lora.enabled", lambda recipe, config: recipe.lora.enabled, {
        "pipeline_stages": "the pipeline rebuilds the model's layers without the adapters",
        "tensor_parallel": "AutoTP splits nn.Linear layers, not peft's adapter layers",
        "sequence_parallel": "not tested with adapters",
        "expert_parallel": "not built",
    }, "lora.enabled=false"),
    Feature("a mixture-of-experts model", lambda recipe, config: is_moe(config), {
        "pipeline_stages": "not tested",
        "tensor_parallel": "AutoTP does not split 3-D expert weights",
        "sequence_parallel": "not tested",
    }),
    *(optimizer_feature(name) for name, record in OPTIMIZERS.items() if record.refused_layouts),
    *(degree_feature(degree) for degree in DEGREES if any(degree in pair for pair in LAYOUT_PAIRS)),
]


def refusals(recipe: Recipe, config: PretrainedConfig, dims: ParallelDims) -> list[str]:
    """One line per feature the recipe turns on and degree of `dims` above 1 that it does not run with: the feature,
    the degree's setting, why, and the way out. A pair of degrees is reported once, from its first degree's row."""
    lines = []
    for feature in TABLE:
        if not feature.on(recipe, config):
            continue
        for degree, size in dims.enabled().items():
            reason = feature.refused.get(degree)
            if reason is None:
                continue
            way_out = f"set parallelism.{degree}=1" + (f", or {feature.off}" if feature.off else "")
            lines.append(f"{feature.name} with parallelism.{degree}={size}: {reason}; {way_out}")
    return lines


def check_support(recipe: Recipe, config: PretrainedConfig, dims: ParallelDims) -> None:
    """Every refusal of the table for this recipe, model and layout, in one error."""
    lines = refusals(recipe, config, dims)
    if lines:
        raise ConfigError(f"{len(lines)} setting(s) this layout does not run (docs/parallelism.md, What runs in "
                          f"each layout):\n" + "\n".join(f"  {line}" for line in lines))


def render() -> str:
    """The table as docs/parallelism.md quotes it: a row per feature, a column per degree, "yes" or why not; a
    degree's row with the pairs of degrees read both ways."""
    rows = [["feature", *(f"`{degree}`" for degree in DEGREES)], ["---"] * (len(DEGREES) + 1)]
    rows += [[feature.name, *("-" if degree == feature.degree else feature.refused.get(degree) or
                              LAYOUT_PAIRS.get((degree, feature.degree), "yes") for degree in DEGREES)]
             for feature in TABLE]
    return "".join(f"| {' | '.join(row)} |\n" for row in rows)
