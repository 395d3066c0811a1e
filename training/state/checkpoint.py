"""DeepSpeed checkpoints in DeepSpeed's own layout, saved so that `latest` only ever names a complete one.

A save writes, under `checkpoints/global_step{N}/`: DeepSpeed's files (weights, optimizer and scheduler
states), `rank_state{r}.pt` per rank (data position and RNG states), `run_state.json` (step, tokens seen,
and the world size, ZeRO stage and precision the states belong to) and `hf/` (the model config and
tokenizer, so that the folder exports on its own). Only when every rank has written and synced its
files does rank 0 replace `latest`, atomically. DeepSpeed's own `latest` write comes before the other
ranks finish and truncates the file before writing it, so a kill at the wrong moment can leave it
naming a partial checkpoint, or nothing.

A checkpoint resumes in the layout (ranks, ZeRO stage, precision) that wrote it as it is, and in another one
through a universal checkpoint (training/state/universal.py).
"""
import json
import os
import pickle
import random
import re
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from deepspeed.accelerator import get_accelerator
from pydantic import ValidationError

from training.base.errors import ConfigError
from training.base.output_guard import kept_line, owned_files, remove_owned, write_atomically
from training.compat.deepspeed.engine_step import z0_grad_scaler
from training.compat.deepspeed.universal import loading_universal, universal_load_repaired
from training.config.recipe import Recipe
from training.planning.layout import Layout
from training.state.run_state import RunState, faults
from training.state.universal import UNIVERSAL, needs_universal, through_universal, universal_folder

TAG = re.compile(r"global_step(\d+)")
RUN_STATE = "run_state.json"
READ_ERRORS = (RuntimeError, ValueError, EOFError, OSError, KeyError, pickle.UnpicklingError)  # torch.load's, of a
# file cut short, damaged or missing


def checkpoint_tags(checkpoint_dir: Path) -> list[str]:
    """Tag folders in step order."""
    tags = [p.name for p in checkpoint_dir.glob("global_step*") if p.is_dir() and TAG.fullmatch(p.name)]
    return sorted(tags, key=lambda tag: int(TAG.fullmatch(tag).group(1)))


def latest_tag(checkpoint_dir: Path) -> str | None:
    latest = checkpoint_dir / "latest"
    return latest.read_bytes().decode("utf-8", errors="replace").strip() if latest.is_file() else None


def resume_hint(output_dir: Path) -> str:
    """Where a run that lost a node continues from: its last complete checkpoint (`latest` moves only once a save is
    complete)."""
    checkpoints = output_dir / "checkpoints"
    if (tag := latest_tag(checkpoints)) is None:
        return "No checkpoint is saved yet: start the run again"
    return (f"The last complete checkpoint is {checkpoints / tag}: continue with --resume --output-dir {output_dir} "
            f"on the nodes left (in another layout it resumes through a universal checkpoint)")


def rng_states() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "accelerator": get_accelerator().get_rng_state()}


def restore_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    get_accelerator().set_rng_state(states["accelerator"])


def rank_state(engine: DeepSpeedEngine, data_state: dict) -> dict:
    """This rank's states that DeepSpeed's checkpoint leaves out: data position, RNG, fp16's loss scale at ZeRO-0."""
    scaler = z0_grad_scaler(engine)
    return {"data": data_state, "rng": rng_states(), **({"grad_scaler": scaler.state_dict()} if scaler else {})}


def has_frozen_parameters(engine: DeepSpeedEngine) -> bool:
    """A LoRA run's frozen base weights: checkpoints leave them out, since they load again from the base model."""
    return any(not p.requires_grad for p in engine.module.parameters())


def save_checkpoint(engine: DeepSpeedEngine, checkpoint_dir: Path, run_state: RunState, data_state: dict,
                    hf_files: tuple, keep_last: int | None, write_more: Callable[[Path], None] | None = None) -> dict:
    """Every rank calls it. `hf_files` is (model config, tokenizer); `write_more` writes files of the caller's into
    the tag's folder (every rank calls it, before the run state completes the save).
    Returns the save's `seconds` (until `latest` names it) and the `bytes` of its folder (counted on rank 0, else 0)."""
    started = time.perf_counter()
    write_files(engine, checkpoint_dir, run_state, data_state, hf_files, write_more)
    os.sync()  # this node's files are on disk before the run state and `latest` can name them complete
    dist.barrier()
    size = complete(checkpoint_dir, run_state, keep_last) if dist.get_rank() == 0 else 0
    seconds = time.perf_counter() - started
    dist.barrier()
    return {"seconds": seconds, "bytes": size}


