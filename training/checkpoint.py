"""DeepSpeed checkpoints in DeepSpeed's own layout, saved so that `latest` only ever names a complete one.

A save writes, under `checkpoints/global_step{N}/`: DeepSpeed's files (weights, optimizer and scheduler
states), `rank_state{r}.pt` per rank (data position and RNG states), `run_state.json` (step, tokens seen,
and the world size, ZeRO stage and precision the states belong to) and `hf/` (the model config and
tokenizer, so that the folder exports on its own). Only when every rank has written and synced its
files does rank 0 replace `latest`, atomically. DeepSpeed's own `latest` write comes before the other
ranks finish and truncates the file before writing it, so a kill at the wrong moment can leave it
naming a partial checkpoint, or nothing.

A checkpoint resumes in the layout (ranks, ZeRO stage, precision) that wrote it as it is, and in another one
through a universal checkpoint (training/universal.py).
"""
import json
import os
import pickle
import random
import re
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from deepspeed.accelerator import get_accelerator
from transformers import PreTrainedTokenizerBase

from training.errors import ConfigError
from training.universal import UNIVERSAL, universal_load_repaired, needs_universal, universal_folder

TAG = re.compile(r"global_step(\d+)")
RUN_STATE = "run_state.json"


def checkpoint_tags(checkpoint_dir: Path) -> list[str]:
    """Tag folders in step order."""
    tags = [p.name for p in checkpoint_dir.glob("global_step*") if p.is_dir() and TAG.fullmatch(p.name)]
    return sorted(tags, key=lambda tag: int(TAG.fullmatch(tag).group(1)))


def latest_tag(checkpoint_dir: Path) -> str | None:
    latest = checkpoint_dir / "latest"
    return latest.read_bytes().decode("utf-8", errors="replace").strip() if latest.is_file() else None


def write_atomically(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a partial one: write aside, sync, rename."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


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
    scaler = engine.torch_autocast_z0_gradscaler
    return {"data": data_state, "rng": rng_states(), **({"grad_scaler": scaler.state_dict()} if scaler else {})}


def has_frozen_parameters(engine: DeepSpeedEngine) -> bool:
    """A LoRA run's frozen base weights: checkpoints leave them out, since they load again from the base model."""
    return any(not p.requires_grad for p in engine.module.parameters())


def save_checkpoint(engine: DeepSpeedEngine, checkpoint_dir: Path, run_state: dict, data_state: dict,
                    hf_files: tuple, keep_last: int | None) -> dict:
    """Every rank calls it. `run_state` must hold `step`; `hf_files` is (model config, tokenizer). Returns the
    save's `seconds` (until `latest` names it) and the `bytes` of its folder (counted on rank 0, else 0)."""
    started = time.perf_counter()
    tag, rank = f"global_step{run_state['step']}", dist.get_rank()
    tag_dir = checkpoint_dir / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    torch.save(rank_state(engine, data_state), tag_dir / f"rank_state{rank}.pt")
    engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state={"step": run_state["step"]}, save_latest=False,
                           exclude_frozen_parameters=has_frozen_parameters(engine))
    if rank == 0:
        for item in hf_files:
            item.save_pretrained(tag_dir / "hf")
        (tag_dir / RUN_STATE).write_text(json.dumps(run_state, indent=2) + "\n")
    os.sync()  # this node's files are on disk before `latest` can name them
    dist.barrier()
    size = 0
    if rank == 0:
        write_atomically(checkpoint_dir / "latest", tag)
        size = sum(path.stat().st_size for path in tag_dir.rglob("*") if path.is_file())
        if keep_last:
            saved = [t for t in checkpoint_tags(checkpoint_dir) if int(TAG.fullmatch(t).group(1)) <= run_state["step"]]
            for old in saved[:-keep_last]:
                shutil.rmtree(checkpoint_dir / old)
                shutil.rmtree(universal_folder(checkpoint_dir, old), ignore_errors=True)
    seconds = time.perf_counter() - started
    dist.barrier()
    return {"seconds": seconds, "bytes": size}


def record_position(engine: DeepSpeedEngine, checkpoint_dir: Path, run_state: dict, data_state: dict) -> None:
    """Every rank calls it when the latest checkpoint is at this step already and only the data position has moved
    on (batches passed over since): the run and rank states are replaced, each file atomically, and DeepSpeed's
    files, which are the same, are left alone (rewriting them in place could leave no complete checkpoint)."""
    tag_dir = checkpoint_dir / f"global_step{run_state['step']}"
    path = tag_dir / f"rank_state{dist.get_rank()}.pt"
    temporary = path.with_name(f".{path.name}.tmp")
    torch.save(rank_state(engine, data_state), temporary)
    os.replace(temporary, path)
    if dist.get_rank() == 0:
        write_atomically(tag_dir / RUN_STATE, json.dumps(run_state, indent=2) + "\n")
    os.sync()
    dist.barrier()


RUN_STATE_KEYS = ("step", "tokens_seen", "world_size", "zero_stage", "precision")


def other_checkpoints(checkpoint_dir: Path, but: str | None) -> str:
    """The way out when `latest` or its checkpoint is damaged: the other checkpoints that have a run state."""
    others = [t for t in checkpoint_tags(checkpoint_dir) if t != but and (checkpoint_dir / t / RUN_STATE).is_file()]
    if not others:
        return "no other checkpoint here has a run state: start a new run (--overwrite, or another --output-dir)"
    return (f"to resume from an earlier one, point `latest` at it: echo {others[-1]} > {checkpoint_dir / 'latest'} "
            f"(checkpoints with a run state: {', '.join(others)})")


