"""Resume on other hardware: a checkpoint written under another world size, ZeRO stage or precision is
converted once into a DeepSpeed universal checkpoint, which DeepSpeed loads into any ZeRO-1/2/3 layout.

The conversion is DeepSpeed's own, `deepspeed/checkpoint/ds_to_universal.py`, run as a child process: it
joins every rank's shard of each parameter's fp32 master weights and optimizer states (AdamW's moments
and step) into one file per parameter and state, `checkpoints/universal/<tag>/zero/<name>/`. Rank 0
writes it into a staging folder, lists its files and sizes in a manifest and renames it into place, so a
conversion a kill interrupts is never mistaken for a finished one; a finished one is reused while its manifest
holds, and made again when a file has gone missing or changed size since. DeepSpeed loads it with its config's
`checkpoint.load_universal` on (loading_universal); our run state (step, tokens seen, data position, RNG) is
read from the original checkpoint folder. The folder checkpoints/universal/ is train.py's own cache.

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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from deepspeed.checkpoint.constants import (PARAM, UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                            UNIVERSAL_CHECKPOINT_VERSION_VALUE)
from pydantic import ValidationError

from training.parallel.distributed import host_group
from training.config.errors import ConfigError
from training.parallel.layout import Layout
from training.state.run_state import RunState

UNIVERSAL = "universal"  # the folder under checkpoints/ that holds converted checkpoints, one per tag
MANIFEST = ".manifest.json"  # in each converted folder: its files and sizes, written last


def provide_universal_info(model: torch.nn.Module) -> None:
    """DeepSpeed writes this attribute of the model into every checkpoint; the converter requires it."""
    setattr(model, UNIVERSAL_CHECKPOINT_INFO, {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE})


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
        raise ConfigError(f"--resume ({change}): a LoRA checkpoint holds the adapters and their optimizer states, a full "
                          f"fine-tune's the whole model's; resume with lora.enabled={str(wrote.lora).lower()}, or "
                          f"start a new run from its exported weights")
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
    if wrote.tensor_parallel > 1 or layout.tensor_parallel > 1:
        raise ConfigError(f"--resume ({change}): a tensor-parallel checkpoint holds each rank's slices of the "
                          f"matrices, which the universal conversion does not reassemble here; resume in the layout "
                          f"that wrote it, or start a new run from its weights: {export_hint}")
    if not through_universal(wrote, layout):
        return False
    if layout.optimizer != "adamw":
        raise ConfigError(f"--resume ({change}): the universal conversion is proven here with AdamW's moments, not "
                          f"{layout.optimizer}'s states; resume in the layout that wrote the checkpoint, or start a "
                          f"new run from its weights: {export_hint}")
    if 0 in (wrote.zero_stage, layout.zero_stage):
        raise ConfigError(f"--resume ({change}): DeepSpeed's universal checkpoints connect ZeRO stages 1, 2 and 3; a "
                          f"ZeRO-0 optimizer state is neither written nor read by them. Resume at ZeRO-0 (on any number "
                          f"of ranks) or, to move to ZeRO, start a new run from its weights: {export_hint}")
    return True


def universal_folder(checkpoint_dir: Path, tag: str) -> Path:
    return checkpoint_dir / UNIVERSAL / tag


def convert(checkpoint_dir: Path, tag: str) -> Path:
    """checkpoints/<tag> as a universal checkpoint in checkpoints/universal/<tag>, made once; a cached conversion that
    is not whole (a file missing or cut short since) is made again."""
    target, source = universal_folder(checkpoint_dir, tag), checkpoint_dir / tag
    if target.is_dir():
        fault = conversion_fault(target)
        if fault is None:
            return target
        print(f"the cached universal conversion {target} is not whole ({fault}): converting {source} again",
              flush=True)
    export_hint = f"python -m training export {source} DIR, then model.name_or_path=DIR"
    if (source / "layer_00-model_states.pt").is_file():
        raise ConfigError(f"{source} is a pipeline checkpoint (a file per layer); DeepSpeed's universal converter reads "
                          f"only Megatron's layer layout. Resume in the layout that wrote it, or start a new run from "
                          f"its weights: {export_hint}")
    if not any(source.glob("*optim_states.pt")):
        raise ConfigError(f"{source} holds no ZeRO optimizer partitions (a ZeRO-0 checkpoint, or not DeepSpeed's); "
                          f"universal checkpoints connect ZeRO stages 1-3. A ZeRO-0 run resumes at ZeRO-0 on any number "
                          f"of ranks as it is; or start a new run from its weights: {export_hint}")
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
    make_stage_neutral(staging / tag)
    files = {str(path.relative_to(staging / tag)): path.stat().st_size for path in (staging / tag).rglob("*")
             if path.is_file()}
    (staging / tag / MANIFEST).write_text(json.dumps(files, indent=1) + "\n")
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


def make_stage_neutral(folder: Path) -> None:
    """DeepSpeed's converter writes the folder's two common files as the ZeRO stage that wrote the checkpoint
    reads them, and stage 3 reads them otherwise than stages 1 and 2 (and the bf16 optimizer of stage 1):
    - the engine's state (step counters, learning-rate schedule) is `mp_rank_00_model_states.pt` to stages
      1/2 and `zero_pp_rank_0_mp_rank_00_model_states.pt` to stage 3: both names are given the one file;
    - each parameter's states are files of {"param": tensor} in the parameter's shape to stages 1/2, which
      stage 3 also reads (it writes bare flat tensors): stage 3's are wrapped and shaped;
    - the optimizer's step is a `step.pt` per parameter to stages 1/2, and a torch optimizer state dict in
      `zero/optimizer_state.pt` (`optimizer_state_dict`) to stage 3, which stages 1/2 check for DeepSpeed's
      version and the clipping value: each is added where missing, with the values the folder holds."""
    engine_states = sorted(folder.glob("*mp_rank_00_model_states.pt"))
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if not (folder / name).exists():
            shutil.copyfile(engine_states[0], folder / name)
    path = folder / "zero" / "optimizer_state.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)
    engine_state = torch.load(engine_states[0], map_location="cpu", weights_only=False)
    parameters = [item for item in path.parent.iterdir() if item.is_dir()]
    if "optimizer_state_dict" in state:  # converted from stage 3: flat bare tensors, and the step in the states
        step = state["optimizer_state_dict"]["state"][0]["step"]
        shapes = {name: shape for group in engine_state["param_shapes"] for name, shape in group.items()}
        for parameter in parameters:
            for file in parameter.glob("*.pt"):
                tensor = torch.load(file, map_location="cpu", weights_only=False)
                if torch.is_tensor(tensor):
                    torch.save({PARAM: tensor.view(shapes[parameter.name])}, file)
            torch.save(step.clone(), parameter / "step.pt")
    else:
        step = torch.load(parameters[0] / "step.pt", map_location="cpu", weights_only=False)
        state["optimizer_state_dict"] = {"state": {i: {"step": step} for i in range(len(state["param_groups"]))},
                                         "param_groups": state["param_groups"]}
    state.setdefault("ds_version", engine_state["ds_version"])
    state.setdefault("clip_grad", engine_state["ds_config"].get("gradient_clipping", 0.0))
    torch.save(state, path)


def convert_on_rank_0(checkpoint_dir: Path, tag: str) -> None:
    """Every rank calls it: rank 0 converts (once), the others wait for it. The wait is a barrier on the host
    group, which a conversion of a large model's states may keep waiting for minutes."""
    if dist.get_rank() == 0:
        started = time.perf_counter()
        print(f"--resume in another layout: converting {checkpoint_dir / tag} into a universal checkpoint, "
              f"{convert(checkpoint_dir, tag)} ({time.perf_counter() - started:.1f} s)", flush=True)
    dist.barrier(group=host_group())