def write_files(engine: DeepSpeedEngine, checkpoint_dir: Path, run_state: RunState, data_state: dict,
                hf_files: tuple, write_more: Callable[[Path], None] | None,
                defer: Callable[[Callable[[], object]], None] = lambda write: write()) -> None:
    """This rank's files of the save, all but the run state: DeepSpeed's and this rank's state through the engine's
    checkpoint engine (a background save's copies them to host memory), `hf/` through `defer` (a background save's
    thread writes it)."""
    tag, rank = f"global_step{run_state.step}", dist.get_rank()
    tag_dir = checkpoint_dir / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    engine.checkpoint_engine.save(rank_state(engine, data_state), str(tag_dir / f"rank_state{rank}.pt"))
    engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state={"step": run_state.step}, save_latest=False,
                           exclude_frozen_parameters=has_frozen_parameters(engine))
    if rank == 0:
        for item in hf_files:
            defer(partial(item.save_pretrained, tag_dir / "hf"))
    if write_more:
        write_more(tag_dir)


def complete(checkpoint_dir: Path, run_state: RunState, keep_last: int | None) -> int:
    """Rank 0, once every rank's files of the save are on disk: the run state, then `latest` (each atomically), then
    the checkpoints past `keep_last` removed. Returns the bytes of the tag's folder."""
    tag = f"global_step{run_state.step}"
    tag_dir = checkpoint_dir / tag
    write_atomically(tag_dir / RUN_STATE, run_state.file_text())  # last: the tag is complete
    write_atomically(checkpoint_dir / "latest", tag)
    size = sum(path.stat().st_size for path in tag_dir.rglob("*") if path.is_file())
    if keep_last:
        saved = [t for t in checkpoint_tags(checkpoint_dir) if int(TAG.fullmatch(t).group(1)) <= run_state.step]
        for old in saved[:-keep_last]:
            remove_run_folder(checkpoint_dir, old)
            universal = universal_folder(checkpoint_dir, old).relative_to(checkpoint_dir)
            remove_run_folder(checkpoint_dir, str(universal))
    return size


def record_position(engine: DeepSpeedEngine, checkpoint_dir: Path, run_state: RunState, data_state: dict) -> None:
    """Every rank calls it when the latest checkpoint is at this step already and only the data position has moved
    on (batches passed over since): the run and rank states are replaced, each file atomically, and DeepSpeed's
    files, which are the same, are left alone (rewriting them in place could leave no complete checkpoint)."""
    tag_dir = checkpoint_dir / f"global_step{run_state.step}"
    path = tag_dir / f"rank_state{dist.get_rank()}.pt"
    temporary = path.with_name(f".{path.name}.tmp")
    torch.save(rank_state(engine, data_state), temporary)
    os.replace(temporary, path)
    if dist.get_rank() == 0:
        write_atomically(tag_dir / RUN_STATE, run_state.file_text())
    os.sync()
    dist.barrier()


def is_complete(tag_dir: Path) -> bool:
    """A save is complete once its run state is written: the last file, after every rank has synced its own."""
    return (tag_dir / RUN_STATE).is_file()


def step_of(tag: str) -> int:
    return int(TAG.fullmatch(tag).group(1))


def way_back(checkpoint_dir: Path, damaged: str | None) -> str:
    """The way out when `latest` or its checkpoint is damaged: move it aside and resume from the newest complete one
    before it (nothing is deleted: the damaged folder is kept for a look)."""
    earlier = [t for t in checkpoint_tags(checkpoint_dir) if t != damaged and is_complete(checkpoint_dir / t)
               and (damaged is None or not TAG.fullmatch(damaged) or step_of(t) < step_of(damaged))]
    if not earlier:
        return "no earlier complete checkpoint is here: start a new run (--overwrite, or another --output-dir)"
    aside = (f"mv {checkpoint_dir / damaged} {checkpoint_dir / ('damaged-' + damaged)} && "
             if damaged and (checkpoint_dir / damaged).is_dir() else "")
    return (f"to resume from the newest complete one before it: {aside}echo {earlier[-1]} > "
            f"{checkpoint_dir / 'latest'} (complete checkpoints: {', '.join(earlier)})")