def read_run_state(checkpoint_dir: Path) -> dict:
    """The latest complete checkpoint's run state; cheap, so that a resume is checked before anything is built."""
    tag = latest_tag(checkpoint_dir)
    if not tag or not TAG.fullmatch(tag) or not (checkpoint_dir / tag / RUN_STATE).is_file():
        raise ConfigError(f"--resume: {checkpoint_dir / 'latest'} names {tag!r}, not a complete checkpoint (a "
                          f"global_stepN folder with {RUN_STATE}); {other_checkpoints(checkpoint_dir, tag)}")
    path = checkpoint_dir / tag / RUN_STATE
    try:
        run_state = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        run_state = None
    missing = [key for key in RUN_STATE_KEYS if key not in run_state] if isinstance(run_state, dict) else RUN_STATE_KEYS
    if missing:
        raise ConfigError(f"--resume: {path} is damaged (not JSON, or without {', '.join(missing)}); "
                          f"{other_checkpoints(checkpoint_dir, tag)}")
    return run_state


def check_resume(checkpoint_dir: Path, layout: dict, streaming: bool, max_steps: int | None) -> bool:
    """Whether the latest checkpoint can continue in this run's `layout` (world size, ZeRO stage, precision,
    pipeline stages): True when it loads through a universal checkpoint (another layout), False when DeepSpeed
    loads it as it is; a ConfigError when it cannot, or when it is already at the run's last step."""
    run_state = read_run_state(checkpoint_dir)
    if max_steps is not None and run_state["step"] >= max_steps:
        raise ConfigError(f"--resume: {checkpoint_dir}/{latest_tag(checkpoint_dir)} is at step {run_state['step']} "
                          f"and training.max_steps is {max_steps}: nothing is left to train (raise training.max_steps "
                          f"to train on)")
    export_hint = (f"python -m training export {checkpoint_dir} DIR, then model.name_or_path=DIR (the optimizer "
                   f"state starts afresh)")
    return needs_universal(run_state, layout, streaming, export_hint)


def remove_unfinished_tags(checkpoint_dir: Path) -> None:
    """Tag folders past `latest` are saves that a kill interrupted: rank 0 removes them before resuming."""
    step = int(TAG.fullmatch(latest_tag(checkpoint_dir)).group(1))
    if dist.get_rank() == 0:
        for tag in checkpoint_tags(checkpoint_dir):
            if int(TAG.fullmatch(tag).group(1)) > step:
                shutil.rmtree(checkpoint_dir / tag)
    dist.barrier()


def load_checkpoint(engine: DeepSpeedEngine, checkpoint_dir: Path, universal: bool) -> tuple[dict, dict]:
    """Restore weights, optimizer, scheduler and RNG states (and fp16's loss scale at ZeRO-0) from the tag named
    in `latest` (from its universal conversion when `universal`); returns the run state and this rank's data
    position. On another number of ranks, rank r takes the states of rank r mod the ranks that wrote them."""
    tag, run_state = latest_tag(checkpoint_dir), read_run_state(checkpoint_dir)
    rank_state_file = checkpoint_dir / tag / f"rank_state{dist.get_rank() % run_state['world_size']}.pt"
    load_dir = checkpoint_dir / UNIVERSAL if universal else checkpoint_dir
    try:
        with universal_load_repaired(engine.optimizer) if universal else nullcontext():
            path, _ = engine.load_checkpoint(str(load_dir), tag=tag, load_module_strict=not has_frozen_parameters(engine))
        rank_state = torch.load(rank_state_file, weights_only=False)
    except (RuntimeError, EOFError, pickle.UnpicklingError, OSError, KeyError) as error:
        raise ConfigError(f"--resume: {load_dir / tag} cannot be loaded into this run ({error}); "
                          f"{other_checkpoints(checkpoint_dir, tag)}") from None
    if path is None:
        raise ConfigError(f"--resume: DeepSpeed found no checkpoint in {load_dir / tag}; "
                          f"{other_checkpoints(checkpoint_dir, tag)}")
    restore_rng_states(rank_state["rng"])
    scaler = engine.torch_autocast_z0_gradscaler
    if scaler and "grad_scaler" in rank_state:
        scaler.load_state_dict(rank_state["grad_scaler"])
    return run_state, rank_state["data"]


def export_hf(engine: DeepSpeedEngine, tokenizer: PreTrainedTokenizerBase, out_dir: Path, dtype: torch.dtype) -> None:
    """A folder that `AutoModelForCausalLM.from_pretrained` loads: config, safetensors weights in `dtype`, tokenizer.

    Every rank must call it: under ZeRO-3 and tensor parallelism the weights are gathered onto rank 0."""
    if engine.zero_optimization_partition_weights() or engine.autotp_size() > 1:
        state_dict = engine._consolidated_16bit_state_dict()  # ZeRO-3's and AutoTP's gather onto rank 0
    else:
        state_dict = engine.module.state_dict()
    if dist.get_rank() == 0:
        state_dict = {name: tensor.detach().to("cpu", dtype) for name, tensor in state_dict.items()}
        save_hf(engine.module, tokenizer, out_dir, state_dict, dtype)
    dist.barrier()


def save_hf(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, out_dir: Path, state_dict: dict,
            dtype: torch.dtype) -> None:
    """`save_pretrained` with the given weights; the config names their dtype (not the module's)."""
    config = model.config
    use_cache, config.use_cache = config.use_cache, True  # training turns the KV cache off; inference wants it
    model.save_pretrained(out_dir, state_dict=state_dict)
    module_dtype, config.dtype = config.dtype, dtype
    config.save_pretrained(out_dir)
    config.use_cache, config.dtype = use_cache, module_dtype
    tokenizer.save_pretrained(out_dir)
