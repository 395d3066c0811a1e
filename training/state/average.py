"""Checkpoint averaging (`python -m training average`): the element-wise mean of several checkpoints' fp32 weights,
written as a Hugging Face folder, as OLMo-core's model-merging callback averages the last steps before the decay
ends. Each checkpoint is read as `python -m training export` reads it (training/state/export.py: ZeRO 0-3 through
DeepSpeed's own readers, tensor-parallel slices joined, pipeline and expert-parallel files), so checkpoints of any
layout average together; each weight's mean is taken in float64 over the checkpoints' fp32 values and rounded to
fp32 once, one checkpoint read at a time. A universal checkpoint (checkpoints/universal/global_stepN, which a resume
in another layout or `python -m training convert` makes) is read from its fp32 files, with the model config and
tokenizer of the train.py checkpoint it was converted from. The checkpoints must hold one model (the same
config.json); a LoRA checkpoint's adapters are refused (average the merged exports instead). A run averages its own
last checkpoints into hf_average/ with checkpointing.average_last."""
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, PretrainedConfig

from training.base.errors import ConfigError
from training.base.output_guard import check_output, staged_folder
from training.compat.deepspeed.universal import universal_weights
from training.parallel.distributed import patient_barrier
from training.planning.plan import RunPlan
from training.planning.precision import DTYPES
from training.state.checkpoint import RUN_STATE
from training.state.export import (
    checkpoint_weights,
    find_tag,
    is_lora_checkpoint,
    save_full_model,
    written_by_train_py,
)
from training.state.universal import UNIVERSAL

COMMAND = "python -m training average"


def is_universal(path: Path) -> bool:
    return (path / "zero").is_dir() and path.parent.name == UNIVERSAL


def written_from(tag: Path) -> Path:
    """The train.py checkpoint folder whose run state, model config and tokenizer a checkpoint goes with: a universal
    one's is the checkpoint it was converted from (checkpoints/global_stepN beside checkpoints/universal/)."""
    if not is_universal(tag):
        return tag
    original = tag.parent.parent / tag.name
    if not (original / RUN_STATE).is_file():
        raise ConfigError(f"{tag} is a universal checkpoint, which holds no model config or tokenizer, and "
                          f"{original}, the checkpoint it was converted from, is gone: average that checkpoint's "
                          f"export instead, or a universal checkpoint whose original train.py checkpoint is kept")
    return original


def chosen_tags(paths: list[Path], last: int | None) -> list[Path]:
    """The checkpoint folders to average: each path a global_stepN/ folder (or its universal conversion), or with
    `last` the last `last` saved checkpoints of one run's checkpoints/ folder (by step)."""
    if last is None:
        return [path if is_universal(path) else Path(*find_tag(path)) for path in paths]
    if len(paths) != 1:
        raise ConfigError(f"--last {last} takes one run's checkpoints/ folder, not {len(paths)} paths")
    steps = sorted((int(tag.name.removeprefix("global_step")), tag) for tag in paths[0].glob("global_step*")
                   if tag.name.removeprefix("global_step").isdigit() and (tag / RUN_STATE).is_file())
    if len(steps) < last:
        raise ConfigError(f"{paths[0]} holds {len(steps)} complete checkpoints, fewer than --last {last}")
    return [tag for _, tag in steps[-last:]]


def average_checkpoints(paths: list[Path], out_dir: Path, last: int | None = None, dtype: str | None = None,
                        overwrite: bool = False) -> list[Path]:
    """The average command: `out_dir` (config, safetensors, tokenizer) from the mean of the chosen checkpoints'
    weights, in `dtype` (default: the last checkpoint's precision); returns the checkpoints averaged. `out_dir`
    may not hold a checkpoint or lie inside one; an existing one is replaced only with `overwrite`, only if an
    earlier average wrote it, once the new one is complete."""
    tags = chosen_tags(paths, last)
    if len(tags) < 2:
        raise ConfigError(f"{COMMAND} takes two or more checkpoints; to write one, use python -m training export")
    check_output(out_dir, COMMAND, [tag.parent for tag in tags], overwrite, option="OUT_DIR")
    run_states = check_averageable(tags)
    with staged_folder(out_dir, COMMAND) as staging:
        write_average(tags, run_states, staging, dtype)
    return tags


def check_averageable(tags: list[Path]) -> list[dict]:
    """Checkpoints train.py wrote, of one model, holding its weights (not LoRA adapters); their run states (a
    universal checkpoint's: of the checkpoint it was converted from)."""
    sources = [written_from(tag) for tag in tags]
    run_states = [written_by_train_py(tag) for tag in sources]
    configs = [AutoConfig.from_pretrained(tag / "hf").to_diff_dict() for tag in sources]
    if any(config != configs[0] for config in configs):
        other = next(tag for tag, config in zip(tags, configs) if config != configs[0])
        raise ConfigError(f"{other} holds another model than {tags[0]} (their hf/config.json differ): average "
                          f"checkpoints of one run, or of runs of one model")
    if lora := next((tag for tag in sources if is_lora_checkpoint(tag)), None):
        raise ConfigError(f"{lora} holds LoRA adapters, not the model's weights: export each checkpoint merged, or "
                          f"average the adapters of one rank and alpha yourself")
    return run_states


def write_average(tags: list[Path], run_states: list[dict], out_dir: Path, dtype: str | None = None) -> None:
    """out_dir (config, safetensors, tokenizer) from the mean of the checkpoints' weights, in `dtype` (default: the
    last checkpoint's precision); `run_states`: check_averageable's."""
    last = written_from(tags[-1])
    config = AutoConfig.from_pretrained(last / "hf")
    state_of = dict(zip(tags, run_states))
    mean = mean_weights(tags, lambda tag: tag_weights(tag, config, state_of[tag]))
    save_full_model(last, config, mean, out_dir, DTYPES[dtype or run_states[-1]["precision"]])


def tag_weights(tag: Path, config: PretrainedConfig, run_state: dict) -> dict[str, torch.Tensor]:
    if is_universal(tag):
        return universal_weights(tag / "zero")
    return checkpoint_weights(tag.parent, tag.name, config, run_state)


def mean_weights(tags: list[Path], read: Callable[[Path], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each weight's element-wise mean over the checkpoints, summed in float64 from their fp32 values (one checkpoint
    held at a time), rounded to fp32 once."""
    total = {name: tensor.double() for name, tensor in read(tags[0]).items()}
    for tag in tags[1:]:
        weights = read(tag)
        if weights.keys() != total.keys():
            raise ConfigError(f"{tag} holds other weights than {tags[0]}: a damaged checkpoint, or another model")
        for name, tensor in weights.items():
            total[name] += tensor.double()
    return {name: (tensor / len(tags)).float() for name, tensor in total.items()}


def average_run(plan: RunPlan) -> None:
    """checkpointing.average_last: the finished run's hf_average/, the mean of its last K checkpoints' weights in its
    precision, written by rank 0 into a staging folder and renamed into place; every rank calls."""
    if not plan.recipe.checkpointing.average_last:
        return
    if dist.get_rank() == 0:
        tags = chosen_tags([plan.output_dir / "checkpoints"], plan.recipe.checkpointing.average_last)
        run_states = check_averageable(tags)
        staging = Path(tempfile.mkdtemp(prefix=".hf_average.partial-", dir=plan.output_dir))
        write_average(tags, run_states, staging, plan.precision)
        staging.rename(plan.output_dir / "hf_average")
        print(f"hf_average/: the mean of the weights of {', '.join(tag.name for tag in tags)}", flush=True)
    patient_barrier()