def read_run_state(checkpoint_dir: Path, tag: str | None = None) -> RunState:
    """The run state of `tag` (default: `latest`'s); cheap, so that a resume is checked before anything is built."""
    tag = tag or latest_tag(checkpoint_dir)
    if not tag or not TAG.fullmatch(tag) or not is_complete(checkpoint_dir / tag):
        raise ConfigError(f"--resume: {checkpoint_dir / 'latest'} names {tag!r}, not a complete checkpoint (a "
                          f"global_stepN folder with {RUN_STATE}); {way_back(checkpoint_dir, tag)}")
    path = checkpoint_dir / tag / RUN_STATE
    try:
        found = json.loads(path.read_bytes())
        run_state = RunState.model_validate(found)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"--resume: {path} is damaged (not JSON); {way_back(checkpoint_dir, tag)}") from None
    except ValidationError as error:
        raise ConfigError(f"--resume: {path} is damaged ({faults(error)}); {way_back(checkpoint_dir, tag)}") from None
    return run_state


def check_resume(checkpoint_dir: Path, layout: Layout, recipe: Recipe, base_digest: str | None) -> bool:
    """Whether the latest checkpoint can continue in this run's `layout`: True when it loads through a
    universal checkpoint (another layout), False when DeepSpeed loads it as it is; a ConfigError, before anything is
    built, that says whether the checkpoint is damaged or does not fit this run, and the way out."""
    run_state, tag = read_run_state(checkpoint_dir), latest_tag(checkpoint_dir)
    later = [t for t in checkpoint_tags(checkpoint_dir)
             if step_of(t) > run_state.step and is_complete(checkpoint_dir / t)]
    if later:
        raise ConfigError(f"--resume: {checkpoint_dir} holds complete checkpoints after {tag}, which `latest` names: "
                          f"{', '.join(later)}. A resume from {tag} would save over them, and they are never deleted: "
                          f"resume from the newest (echo {later[-1]} > {checkpoint_dir / 'latest'}), or move them out "
                          f"of {checkpoint_dir} first")
    check_files(checkpoint_dir, tag, [f"rank_state{rank}.pt" for rank in range(run_state.world_size)])
    max_steps = recipe.training.max_steps
    if max_steps is not None and run_state.step >= max_steps:
        raise ConfigError(f"--resume: {checkpoint_dir}/{tag} is at step {run_state.step} and training.max_steps is "
                          f"{max_steps}: nothing is left to train (raise training.max_steps to train on)")
    export_hint = (f"python -m training export {checkpoint_dir} DIR, then model.name_or_path=DIR (the optimizer "
                   f"state starts afresh)")
    if run_state.lora:
        check_same_base(checkpoint_dir / tag, run_state, recipe, base_digest)
    return needs_universal(run_state.layout(), layout, recipe.data.streaming, export_hint)


def check_files(checkpoint_dir: Path, tag: str, names: list[str]) -> None:
    """Files the checkpoint must hold are there: one missing is damage, named before anything is built."""
    missing = [name for name in names if not (checkpoint_dir / tag / name).is_file()]
    if missing:
        raise ConfigError(f"--resume: {checkpoint_dir / tag} is damaged: it lacks {', '.join(missing)}; "
                          f"{way_back(checkpoint_dir, tag)}")


def check_same_base(tag_dir: Path, run_state: RunState, recipe: Recipe, base_digest: str | None) -> None:
    """A LoRA checkpoint holds only the adapters: they resume on the base weights they were trained on, or not at
    all."""
    wrote = run_state.base_model
    if wrote is None or wrote.digest is None or base_digest is None or wrote.digest == base_digest:
        return  # written before the base was recorded, or a base not on this machine: nothing to compare
    raise ConfigError(f"--resume: the LoRA adapters in {tag_dir} were trained on the base model at "
                      f"{wrote.name_or_path} (weights digest {wrote.digest}), and model.name_or_path="
                      f"{recipe.model.name_or_path} now holds other weights (digest {base_digest}); adapters continued "
                      f"on another base would be silently wrong: point model.name_or_path at the base they were "
                      f"trained on, or start a new run (--overwrite, or another --output-dir)")


def remove_run_folder(checkpoint_dir: Path, folder: str) -> None:
    """The run's files in checkpoint_dir/folder (rank 0): a file of another's there stays, and is named."""
    output_dir, part = checkpoint_dir.parent, f"{checkpoint_dir.name}/{folder}"
    kept = remove_owned(output_dir, owned_files(output_dir, part), part)
    if kept:
        print(kept_line(kept, "train.py"), flush=True)


def remove_unfinished_tags(checkpoint_dir: Path) -> None:
    """Tag folders past `latest` without a run state are saves of this run that a kill interrupted: rank 0 removes
    them before resuming, since the resumed run saves its own at those steps. A complete one is never removed
    (check_resume refuses to resume before it)."""
    step = step_of(latest_tag(checkpoint_dir))
    if dist.get_rank() == 0:
        for tag in checkpoint_tags(checkpoint_dir):
            if step_of(tag) > step and not is_complete(checkpoint_dir / tag):
                remove_run_folder(checkpoint_dir, tag)
    dist.barrier()


