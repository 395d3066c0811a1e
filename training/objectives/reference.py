"""The reference model of a full fine-tune, GRPO's (beta > 0) and DPO's with dpo.sync_ref_model (under LoRA it is the
base with the adapters disabled, no model of its own): loaded from the starting checkpoint (load_reference) and, with
sync_ref_model (TR-DPO), mixed into by the policy every ref_model_sync_steps steps (SyncedReference). A synced
reference is no longer the starting checkpoint, so each checkpoint holds it (save_reference, restore_reference): a
resume, in any layout, and a rewind go on with the reference of the step they continue from. Under ZeRO-3 the
reference is partitioned over the ranks as the trained model is, and these go through DeepSpeed's GatheredParameters
one weight at a time (no rank holds it whole)."""
from contextlib import nullcontext
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PretrainedConfig

from training.base.errors import ConfigError
from training.models.model import from_checkpoint
from training.planning.ds_config import params_offloaded
from training.planning.objective_memory import objective_memory
from training.planning.plan import RunPlan
from training.planning.report import format_bytes

REFERENCE_FILE = "reference.safetensors"  # in a checkpoint's global_step{N}/, with grpo's or dpo's sync_ref_model


def reference_place(plan: RunPlan) -> str:
    """Where a full fine-tune's reference lives (load_reference) and what it takes per rank (objective_memory)."""
    ranks = plan.dims.dp_size
    per_rank = format_bytes(objective_memory(plan.recipe, plan.precision, plan.shape, plan.zero_stage, ranks).reference)
    if plan.zero_stage != 3:
        return f"the starting checkpoint, a frozen copy on each rank ({per_rank})"
    where = "in CPU memory (offload_param)" if params_offloaded(plan.ds_config) else "on the device"
    return (f"the starting checkpoint, frozen, partitioned over the {ranks} ranks by ZeRO-3: {per_rank} per "
            f"rank, {where}")


def synced_note(plan: RunPlan, alpha: float, every: int) -> str:
    """The plan's words for a synced reference (SyncedReference): how often, and what each checkpoint holds of it."""
    whole = objective_memory(plan.recipe, plan.precision, plan.shape, plan.zero_stage, 1).reference  # not partitioned
    return (f", synced to the policy every {every} steps (alpha {alpha:g}) and saved with each checkpoint by rank 0 "
            f"({format_bytes(whole)}, held whole in its CPU memory while written)")


def reference_ds_config(ds_config: dict) -> dict:
    """The run's DeepSpeed config for the frozen reference, as TRL's prepare_deepspeed makes it: without the optimizer
    and its offload (DeepSpeed would build an optimizer from them); ZeRO-3's partitioning, bucket sizes and parameter
    offload as the run's."""
    zero = {key: value for key, value in ds_config["zero_optimization"].items() if key != "offload_optimizer"}
    return {**{key: value for key, value in ds_config.items() if key not in ("optimizer", "scheduler")},
            "zero_optimization": zero}


def load_reference(plan: RunPlan, engine: deepspeed.DeepSpeedEngine) -> torch.nn.Module:
    """A full fine-tune's reference model: the starting checkpoint, frozen, built as the trained model is (its
    config, attention and dtype). At ZeRO 0-2 a full copy on each rank. Under ZeRO-3 partitioned over the ranks as the
    trained model is: loaded inside zero.Init (transformers loads there while an HfDeepSpeedConfig is alive), so that
    no rank holds it whole, and run by a DeepSpeed engine without an optimizer, whose forward gathers each layer's
    weights from every rank: so every rank must run it together, which they do (each rank's GRPO generation makes the
    same number of micro-batches, as many completions over the same micro_batch_size; each rank's DPO step and
    evaluation as many micro-batches of pairs, padded where short)."""
    return load_frozen(plan, engine, plan.recipe.model.name_or_path, plan.model_config)


def load_frozen(plan: RunPlan, engine: deepspeed.DeepSpeedEngine, name_or_path: str,
                config: PretrainedConfig) -> torch.nn.Module:
    """The checkpoint at `name_or_path`, of `config`, frozen beside the trained model as load_reference holds the
    reference (a distill run's teacher too): a copy on each rank at ZeRO 0-2, partitioned and run by an engine of
    its own under ZeRO-3."""
    zero3 = engine.zero_optimization_stage() == 3
    ds_config = reference_ds_config(plan.ds_config) if zero3 else plan.ds_config
    model = from_checkpoint(plan.recipe, config, ds_config, next(engine.module.parameters()).dtype, name_or_path)
    model.requires_grad_(False)
    if not zero3:
        return model.to(engine.device).eval()
    frozen, *_ = deepspeed.initialize(model=model, config=ds_config)
    frozen.eval()  # DeepSpeedEngine.eval returns None
    return frozen


