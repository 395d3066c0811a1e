"""Universal checkpoints: what ds_to_universal needs in a checkpoint and writes, and what ZeRO-3's universal loader
and the engine's config do at a load (PATCHES, __init__.py)."""
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from deepspeed import DeepSpeedEngine
from deepspeed.checkpoint.constants import (
    FP32_WEIGHT_KEY,
    PARAM,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)


def provide_universal_info(model: torch.nn.Module) -> None:
    """The entry ds_to_universal needs in the checkpoint (with plain data parallelism its version is all there is)."""
    setattr(model, UNIVERSAL_CHECKPOINT_INFO, {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE})


def universal_weights(zero_dir: Path) -> dict[str, torch.Tensor]:
    """A universal checkpoint's fp32 master weights by parameter name: `zero/<name>/fp32.pt`, each a dict whose PARAM
    entry is the whole parameter (ds_to_universal writes them so; DeepSpeed's load_hp_checkpoint_state reads them)."""
    return {folder.name: torch.load(folder / f"{FP32_WEIGHT_KEY}.pt", map_location="cpu", weights_only=False)[PARAM]
            for folder in sorted(zero_dir.iterdir()) if (folder / f"{FP32_WEIGHT_KEY}.pt").is_file()}


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


@contextmanager
def universal_load_repaired(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Undo two things ZeRO-3's universal loader does to a torch optimizer with several parameter groups (found by
    comparing resumed runs with uninterrupted ones):
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
    """DeepSpeed reads `checkpoint.load_universal` from the engine's config object at every load_checkpoint
    (engine.load_universal_checkpoint()), and only there. It is set for each load: a resume in another layout loads
    the universal conversion, and a rewind later in that run loads either that conversion again or a checkpoint the
    run saved since, in its own layout."""
    config, before = engine._config, engine._config.load_universal_checkpoint
    config.load_universal_checkpoint = universal
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


def convert_with_tensor_parallel(tensor_parallel: int, arguments: list[str]) -> None:
    """DeepSpeed's converter (ds_to_universal.main) on a checkpoint whose model-state files record the right tensor-
    parallel degree. DeepSpeed records `parallel_dims.tp_degree` as the `mpu`'s model-parallel size, and for
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