MISMATCH = re.compile(r"size mismatch|Missing key|Unexpected key|Error\(s\) in loading state_dict|shape")


def load_checkpoint(engine: DeepSpeedEngine, checkpoint_dir: Path, layout: Layout) -> tuple[RunState, dict]:
    """Restore weights, optimizer, scheduler and RNG states (and fp16's loss scale at ZeRO-0) from the tag named in
    `latest`: as it is when this run's `layout` wrote it, else from its universal conversion (converted already:
    convert_on_rank_0). Returns the run state (its data position the step's where a checkpoint from before batches
    could be passed over has none) and this rank's data state. On another number of ranks, rank r takes
    the states of rank r mod the ranks that wrote them. A failure says whether the checkpoint is damaged (a file
    missing or unreadable), does not fit this run, or its universal conversion cannot be read."""
    tag, run_state = latest_tag(checkpoint_dir), read_run_state(checkpoint_dir)
    universal = through_universal(run_state.layout(), layout)
    rank_state_file = checkpoint_dir / tag / f"rank_state{dist.get_rank() % run_state.world_size}.pt"
    load_dir = checkpoint_dir / UNIVERSAL if universal else checkpoint_dir
    try:
        with loading_universal(engine, universal), universal_load_repaired(engine.optimizer) if universal \
                else nullcontext():
            path, _ = engine.load_checkpoint(str(load_dir), tag=tag,
                                             load_module_strict=not has_frozen_parameters(engine))
        rank_state = torch.load(rank_state_file, weights_only=False)
    except (*READ_ERRORS, AssertionError) as error:  # DeepSpeed asserts on some missing files
        raise ConfigError(load_failure(checkpoint_dir, tag, universal, error)) from None
    if path is None:
        raise ConfigError(f"--resume: DeepSpeed found no checkpoint files in {load_dir / tag}: it is damaged; "
                          f"{way_back(checkpoint_dir, tag)}")
    restore_rng_states(rank_state["rng"])
    continue_schedule(engine.lr_scheduler)
    scaler = z0_grad_scaler(engine)
    if scaler and "grad_scaler" in rank_state:
        scaler.load_state_dict(rank_state["grad_scaler"])
    if run_state.data_position is None:
        run_state.data_position = run_state.step
    return run_state, rank_state["data"]


def continue_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> None:
    """The learning rates of this run's schedule at the loaded step. The loaded optimizer holds the saving run's, and
    a resume may change the schedule (a higher training.max_steps stretches a cosine): the scheduler's own state sets
    no rate again, so the first resumed step trained at the old schedule's rate. Stepping back once and forward again
    recomputes them from this run's rules."""
    if scheduler is not None:
        scheduler.last_epoch -= 1
        scheduler.step()


def load_failure(checkpoint_dir: Path, tag: str, universal: bool, error: BaseException) -> str:
    """What a failed load means: a checkpoint that does not fit this run, a universal conversion that cannot be read,
    or a damaged checkpoint; each with its way out."""
    reason = " ".join(str(error).split())[:400] or type(error).__name__
    if MISMATCH.search(reason):
        return (f"--resume: {checkpoint_dir / tag} does not fit the model this run builds ({reason}); the checkpoint "
                f"is not damaged: resume with the recipe and overrides that wrote it "
                f"({checkpoint_dir.parent / 'resolved_recipe.yaml'}), or start a new run from its weights "
                f"(python -m training export {checkpoint_dir / tag} DIR)")
    if universal:
        return (f"--resume: the universal conversion {universal_folder(checkpoint_dir, tag)} of {tag} cannot be loaded "
                f"({reason}); the checkpoint itself is not blamed: remove that folder (train.py made it) and resume "
                f"again to convert anew, or resume in the layout that wrote {tag}")
    unreadable = unreadable_files(checkpoint_dir / tag)
    named = f"; {', '.join(unreadable)} cannot be read" if unreadable else ""
    return f"--resume: {checkpoint_dir / tag} is damaged ({reason}{named}); {way_back(checkpoint_dir, tag)}"


def unreadable_files(tag_dir: Path) -> dict[str, str]:
    """The checkpoint's files that torch cannot open, with why: where DeepSpeed's reader fails without naming the
    file. Memory-mapped, so only each file's index is read, however large the checkpoint."""
    unreadable = {}
    for path in sorted(tag_dir.glob("*.pt")):
        try:
            torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except READ_ERRORS as error:
            unreadable[path.name] = str(error)
    return unreadable
