"""DeepSpeed JSON configs: find, merge the recipe's overrides, resolve every "auto" from the recipe and the model.

"auto" means what it means to the Hugging Face Trainer: batch sizes, clipping and the optimizer's
hyper-parameters come from the recipe's `training` and `optimizer` sections, bucket sizes from the model's
hidden size, bf16/fp16 from the recipe's precision. The optimizer's type comes from the recipe's
`optimizer.name`: the shipped files say "AdamW", the Trainer's only choice, and train.py reads that, or "auto",
as the recipe's; another type that contradicts the recipe is an error. So do other concrete values in the JSON
that contradict the recipe, naming both files.
"""
import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from pydantic import ValidationError
from transformers import PretrainedConfig

from training.base.errors import ConfigError, read_text
from training.compat.deepspeed.initialize import without_train_batch_size
from training.config.families import family_of
from training.config.optimizers import OPTIMIZERS
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.config.sections import TrainingSection
from training.planning.precision import fp16_block

DS_CONFIGS_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
MISSING = object()


def deepspeed_optimizer_keys(recipe: Recipe, setting: str) -> dict[str, tuple[str, Any]]:
    """The ds_config keys the recipe's optimizer decides at the ZeRO `setting` ('2', '3_offload'), each with the
    recipe key it comes from: its record's (training/config/optimizers.py) type, the `training` settings it takes,
    its own settings and the keys it needs at ZeRO-3."""
    training, section = recipe.training, recipe.optimizer
    record = OPTIMIZERS[section.name]
    keys = {"optimizer.type": ("optimizer.name", record.deepspeed_type),
            "optimizer.params.lr": ("training.lr", training.lr),
            "optimizer.params.weight_decay": ("training.weight_decay", training.weight_decay)}
    if "betas" not in record.untaken_keys:
        keys["optimizer.params.betas"] = ("training.betas", list(training.betas))
    if "eps" not in record.untaken_keys:
        keys["optimizer.params.eps"] = ("training.eps", training.eps)
    for name, key in record.settings.items():
        keys[f"optimizer.params.{key}"] = (f"optimizer.{name}", getattr(section, name))
    if setting.startswith("3"):
        keys |= {key: (f"optimizer.name={section.name} at ZeRO-3", value) for key, value in record.zero3_keys.items()}
    if record.client:  # which ZeRO wraps as it wraps any torch optimizer
        keys["zero_allow_untested_optimizer"] = (f"optimizer.name={section.name}", True)
        if setting.endswith("_offload"):  # stepped on the CPU, in place of DeepSpeed's CPU optimizers
            keys["zero_force_ds_cpu_optimizer"] = (f"optimizer.name={section.name} with ZeRO-Offload", False)
    return keys


def available_ds_configs() -> list[str]:
    return sorted(p.stem for p in DS_CONFIGS_DIR.glob("*.json"))


def ds_config_file(name_or_path: str) -> Path:
    for candidate in (DS_CONFIGS_DIR / f"{name_or_path}.json", Path(name_or_path)):
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(f"deepspeed.config: no DeepSpeed config '{name_or_path}': neither {DS_CONFIGS_DIR}/"
                      f"{name_or_path}.json nor a file at that path. Available: {', '.join(available_ds_configs())}")


