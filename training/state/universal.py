"""Resume on other hardware: a checkpoint written under another world size, ZeRO stage or precision is
converted once into a DeepSpeed universal checkpoint, which DeepSpeed loads into any ZeRO-1/2/3 layout.

The conversion is DeepSpeed's own, `deepspeed/checkpoint/ds_to_universal.py`, run as a child process: it
joins every rank's shard of each parameter's fp32 master weights and optimizer states (AdamW's moments
and step) into one file per parameter and state, `checkpoints/universal/<tag>/zero/<name>/`. Rank 0
writes it into a staging folder, lists its files and sizes in a manifest and renames it into place, so a
conversion a kill interrupts is never mistaken for a finished one; a finished one is reused while its manifest
holds, and made again when a file has gone missing or changed size since. DeepSpeed loads it with its config's
`checkpoint.load_universal` on (training/compat/deepspeed/universal.py loading_universal); our run state (step,
tokens seen, data position, RNG) is read from the original checkpoint folder. The folder checkpoints/universal/ is
train.py's own cache.

The converter needs DeepSpeed's UNIVERSAL_CHECKPOINT_INFO entry in the checkpoint, which Megatron-style
models carry and Hugging Face models do not: train.py gives every model it saves the entry (with plain
data parallelism its version is all there is to say), and for checkpoints written before it did, the
converter's own --inject_missing_state adds it.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist
from pydantic import ValidationError

from training.base.errors import ConfigError
from training.base.output_guard import link_on_the_way
from training.base.strict_json import dumps
from training.compat.deepspeed.checkpoint_files import pipeline_layer_file
from training.compat.deepspeed.universal import convert_with_tensor_parallel, make_stage_neutral
from training.config.optimizers import OPTIMIZERS, SHAPED_RULES
from training.parallel.distributed import patient_barrier
from training.planning.layout import Layout
from training.state.run_state import RunState

UNIVERSAL = "universal"  # the folder under checkpoints/ that holds converted checkpoints, one per tag
MANIFEST = ".manifest.json"  # in each converted folder: its files and sizes, written last


def through_universal(wrote: Layout, layout: Layout) -> bool:
    """Whether a checkpoint of the layout `wrote` loads into `layout` through its universal conversion (where
    needs_universal allows the change at all): any change but one between ZeRO-0 layouts, where nothing is
    partitioned and DeepSpeed loads the whole weights and optimizer state on any ranks and in any precision."""
    return wrote != layout and not (wrote.zero_stage == 0 and layout.zero_stage == 0)


def needs_universal(wrote: Layout, layout: Layout, streaming: bool, export_hint: str) -> bool:
    """Whether resuming a checkpoint that the layout `wrote` saved in this run's `layout` goes through a universal
    checkpoint; a ConfigError where neither way can load it."""
    if wrote == layout:
        return False
    change = wrote.changes_to(layout)
    if wrote.optimizer != layout.optimizer:
        raise ConfigError(f"--resume ({change}): the checkpoint holds {wrote.optimizer}'s optimizer states; resume "
                          f"with optimizer.name={wrote.optimizer}, or start a new run from its weights: {export_hint}")
    if wrote.lora != layout.lora:
        raise ConfigError(f"--resume ({change}): a LoRA checkpoint holds the adapters and their optimizer states, a "
                          f"full fine-tune's the whole model's; resume with lora.enabled={str(wrote.lora).lower()}, "
                          f"or start a new run from its exported weights")
    if layout.lora:
        raise ConfigError(f"--resume ({change}): a LoRA checkpoint resumes in the layout that wrote it (DeepSpeed's "
                          f"universal conversion is not proven here without the frozen base weights); resume with "
                          f"{wrote.world_size} rank(s) at ZeRO-{wrote.zero_stage} in {wrote.precision}")
    if streaming and wrote.world_size != layout.world_size:
        raise ConfigError(f"--resume ({change}): with data.streaming each rank reads its own share of the stream and "
                          f"the checkpoint holds each rank's position in it, so another number of ranks cannot "
                          f"continue it; resume with {wrote.world_size} rank(s), or prepare the data "
                          f"(data.streaming=false), whose position is the step for any number of ranks")
    if wrote.pipeline_stages > 1 or layout.pipeline_stages > 1:
        raise ConfigError(f"--resume ({change}): a pipeline checkpoint keeps each layer's weights in a file of its own "
                          f"and DeepSpeed's universal converter reads only Megatron's layer layout; resume in the "
                          f"layout that wrote it, or start a new run from its weights: {export_hint}")
    if wrote.expert_parallel > 1 and layout.expert_parallel == 1:
        raise ConfigError(f"--resume ({change}): an expert-parallel checkpoint keeps its experts' weights and "
                          f"optimizer states under AutoEP's names and in parameter groups of their own, which the "
                          f"universal load does not map to the original model's here; resume with expert parallelism "
                          f"(parallelism.expert_parallel={wrote.expert_parallel}, or another degree that divides the "
                          f"experts, at ZeRO-1 or 2), or start a new run from its weights: {export_hint}")
    if wrote.expert_parallel == 1 and layout.expert_parallel > 1:
        raise ConfigError(f"--resume ({change}): this checkpoint was written without expert parallelism, and an "
                          f"expert-parallel run keeps its experts under AutoEP's names and in parameter groups of "
                          f"their own, which the universal load does not map from the original model's here; resume "
                          f"with parallelism.expert_parallel=1, or start a new expert-parallel run from its weights: "
                          f"{export_hint}")
    if wrote.tensor_parallel > 1 or layout.tensor_parallel > 1:
        raise ConfigError(f"--resume ({change}): a tensor-parallel checkpoint holds each rank's slices of the "
                          f"matrices, which the universal conversion does not reassemble here; resume in the layout "
                          f"that wrote it, or start a new run from its weights: {export_hint}")
    if not through_universal(wrote, layout):
        return False
    if OPTIMIZERS[layout.optimizer].shaped:
        raise ConfigError(shaped_refusal(f"--resume ({change})", layout.optimizer, export_hint))
    if not OPTIMIZERS[layout.optimizer].universal:
        raise ConfigError(f"--resume ({change}): the universal conversion is proven here with AdamW's moments, not "
                          f"{layout.optimizer}'s states; resume in the layout that wrote the checkpoint, or start a "
                          f"new run from its weights: {export_hint}")
    if 0 in (wrote.zero_stage, layout.zero_stage):
        raise ConfigError(f"--resume ({change}): DeepSpeed's universal checkpoints connect ZeRO stages 1, 2 and 3; "
                          f"a ZeRO-0 optimizer state is neither written nor read by them. Resume at ZeRO-0 (on any "
                          f"number of ranks) or, to move to ZeRO, start a new run from its weights: {export_hint}")
    return True


def shaped_refusal(what: str, optimizer: str, export_hint: str) -> str:
    return (f"{what}: {optimizer} keeps its states for the part of each weight a rank holds, "
            f"{SHAPED_RULES[OPTIMIZERS[optimizer].state_rule]} "
            f"(training/loop/shaped_optimizer.py), which DeepSpeed's universal conversion (flat fp32 moments) cannot "
            f"join; resume in the layout that wrote the checkpoint, or start a new run from its weights: {export_hint}")


def universal_folder(checkpoint_dir: Path, tag: str) -> Path:
    return checkpoint_dir / UNIVERSAL / tag


def check_conversion_place(checkpoint_dir: Path, tag: str) -> None:
    """The conversion writes under checkpoints/universal/ (train.py's own cache): a symbolic link there, which it
    would write through, is refused before anything is written."""
    for name in (f"{UNIVERSAL}/{tag}", f"{UNIVERSAL}/.{tag}.partial"):
        if link := link_on_the_way(checkpoint_dir, name):
            raise ConfigError(f"{checkpoint_dir / link} is a symbolic link (to {os.readlink(checkpoint_dir / link)}) "
                              f"where the universal conversion of {tag} writes: nothing was written; remove the link "
                              f"(rm {checkpoint_dir / link}: what it points to stays)")


def convert(checkpoint_dir: Path, tag: str) -> Path:
    """checkpoints/<tag> as a universal checkpoint in checkpoints/universal/<tag>, made once; a cached conversion that
    is not whole (a file missing or cut short since) is made again."""
    check_conversion_place(checkpoint_dir, tag)
    target, source = universal_folder(checkpoint_dir, tag), checkpoint_dir / tag
    if target.is_dir():
        fault = conversion_fault(target)
        if fault is None:
            return target
        print(f"the cached universal conversion {target} is not whole ({fault}): converting {source} again",
              flush=True)
    export_hint = f"python -m training export {source} DIR, then model.name_or_path=DIR"
    if (source / pipeline_layer_file(0)).is_file():
        raise ConfigError(f"{source} is a pipeline checkpoint (a file per layer); DeepSpeed's universal converter "
                          f"reads only Megatron's layer layout. Resume in the layout that wrote it, or start a new run "
                          f"from its weights: {export_hint}")
    wrote = run_state_of(source)
    if wrote and OPTIMIZERS[wrote.optimizer].shaped:
        raise ConfigError(shaped_refusal(str(source), wrote.optimizer, export_hint))
    if not any(source.glob("*optim_states.pt")):
        raise ConfigError(f"{source} holds no ZeRO optimizer partitions (a ZeRO-0 checkpoint, or not DeepSpeed's); "
                          f"universal checkpoints connect ZeRO stages 1-3. A ZeRO-0 run resumes at ZeRO-0 on any "
                          f"number of ranks as it is; or start a new run from its weights: {export_hint}")
    staging = checkpoint_dir / UNIVERSAL / f".{tag}.partial"
    shutil.rmtree(staging, ignore_errors=True)  # left by a conversion of this tag that was killed
    workers = str(min(4, os.cpu_count() or 1))
    command = [sys.executable, "-m", "training.state.universal", str(tensor_parallel_of(source)), "--input_folder",
               str(source), "--output_folder", str(staging / tag), "--inject_missing_state",
               "--num_extract_workers", workers, "--num_merge_workers", workers]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the converter works on the CPU; it needs no GPU of this rank
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        shutil.rmtree(staging, ignore_errors=True)
        last_lines = "\n  ".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise ConfigError(f"DeepSpeed's universal converter could not convert {source} (its last lines:\n  "
                          f"{last_lines}\n); resume in the layout that wrote it, or start a new run from its weights: "
                          f"{export_hint}")
    make_stage_neutral(staging / tag)  # training/compat/deepspeed/universal.py
    files = {str(path.relative_to(staging / tag)): path.stat().st_size for path in (staging / tag).rglob("*")
             if path.is_file()}
    (staging / tag / MANIFEST).write_text(dumps(files, indent=1) + "\n")
    if target.is_dir():  # the conversion it replaces, set aside into the staging folder, goes with it
        os.replace(target, staging / "replaced")
    os.replace(staging / tag, target)
    shutil.rmtree(staging)
    return target


def conversion_fault(folder: Path) -> str | None:
    """What is wrong with a cached conversion: a file its manifest lists missing or of another size, or no manifest
    (made before conversions had one, or cut short); None when it is whole."""
    try:
        files = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no readable {MANIFEST}"
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return f"{name} {'is missing' if not path.is_file() else 'has another size than when it was written'}"
    return None


def convert_on_rank_0(checkpoint_dir: Path, tag: str) -> None:
    """Every rank calls it: rank 0 converts (once), the others wait for it, however long a large model's conversion
    takes (patient_barrier)."""
    if dist.get_rank() == 0:
        started = time.perf_counter()
        print(f"--resume in another layout: converting {checkpoint_dir / tag} into a universal checkpoint, "
              f"{convert(checkpoint_dir, tag)} ({time.perf_counter() - started:.1f} s)", flush=True)
    patient_barrier()


def run_state_of(tag_dir: Path) -> RunState | None:
    """The run state the checkpoint was written with; None for a checkpoint without a readable one."""
    try:
        return RunState.model_validate_json((tag_dir / "run_state.json").read_bytes())
    except (OSError, ValidationError):
        return None


def tensor_parallel_of(tag_dir: Path) -> int:
    """The tensor-parallel degree of the run that wrote the checkpoint (1 for a checkpoint without a run state)."""
    state = run_state_of(tag_dir)
    return state.tensor_parallel if state else 1


if __name__ == "__main__":  # the conversion's child process (convert)
    convert_with_tensor_parallel(int(sys.argv[1]), sys.argv[2:])

