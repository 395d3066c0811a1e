"""A saved checkpoint to a Hugging Face folder, with DeepSpeed's own readers; a LoRA checkpoint to peft's adapter
folder.

ZeRO checkpoints (stages 1-3, each rank's partition in its own file) go through DeepSpeed's
`zero_to_fp32`, which joins the fp32 master weights. Checkpoints without ZeRO partitions hold the
module's weights whole in `mp_rank_00_model_states.pt`: ZeRO-0, and bf16 at ZeRO-0/1, whose
BF16_Optimizer files `zero_to_fp32` refuses ("not a zero checkpoint"); there the module's bf16 weights
are exactly what was trained (the optimizer copies its fp32 master into them after every step).
Pipeline checkpoints hold each layer's module weights in a file of its own.
"""
import json
import pickle
from pathlib import Path

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from training.checkpoint import RUN_STATE, latest_tag, save_hf
from training.errors import ConfigError
from training.lora import export_adapters, is_lora_checkpoint
from training.output_guard import check_output, staged_folder
from training.pipeline import hf_name
from training.precision import DTYPES


def find_tag(path: Path) -> tuple[Path, str]:
    """(checkpoints folder, tag) for a `checkpoints/` folder (its `latest`) or one `global_stepN/` folder."""
    if tag := latest_tag(path):
        if not (path / tag).is_dir():
            raise ConfigError(f"{path / 'latest'} names {tag!r}, which is no checkpoint folder in {path}; export "
                              f"one checkpoint folder instead: python -m training export {path}/global_stepN OUT_DIR")
        return path, tag
    if (path / RUN_STATE).is_file():
        return path.parent, path.name
    raise ConfigError(f"{path} is neither a checkpoints folder with a `latest` file nor a checkpoint folder "
                      f"with {RUN_STATE} (e.g. outputs/<run>/checkpoints or outputs/<run>/checkpoints/global_step100)")


def has_zero_partitions(tag_dir: Path) -> bool:
    return any(not p.name.startswith("bf16_") for p in tag_dir.glob("*zero_pp_rank_*_optim_states.pt"))


def pipeline_weights(tag_dir: Path, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """A pipeline checkpoint keeps each layer's module weights in `layer_NN-model_states.pt`."""
    weights = {}
    for path in sorted(tag_dir.glob("layer_*-model_states.pt")):
        layer = int(path.name.removeprefix("layer_").split("-")[0])
        for name, tensor in torch.load(path, map_location="cpu", weights_only=False).items():
            weights[hf_name(layer, name, config)] = tensor
    return weights


def checkpoint_weights(checkpoint_dir: Path, tag: str, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    tag_dir = checkpoint_dir / tag
    if (tag_dir / "layer_00-model_states.pt").is_file():
        return pipeline_weights(tag_dir, config)
    if has_zero_partitions(tag_dir):
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    return torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]


def written_by_train_py(tag_dir: Path) -> dict:
    """The checkpoint's run state, once it is clear that train.py wrote the checkpoint: its run state names the
    precision, and its hf/ holds the model config and tokenizer that the export needs."""
    if not (tag_dir / RUN_STATE).is_file():
        raise ConfigError(f"{tag_dir} has no {RUN_STATE}: it was not written by train.py. For a DeepSpeed ZeRO "
                          f"checkpoint use DeepSpeed's converter, python {tag_dir.parent / 'zero_to_fp32.py'} "
                          f"{tag_dir.parent} OUT_DIR --safe_serialization, then copy the model's config.json and "
                          f"tokenizer files into OUT_DIR")
    try:
        run_state = json.loads((tag_dir / RUN_STATE).read_bytes())
        precision = run_state["precision"]
    except (ValueError, TypeError, KeyError):
        raise ConfigError(f"{tag_dir / RUN_STATE} is damaged (not JSON with a precision); export another "
                          f"checkpoint, or pass --dtype and repair the file") from None
    if not (tag_dir / "hf" / "config.json").is_file():
        raise ConfigError(f"{tag_dir / 'hf'} has no config.json: the export needs the model config and tokenizer "
                          f"that train.py saves there; copy the model's config.json and tokenizer files into it")
    return {**run_state, "precision": precision}


COMMAND = "python -m training export"


def export_checkpoint(path: Path, out_dir: Path, dtype: str | None = None, overwrite: bool = False) -> Path:
    """The export command: `out_dir` (config, safetensors, tokenizer) from a checkpoint; `dtype` defaults to the
    run's precision. `out_dir` may not hold the checkpoints or lie inside them; an existing one is replaced only with
    `overwrite`, only if an earlier export wrote it, and only once the new export is complete."""
    checkpoint_dir, tag = find_tag(path)
    check_output(out_dir, COMMAND, [checkpoint_dir], overwrite, option="OUT_DIR")
    written_by_train_py(checkpoint_dir / tag)
    with staged_folder(out_dir, COMMAND) as staging:
        export_tag(checkpoint_dir, tag, staging, dtype)
    return checkpoint_dir / tag


def export_tag(checkpoint_dir: Path, tag: str, out_dir: Path, dtype: str | None = None) -> None:
    """Write the checkpoint `tag`'s model (a LoRA checkpoint's adapters) into the folder `out_dir`."""
    tag_dir = checkpoint_dir / tag
    run_state = written_by_train_py(tag_dir)
    if dtype is None and run_state["precision"] not in DTYPES:
        raise ConfigError(f"{tag_dir / RUN_STATE} names precision {run_state['precision']!r}; pass --dtype")
    dtype = DTYPES[dtype or run_state["precision"]]
    config = AutoConfig.from_pretrained(tag_dir / "hf")
    try:
        weights = checkpoint_weights(checkpoint_dir, tag, config)
    except (RuntimeError, ValueError, EOFError, OSError, KeyError, pickle.UnpicklingError) as error:
        raise ConfigError(f"{tag_dir} cannot be read ({error}): a damaged or partial checkpoint; export another "
                          f"one") from None
    if is_lora_checkpoint(tag_dir):
        export_adapters(tag_dir, weights, AutoTokenizer.from_pretrained(tag_dir / "hf"), out_dir, dtype)
    else:
        save_full_model(tag_dir, config, weights, out_dir, dtype)


def save_full_model(tag_dir: Path, config: PretrainedConfig, weights: dict[str, torch.Tensor], out_dir: Path,
                    dtype: torch.dtype) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = model.state_dict().keys()
    missing = [name for name in expected if name not in weights and name not in model.all_tied_weights_keys]
    if missing:
        raise ConfigError(f"{tag_dir} lacks weights for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    state_dict = {name: weights[name].to(dtype) for name in expected if name in weights}
    save_hf(model, AutoTokenizer.from_pretrained(tag_dir / "hf"), out_dir, state_dict, dtype)