def deep_merge(base: dict, overrides: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_ds_config(recipe: Recipe) -> tuple[dict, Path]:
    """The JSON named by `deepspeed.config` with `deepspeed.overrides` merged in, and its path."""
    path = ds_config_file(recipe.deepspeed.config)
    try:
        config = json.loads(read_text(path))
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: a JSON {type(config).__name__}; a DeepSpeed config is a JSON object")
    merged = deep_merge(config, recipe.deepspeed.overrides)
    check_sections(merged, config_source(recipe))
    return merged, path


def config_source(recipe: Recipe) -> str:
    """How messages name the DeepSpeed config: its file, and the recipe's overrides when there are any."""
    path = ds_config_file(recipe.deepspeed.config)
    return f"{path} with deepspeed.overrides" if recipe.deepspeed.overrides else str(path)


# DeepSpeed keys that train.py sets from the recipe or the command line: given in a DeepSpeed config they would
# bypass the recipe's checks and the plan (DeepSpeed would build a layout nothing here expects).
SET_BY_TRAIN_PY = {
    "tensor_parallel": "parallelism.tensor_parallel",
    "sequence_parallel_size": "parallelism.sequence_parallel",
    "checkpoint.load_universal": "--resume (train.py loads a checkpoint of another layout through a universal one)",
    "expert_parallel": "parallelism.expert_parallel",
}
OFFLOAD_SECTIONS = ("offload_optimizer", "offload_param")


def check_sections(config: dict, source: str) -> None:
    """The sections train.py reads before DeepSpeed does, checked by DeepSpeed's own schemas where it has one
    ("auto" values are filled in later and skipped here)."""
    problems = [f"{name}: a JSON {type(config[name]).__name__}, not an object" for name in
                ("zero_optimization", "bf16", "fp16", "optimizer", "data_types", "torch_autocast")
                if name in config and not isinstance(config[name], dict)]
    problems += [f"{key}: train.py sets it from {owner}; remove it from the DeepSpeed config"
                 + ("" if owner.startswith(("nothing", "--")) else f" and set {owner} in the recipe")
                 for key, owner in SET_BY_TRAIN_PY.items() if get_key(config, key) is not MISSING]
    if not problems and not isinstance(config.get("optimizer", {}).get("params", {}), dict):
        problems.append("optimizer.params: not an object")
    if not problems:
        zero = {key: value for key, value in config.get("zero_optimization", {}).items() if value != "auto"}
        try:
            DeepSpeedZeroConfig(**zero)
        except ValidationError as error:
            problems += [f"zero_optimization.{'.'.join(map(str, e['loc']))}: {e['msg']} (found {e['input']!r})"
                         for e in error.errors()]
    if not problems:
        problems += [f"zero_optimization.{name}.device=nvme needs nvme_path: the folder on a local NVMe drive that "
                     f"DeepSpeed swaps to (e.g. \"nvme_path\": \"/local_nvme\"), or use \"device\": \"cpu\""
                     for name, offload in offloads(config).items() if offload.get("device") == "nvme"
                     and not offload.get("nvme_path")]
    if problems:
        raise ConfigError(f"the DeepSpeed config ({source}) cannot run:\n" + "\n".join(f"  {p}" for p in problems))


def offloads(config: dict) -> dict[str, dict]:
    """The zero_optimization offload sections that are set, by name."""
    zero = config.get("zero_optimization", {})
    return {name: zero[name] for name in OFFLOAD_SECTIONS if isinstance(zero.get(name), dict)}


def check_nvme_offload(config: dict, source: str) -> None:
    """NVMe offload on this machine: its folder exists and DeepSpeed's async I/O op can be built (it needs libaio)."""
    nvme = {name: offload["nvme_path"] for name, offload in offloads(config).items() if offload.get("device") == "nvme"}
    problems = [f"zero_optimization.{name}.nvme_path={path}: not a folder this user can write to; create it on a "
                f"local NVMe drive, or name one" for name, path in nvme.items()
                if not (Path(path).is_dir() and os.access(path, os.W_OK | os.X_OK))]
    if nvme and not get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=False):
        problems.append("NVMe offload needs DeepSpeed's async_io op, which cannot be built here: it needs libaio "
                        "(apt install libaio-dev); or offload to \"device\": \"cpu\"")
    if problems:
        raise ConfigError(f"the DeepSpeed config ({source}) cannot run:\n" + "\n".join(f"  {p}" for p in problems))


def zero_stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def zero_setting(ds_config: dict) -> str:
    """The ZeRO stage and whether the optimizer is offloaded, in training/planning/model_states.py's ZERO_SETTINGS'
    terms: '2', '3_offload'."""
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return f"{zero_stage(ds_config)}{'_offload' if offload not in ('none', None) else ''}"


def params_offloaded(ds_config: dict) -> bool:
    """Whether ZeRO-3 keeps the parameters' partitions in host memory (offload_param; zero3_offload.json does)."""
    offload = ds_config.get("zero_optimization", {}).get("offload_param", {}).get("device", "none")
    return zero_stage(ds_config) == 3 and offload not in ("none", None)


