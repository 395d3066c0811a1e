"""Expert parallelism for mixture-of-experts models with DeepSpeed's AutoEP (`parallelism.expert_parallel: N`).

Inside deepspeed.initialize AutoEP replaces each sparse block (Mixtral's, Qwen3-MoE's) by its own layer: the router
stays whole on every rank, and each group of N ranks splits every layer's experts N ways (rank r of a group holds
experts r*E/N .. (r+1)*E/N - 1). A token's hidden state travels by all-to-all to the ranks of its top-k experts and
back. Every rank still reads its own rows, so data-parallel ranks = world size and the batch is unchanged; the
experts' gradients are averaged over the world size/N ranks that hold the same experts (DeepSpeed's expert-data-
parallel groups). The router's load-balancing loss is transformers', computed from each rank's router logits as
without expert parallelism.

The layouts built here: ZeRO-1 and ZeRO-2 without offload, the layouts proven to give the data-parallel run's
losses, router losses and gradient norms (tests/test_expert_parallel.py).
"""
import torch
from deepspeed import DeepSpeedEngine
from transformers import PretrainedConfig

from training.base.errors import ConfigError
from training.compat.deepspeed.autoep import autoep_layers
from training.config.families import FAMILIES, family_of
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.parallel import distributed
from training.planning.layout import EXPERT_PARALLEL_STAGES
from training.planning.shape import expert_count, rank_groups_problem


def check_expert_parallel(recipe: Recipe, config: PretrainedConfig, world_size: int, zero_stage: int,
                          offloaded: bool) -> None:
    """Whether AutoEP can split this model's experts over these ranks in a layout built here: before anything is
    built, each refusal with the nearest layout that runs."""
    size, problems = recipe.parallelism.expert_parallel, []
    if family_of(config.model_type).autoep_preset is None:  # training/config/families.py
        split = sorted(model_type for model_type, family in FAMILIES.items() if family.autoep_preset)
        raise ConfigError(f"parallelism.expert_parallel={size}: {config.model_type} is not a mixture of experts that "
                          f"AutoEP splits here ({', '.join(split)}); remove parallelism.expert_parallel")
    experts = expert_count(config)
    if experts % size:
        divisors = [d for d in range(2, experts + 1) if experts % d == 0]
        problems.append(f"the model's {experts} experts per layer do not split into {size} equal groups: choose "
                        f"parallelism.expert_parallel from {divisors}")
    problems += rank_groups_problem(world_size, size, "expert")
    if zero_stage not in EXPERT_PARALLEL_STAGES or offloaded:
        setting = f"ZeRO-{zero_stage}" + (" with offload" if offloaded else "")
        reason = {0: "train.py computes ZeRO-0's gradient norm itself, over whole weights, and AutoEP's experts are "
                     "split", 3: "ZeRO-3 with AutoEP is not proven here (its checkpoints and export)"}.get(
            zero_stage, "offload with AutoEP is not proven here")
        problems.append(f"{setting}: {reason}; use deepspeed.config=zero1 or zero2 (each rank already holds only "
                        f"its experts' weights), or expert_parallel=1 with ZeRO-3")
    if recipe.precision == Precision.FP8:  # LoRA: training/parallel/support.py's table
        problems.append("precision=fp8 with expert parallelism is not built: use bf16")
    if problems:
        raise ConfigError(f"parallelism.expert_parallel={size}:\n" + "\n".join(f"  {p}" for p in problems))


def hf_weights(engine: DeepSpeedEngine, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The module's weights under the original model's names (as_original), every expert's gathered from the ranks of
    its expert-parallel group. Every rank calls it (the gather)."""
    weights = dict(state_dict)
    for name, layer in autoep_layers(engine.module):
        # one layer's weights of every expert, from each rank's (ranks of the group hold consecutive experts)
        experts = {w: distributed.all_gather(weights.pop(f"{name}.experts.{w}"), layer.ep_group)
                   for w in ("w1", "w2", "w3")}
        as_original(weights, name, experts)
    return weights


def as_original(weights: dict[str, torch.Tensor], layer: str, experts: dict[str, torch.Tensor]) -> None:
    """In place: an AutoEP layer's router as the sparse block's `gate` (its alias `gate.gate` dropped), and its
    experts' w1 (gate), w3 (up) and w2 (down), each of every expert, as transformers' 3-D `experts.gate_up_proj`
    (gate rows, then up rows) and `experts.down_proj`."""
    prefix = f"{layer}."
    for alias in [key for key in weights if key.startswith(f"{prefix}gate.")]:
        del weights[alias]
    weights[f"{prefix}gate.weight"] = weights.pop(f"{prefix}router.gate.weight")
    weights[f"{prefix}experts.gate_up_proj"] = torch.cat([experts["w1"], experts["w3"]], dim=1)
    weights[f"{prefix}experts.down_proj"] = experts["w2"]


def original_weights(module: dict[str, torch.Tensor], expert_files: list[dict[str, torch.Tensor]]) \
        -> dict[str, torch.Tensor]:
    """A checkpoint's weights under the original model's names, from its module weights (all but the experts) and
    its expert files (each one expert's w1, w2, w3 of one layer, named `<layer>.experts.<w>.<expert>`)."""
    weights, experts = dict(module), {}
    for tensors in expert_files:
        for key, tensor in tensors.items():
            layer, _, w, expert = key.rsplit(".", 3)
            experts.setdefault(layer, {}).setdefault(w, {})[int(expert)] = tensor
    for layer, by_weight in experts.items():
        as_original(weights, layer, {w: torch.stack([by_expert[e] for e in sorted(by_expert)])
                                     for w, by_expert in by_weight.items()})
    return weights