@contextmanager
def universal_load_repaired(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Undo two things DeepSpeed 0.19.8's ZeRO-3 universal loader does to a torch optimizer with several
    parameter groups (found by comparing resumed runs with uninterrupted ones):
    - every group gets the first group's settings, so the group without weight decay would decay: each
      group's own settings, which come from this run's recipe, are put back (the learning rate stays as
      loaded: it is the schedule's, at the step);
    - every state gets the same `step` tensor, which AdamW then advances once per group and step, skewing
      the bias correction: each state gets its own copy."""
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's optimizers wrap a torch one
    settings = [{key: value for key, value in group.items() if key not in ("params", "lr")}
                for group in inner.param_groups]
    yield
    for group, kept in zip(inner.param_groups, settings):
        group.update(kept)
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


@contextmanager
def loading_universal(engine: DeepSpeedEngine, universal: bool) -> Iterator[None]:
    """DeepSpeed 0.19.8 reads `checkpoint.load_universal` from the engine's config object at every load_checkpoint
    (engine.load_universal_checkpoint()), and only there. It is set for each load: a resume in another layout loads
    the universal conversion, and a rewind later in that run loads either that conversion again or a checkpoint the
    run saved since, in its own layout."""
    config, before = engine._config, engine._config.load_universal_checkpoint
    config.load_universal_checkpoint = universal
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


def with_universal_load(ds_config: dict) -> dict:
    """The DeepSpeed config of a run resumed from a universal checkpoint, as ds_config.json records it."""
    return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}


def tensor_parallel_of(tag_dir: Path) -> int:
    """The tensor-parallel degree of the run that wrote the checkpoint (its run state; 1 for a checkpoint without)."""
    try:
        return RunState.model_validate_json((tag_dir / "run_state.json").read_bytes()).tensor_parallel
    except (OSError, ValidationError):
        return 1


def run_converter(tensor_parallel: int, arguments: list[str]) -> None:
    """DeepSpeed's converter (ds_to_universal.main) on a checkpoint whose model-state files record the right tensor-
    parallel degree. DeepSpeed 0.19.8 records `parallel_dims.tp_degree` as the `mpu`'s model-parallel size, and for
    sequence parallelism the mpu is Ulysses', whose model-parallel size is the sequence-parallel size: the converter
    then looks for that many tensor-parallel slices of weights that sequence parallelism never splits (its files are
    plain data-parallel ZeRO partitions). The degree the converter reads is set to the run's own tensor parallelism."""
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.checkpoint.constants import CHECKPOINT_TP_DEGREE
    from deepspeed.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint
    recorded = DeepSpeedCheckpoint._lightweight_parallel_dimensions

    def run_dimensions(model_state: dict):
        dimensions = recorded(model_state)
        return {**dimensions, CHECKPOINT_TP_DEGREE: tensor_parallel} if isinstance(dimensions, dict) else dimensions

    DeepSpeedCheckpoint._lightweight_parallel_dimensions = staticmethod(run_dimensions)
    sys.argv = ["ds_to_universal", *arguments]
    ds_to_universal.main(ds_to_universal.parse_arguments())


if __name__ == "__main__":  # the conversion's child process (convert)
    run_converter(int(sys.argv[1]), sys.argv[2:])