def accumulation_steps(training: TrainingSection, dp_size: int) -> int:
    """global = micro x accumulation x data-parallel ranks, with accumulation a whole number."""
    per_pass = training.micro_batch_size * dp_size
    if training.global_batch_size % per_pass:
        raise ConfigError(
            f"training.global_batch_size={training.global_batch_size} is not a multiple of "
            f"training.micro_batch_size ({training.micro_batch_size}) x data-parallel ranks ({dp_size}) = {per_pass}; "
            f"global = micro x accumulation x ranks, so choose a global batch size that {per_pass} divides")
    return training.global_batch_size // per_pass


def get_key(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return MISSING
        tree = tree[part]
    return tree


def set_key(tree: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def auto_keys(tree: Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict):
        return [k for key, value in tree.items() for k in auto_keys(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if tree == "auto" else []


def default_grad_accum_dtype(config: dict, stage: int) -> str:
    """fp32, except where a stage-0 config enables bf16/fp16 outright: DeepSpeed's half-precision path
    without ZeRO can only accumulate in that dtype, and that is what such a config asks for."""
    if stage == 0:
        for name in ("bf16", "fp16"):
            if get_key(config, f"{name}.enabled") is True:
                return name
    return "fp32"


def precision_sections(precision: Precision, stage: int, grad_accum_dtype: str) -> dict[str, Any]:
    """The DeepSpeed keys that realise the recipe's precision.

    DeepSpeed refuses fp32 gradient accumulation for bf16/fp16 weights without ZeRO ("unsupported
    mix of model_dtype and grad_accum_dtype"), and its stage-0 half-precision path accumulates and
    all-reduces gradients in 16 bits, which drifts from the ZeRO stages (DeepSpeed #1800). So at
    stage 0 mixed precision runs as DeepSpeed's torch_autocast: fp32 weights and gradients, matmuls
    in 16 bits. Memory per parameter is the same 16 bytes as DeepSpeed's bf16 path.
    """
    if precision == Precision.FP8:  # DeepSpeed's bf16 path; the linear layers' matmuls are FP8 (training/models/fp8.py)
        precision = Precision.BF16
    half = precision in (Precision.BF16, Precision.FP16)
    if half and stage == 0 and grad_accum_dtype == "fp32":
        dtype = "bfloat16" if precision == Precision.BF16 else "float16"
        return {"bf16.enabled": False, "fp16.enabled": False, "torch_autocast": {"enabled": True, "dtype": dtype}}
    return {"bf16.enabled": precision == Precision.BF16, "fp16.enabled": precision == Precision.FP16,
            "data_types.grad_accum_dtype": grad_accum_dtype}


def choose_adamw_kernel(config: dict) -> None:
    """AdamW's implementation, where the DeepSpeed config names none (`torch_adam`): torch's AdamW (DeepSpeed's
    FusedAdam is JIT-built with a CUDA toolkit and has no CPU form), fused into one kernel per step on CUDA (`fused`;
    on a CPU torch's multi-tensor foreach path). ZeRO-Offload steps on the CPU with DeepSpeed's CPU Adam, left as it
    is; a config's own torch_adam or fused is kept."""
    optimizer = config.get("optimizer", {})
    if optimizer.get("type") != "AdamW" or zero_setting(config).endswith("_offload"):
        return
    params = optimizer.setdefault("params", {})
    if params.setdefault("torch_adam", True):
        params.setdefault("fused", get_accelerator().device_name() == "cuda")


def resolve_ds_config(raw: dict, source: Path, recipe: Recipe, hidden_size: int, dp_size: int,
                      precision: Precision) -> dict:
    """A complete DeepSpeed config with no "auto" left, or a ConfigError listing every problem."""
    config = copy.deepcopy(raw)
    training = recipe.training
    problems = []
    if "scheduler" in config:
        problems.append(f"{source}: remove the 'scheduler' section; the schedule comes from the recipe's "
                        f"training.schedule ({recipe.path})")
    stage = zero_stage(config)
    if get_key(config, "optimizer.type") == "AdamW":  # the HF Trainer's type, in the shipped files: the recipe's
        set_key(config, "optimizer.type", "auto")
    for key in OPTIMIZERS[recipe.optimizer.name].untaken_keys:
        config.get("optimizer", {}).get("params", {}).pop(key, None)
    from_recipe = {
        "train_micro_batch_size_per_gpu": ("training.micro_batch_size", training.micro_batch_size),
        "gradient_accumulation_steps": ("training.global_batch_size / (micro_batch_size x ranks)",
                                        accumulation_steps(training, dp_size)),
        "train_batch_size": ("training.global_batch_size", training.global_batch_size),
        "gradient_clipping": ("training.grad_clip", training.grad_clip),
        **deepspeed_optimizer_keys(recipe, zero_setting(config)),
    }
    grad_accum_dtype = get_key(config, "data_types.grad_accum_dtype")
    if grad_accum_dtype is MISSING:
        grad_accum_dtype = default_grad_accum_dtype(config, stage)
    for key, value in precision_sections(precision, stage, grad_accum_dtype).items():
        from_recipe[key] = (f"precision={precision} (ZeRO stage {stage})", value)
    for key, (recipe_key, value) in from_recipe.items():
        current = get_key(config, key)
        if current is MISSING or current == "auto":
            set_key(config, key, value)
        elif current != value:
            problems.append(f"{key}={json.dumps(current)} in {source} contradicts {recipe_key}={json.dumps(value)} "
                            f"in {recipe.path}; make them equal or set the DeepSpeed value to \"auto\"")
    choose_adamw_kernel(config)
    model_sizes = {  # the HF Trainer's formulas
        "zero_optimization.reduce_bucket_size": hidden_size * hidden_size,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size,
    }
    for key, value in model_sizes.items():
        if get_key(config, key) == "auto":
            set_key(config, key, value)
    if precision == Precision.FP16:  # its loss-scaling keys are checked now, not when DeepSpeed starts (or never, at
        # ZeRO-0)
        try:
            fp16_block(config)
        except ConfigError as error:
            problems.append(f"{source}: {error}")
    unresolved = auto_keys(config)
    if unresolved:
        problems.append(f"{source}: train.py has no value for {', '.join(unresolved)}; replace \"auto\" with a value")
    if problems:
        raise ConfigError("the DeepSpeed config cannot run:\n" + "\n".join(f"  {p}" for p in problems))
    return config


def build_ds_config(raw: dict, source: Path, recipe: Recipe, model_config: PretrainedConfig, dp_size: int,
                    precision: Precision, universal: bool) -> dict:
    """The run's DeepSpeed config, whole: the file's resolved against the recipe (resolve_ds_config), with AutoTP,
    AutoEP and the universal-checkpoint load (a resume in another layout) that the layout adds. The one place it is
    made: the plan holds it, ds_config.json records it and deepspeed.initialize takes it."""
    parallelism = recipe.parallelism
    config = resolve_ds_config(raw, source, recipe, model_config.hidden_size, dp_size, precision)
    config = with_expert_parallel(with_tensor_parallel(config, parallelism.tensor_parallel),
                                  parallelism.expert_parallel, model_config)
    return with_universal_load(config) if universal else config


def with_tensor_parallel(ds_config: dict, size: int) -> dict:
    """The resolved DeepSpeed config with AutoTP on (size > 1) and train_batch_size left to DeepSpeed."""
    if size == 1:
        return ds_config
    return {**without_train_batch_size(ds_config), "tensor_parallel": {"autotp_size": size}}


def with_expert_parallel(ds_config: dict, size: int, config: PretrainedConfig) -> dict:
    """The resolved DeepSpeed config with AutoEP on (size > 1) for the model's preset. On CPU ranks the experts run
    one after another (torch's grouped matrix multiply is a CUDA kernel)."""
    if size == 1:
        return ds_config
    section = {"enabled": True, "autoep_size": size, "preset_model": family_of(config.model_type).autoep_preset}
    if not torch.cuda.is_available():
        section["use_grouped_mm"] = False
    return {**ds_config, "expert_parallel": section}


def with_universal_load(ds_config: dict) -> dict:
    """The DeepSpeed config of a run resumed from a universal checkpoint, as ds_config.json records it."""
    return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
