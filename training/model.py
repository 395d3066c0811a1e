"""Build the Hugging Face model a recipe describes, and the optimizer's parameter groups."""
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from training.errors import ConfigError
from training.recipe import ModelSection, Recipe


def load_model_config(section: ModelSection) -> PretrainedConfig:
    """The architecture alone (no weights): cheap enough to check a recipe against before any run."""
    source = section.config or section.name_or_path
    try:
        config = AutoConfig.from_pretrained(source)
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


def build_model(recipe: Recipe, config: PretrainedConfig) -> PreTrainedModel:
    """fp32 weights; DeepSpeed casts them to bf16/fp16 where the precision asks for it. The seed makes
    every rank, and every ZeRO stage, start from the same weights."""
    torch.manual_seed(recipe.training.seed)
    options = {"config": config, "attn_implementation": recipe.model.attn_implementation, "dtype": torch.float32}
    if recipe.model.name_or_path:
        model = AutoModelForCausalLM.from_pretrained(recipe.model.name_or_path, **options)
    else:
        model = AutoModelForCausalLM.from_config(**options)
    if recipe.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model