def weights(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The named weights of a model, or of the model a DeepSpeed engine runs."""
    return list((model.module if isinstance(model, deepspeed.DeepSpeedEngine) else model).named_parameters())


def partitioned(reference: torch.nn.Module) -> bool:
    """Whether the reference is partitioned by ZeRO-3 (load_reference: then a DeepSpeed engine runs it)."""
    return isinstance(reference, deepspeed.DeepSpeedEngine)


def gathered(parameters: list[torch.nn.Parameter], zero3: bool, modified: bool):
    """Under ZeRO-3 the parameters whole on every rank while inside (rank 0's changes kept where `modified`)."""
    if not zero3:
        return nullcontext()
    return deepspeed.zero.GatheredParameters(parameters, modifier_rank=0 if modified else None)


@torch.no_grad()
def sync_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """TR-DPO's reference update, as TRL's SyncRefModelCallback makes it: reference = alpha x policy + (1 - alpha) x
    reference, weight by weight (the policy's weights as the engine holds them, in its training dtype). Every rank
    calls it."""
    zero3 = partitioned(reference)
    for (_, mine), (_, theirs) in zip(weights(reference), weights(policy), strict=True):
        with gathered([mine], zero3, modified=True), gathered([theirs], zero3, modified=False):
            if not zero3 or dist.get_rank() == 0:
                mine.mul_(1.0 - alpha).add_(theirs.to(mine.dtype), alpha=alpha)


@torch.no_grad()
def save_reference(reference: torch.nn.Module, folder: Path) -> None:
    """The reference's weights to folder/REFERENCE_FILE, written by rank 0 (under ZeRO-3 gathered to it one at a time,
    held whole in its CPU memory while written). Every rank calls it."""
    state, zero3 = {}, partitioned(reference)
    for name, weight in weights(reference):
        with gathered([weight], zero3, modified=False):
            if dist.get_rank() == 0:
                state[name] = weight.detach().to("cpu", copy=True)
    if dist.get_rank() == 0:
        save_file(state, str(folder / REFERENCE_FILE))


@torch.no_grad()
def restore_reference(reference: torch.nn.Module, folder: Path) -> bool:
    """The reference's weights from folder/REFERENCE_FILE (read by every rank at ZeRO 0-2, by rank 0 under ZeRO-3;
    every rank checks its names first, so that a wrong file stops every rank alike); False, and the reference left as
    it is, where the checkpoint holds none (it was written without grpo.sync_ref_model: the reference was still the
    starting checkpoint). Every rank calls it."""
    path = folder / REFERENCE_FILE
    if not path.is_file():
        return False
    zero3 = partitioned(reference)
    with safe_open(str(path), "pt") as file:
        missing = [name for name, _ in weights(reference) if name not in set(file.keys())]
        if missing:
            raise ConfigError(f"{path} lacks {len(missing)} of the model's weights ({missing[0]}, ...): it is not "
                              f"this model's reference; move the checkpoint aside, or start a new run")
        for name, weight in weights(reference):
            with gathered([weight], zero3, modified=True):
                if not zero3 or dist.get_rank() == 0:
                    weight.copy_(file.get_tensor(name))
    return True


class SyncedReference:
    """TR-DPO's reference (grpo.sync_ref_model, dpo.sync_ref_model): the policy mixed into it after every `every`-th
    applied step (a step that DeepSpeed or the stability guard drops does not count), saved with each checkpoint and
    restored from it. Every rank calls each method."""

    def __init__(self, model: torch.nn.Module, alpha: float, every: int, setting: str):
        self.model, self.alpha, self.every, self.setting = model, alpha, every, setting

    def end_step(self, policy: torch.nn.Module, step: int, applied: bool) -> None:
        if applied and step % self.every == 0:
            sync_reference(self.model, policy, self.alpha)

    def save(self, folder: Path) -> None:
        save_reference(self.model, folder)

    def restore(self, folder: Path) -> None:
        if not restore_reference(self.model, folder) and dist.get_rank() == 0:
            print(f"{folder} holds no synced reference (saved without {self.setting}): the reference is the starting "
                  f"checkpoint until its first sync", flush=True)
