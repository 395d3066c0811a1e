"""Checkpoint averaging (`python -m training average`): the element-wise mean of several checkpoints' fp32 weights,
written as a Hugging Face folder, as OLMo-core's model-merging callback averages the last steps before the decay
ends. Each checkpoint is read as `python -m training export` reads it (training/state/export.py: ZeRO 0-3 through
DeepSpeed's own readers, tensor-parallel slices joined, pipeline and expert-parallel files), so checkpoints of any
layout average together; each weight's mean is taken in float64 over the checkpoints' fp32 values and rounded to
fp32 once. The checkpoints must hold one model (the same config.json); a LoRA checkpoint's adapters are refused
(average the merged exports instead)."""
from pathlib import Path

import torch
from transformers import AutoConfig

from training.base.errors import ConfigError
from training.base.output_guard import check_output, staged_folder
from training.planning.precision import DTYPES
from training.state.checkpoint import RUN_STATE
from training.state.export import (
    checkpoint_weights,
    find_tag,
    is_lora_checkpoint,
    save_full_model,
    written_by_train_py,
)

COMMAND = "python -m training average"


def chosen_tags(paths: list[Path], last: int | None) -> list[Path]:
    """The checkpoint folders to average: each path a global_stepN/ folder, or with `last` the last `last` saved
    checkpoints of one run's checkpoints/ folder (by step)."""
    if last is None:
        return [Path(*find_tag(path)) for path in paths]
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
    states = [written_by_train_py(tag) for tag in tags]
    configs = [AutoConfig.from_pretrained(tag / "hf").to_diff_dict() for tag in tags]
    if any(config != configs[0] for config in configs):
        other = next(tag for tag, config in zip(tags, configs) if config != configs[0])
        raise ConfigError(f"{other} holds another model than {tags[0]} (their hf/config.json differ): average "
                          f"checkpoints of one run, or of runs of one model")
    if lora := next((tag for tag in tags if is_lora_checkpoint(tag)), None):
        raise ConfigError(f"{lora} holds LoRA adapters, not the model's weights: export each checkpoint merged, or "
                          f"average the adapters of one rank and alpha yourself")
    config = AutoConfig.from_pretrained(tags[-1] / "hf")
    mean = mean_weights([checkpoint_weights(tag.parent, tag.name, config, state) for tag, state in zip(tags, states)],
                        tags)
    dtype = DTYPES[dtype or states[-1]["precision"]]
    with staged_folder(out_dir, COMMAND) as staging:
        save_full_model(tags[-1], config, mean, staging, dtype)
    return tags


def mean_weights(weights: list[dict[str, torch.Tensor]], tags: list[Path]) -> dict[str, torch.Tensor]:
    """Each weight's element-wise mean over the checkpoints, summed in float64 from their fp32 values, rounded to
    fp32 once."""
    names = weights[0].keys()
    if differ := next((tag for tag, state in zip(tags, weights) if state.keys() != names), None):
        raise ConfigError(f"{differ} holds other weights than {tags[0]}: a damaged checkpoint, or another model")
    return {name: (sum(state[name].double() for state in weights) / len(weights)).float() for name in names}
