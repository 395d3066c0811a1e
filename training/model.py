"""Build the Hugging Face model a recipe describes: from a config (pretraining) or a checkpoint (fine-tuning)."""
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations import HfDeepSpeedConfig

from training.ds_config import zero_stage
from training.errors import ConfigError
from training.precision import DTYPES
from training.recipe import ModelSection, Recipe


def load_model_config(section: ModelSection) -> PretrainedConfig:
    """The architecture alone (no weights): cheap enough to check a recipe against before any run."""
    source = section.config or section.name_or_path
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=section.trust_remote_code)
    except (OSError, ValueError) as error:
        raise ConfigError(f"model: cannot read a model config from {source}: {error}") from None
    unknown = [key for key in section.config_overrides if not hasattr(config, key)]
    if unknown:
        raise ConfigError(f"model.config_overrides: {', '.join(unknown)} not in {type(config).__name__} "
                          f"(from {source}); check the spelling against its config.json")
    config.update(section.config_overrides)
    config.use_cache = False  # no KV cache while training
    return config


def check_recipe_against_model(recipe: Recipe, config: PretrainedConfig, vocab_size: int) -> None:
    problems = []
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and recipe.data.seq_len > max_positions:
        problems.append(f"data.seq_len={recipe.data.seq_len} is longer than the model's max_position_embeddings="
                        f"{max_positions}; lower data.seq_len")
    if vocab_size > config.vocab_size:
        problems.append(f"the tokenizer ({recipe.tokenizer_path}) has {vocab_size} tokens but the model's "
                        f"vocab_size is {config.vocab_size}; use the model's own tokenizer")
    if problems:
        raise ConfigError(f"{recipe.path}:\n" + "\n".join(f"  {p}" for p in problems))


def load_tokenizer(name_or_path: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """The tokenizer, with a pad token: padded rows (bfd, none) and the exported folder need one. Without
    its own, EOS pads (padding is never a target, so the model is not taught to stop there)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ConfigError(f"tokenizer: cannot load a tokenizer from {name_or_path}: {error}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_checkpoint_folder(name_or_path: str) -> None:
    """A local checkpoint must exist and hold weights (a hub id is checked when it downloads)."""
    folder = Path(name_or_path)
    if folder.is_absolute() and not folder.is_dir():
        raise ConfigError(f"model.name_or_path: no folder {folder}; train or download the checkpoint first, or "
                          f"point model.name_or_path at a folder written by save_pretrained (or a hub id)")
    if folder.is_dir() and not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(f"model.name_or_path={folder} holds no weights (none of {', '.join(WEIGHT_FILES)}); "
                          f"point it at a folder written by save_pretrained, or use model.config to train from scratch")


def weights_dtype(precision: str, stage: int) -> torch.dtype:
    """Checkpoint weights load in the run's precision; DeepSpeed keeps the fp32 master copy in its optimizer.
    ZeRO-0 bf16/fp16 (torch autocast over fp32 weights) keeps fp32 weights."""
    return DTYPES[precision] if stage > 0 else torch.float32


def build_model(recipe: Recipe, config: PretrainedConfig, ds_config: dict, precision: str) -> PreTrainedModel:
    """The model, from `model.config` (random weights from the training seed, so that every rank and every
    ZeRO stage starts from the same weights) or from the checkpoint at `model.name_or_path`.

    A checkpoint under ZeRO-3 is loaded inside DeepSpeed's `zero.Init` (transformers does it while an
    `HfDeepSpeedConfig` is alive): every parameter is partitioned across the ranks as it is created and
    the weights are loaded one module at a time, so no rank ever holds the whole model. A model from
    `model.config` is built whole on every rank: under zero.Init transformers initializes the weights in
    another order, so ZeRO-3 would start from other random weights than the other stages."""
    torch.manual_seed(recipe.training.seed)
    options = {"config": config, "attn_implementation": recipe.model.attn_implementation,
               "trust_remote_code": recipe.model.trust_remote_code}
    if recipe.model.name_or_path:
        stage = zero_stage(ds_config)
        zero3 = HfDeepSpeedConfig(ds_config) if stage == 3 else None  # noqa: F841 (held by a weak reference)
        model = AutoModelForCausalLM.from_pretrained(recipe.model.name_or_path, dtype=weights_dtype(precision, stage),
                                                     **options)
    else:
        model = AutoModelForCausalLM.from_config(dtype=torch.float32, **options)
    if recipe.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
