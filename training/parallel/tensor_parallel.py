"""Tensor parallelism for Hugging Face models with DeepSpeed's AutoTP (`parallelism.tensor_parallel: N`).

Each group of N consecutive ranks holds one copy of the model with every attention and MLP matrix split N ways
(DeepSpeed shards the model inside deepspeed.initialize, from the model's own `base_model_tp_plan` or its
presets for Llama, Mistral, Qwen2, ...); the ranks of a group read the same rows and compute the same loss.
Data parallelism runs over the groups: data-parallel ranks = world size / N.

DeepSpeed 0.19.8 checks `train_batch_size` against the whole world before AutoTP makes its groups and, under
ZeRO-3, against the data-parallel ranks after: no value passes both, so the config leaves it out and DeepSpeed
derives it from the micro-batch and the accumulation steps, which train.py sets.
"""
from deepspeed import DeepSpeedEngine
from transformers import PretrainedConfig

from training.base.errors import ConfigError
from training.config.recipe import Recipe
from training.planning.shape import head_counts, rank_groups_problem


def check_tensor_parallel(recipe: Recipe, config: PretrainedConfig, world_size: int, zero_stage: int) -> None:
    """Whether the model's heads and the ranks split N ways in a layout built here: before anything is built."""
    size, problems = recipe.parallelism.tensor_parallel, []
    for count, what in zip(head_counts(config), ("attention heads", "key/value heads")):
        if count % size:
            problems.append(f"the model's {count} {what} do not divide into {size} groups: choose a "
                            f"parallelism.tensor_parallel that divides {count}")
    problems += rank_groups_problem(world_size, size, "tensor")
    if zero_stage == 0:
        problems.append("ZeRO-0: train.py computes ZeRO-0's gradient norm itself, over whole weights, and AutoTP's "
                        "are split; use deepspeed.config=zero1, zero2 or zero3")
    if recipe.long_context.tiled_mlp or recipe.long_context.logits_tile_tokens:
        problems.append("long_context tiling with tensor parallelism is not built: turn it off")
    if problems:
        raise ConfigError(f"parallelism.tensor_parallel={size}:\n" + "\n".join(f"  {p}" for p in problems))


def loss_copies(engine: DeepSpeedEngine) -> int:
    """How many ranks hold each loss whole: the ranks of a tensor-parallel group (1 without one), so that sums of
    the ranks' losses count each once."""
    return max(1, engine.autotp_size())  # DeepSpeed's autotp_size is 0 when AutoTP is off
