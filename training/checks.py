"""The checks that take the run's layout (ranks, pipeline stages, sequence and tensor parallelism), its ZeRO
stage, precision and optimizer together, before anything is built."""
from transformers import PretrainedConfig

from training.base.errors import ConfigError
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.loop.optimizer import check_optimizer
from training.models.lora import check_lora
from training.models.moe import check_moe
from training.objectives.base import objective_class
from training.parallel.expert_parallel import check_expert_parallel
from training.parallel.pipeline import check_pipeline
from training.parallel.sequence_parallel import check_sequence_parallel
from training.parallel.support import check_support
from training.parallel.tensor_parallel import check_tensor_parallel
from training.planning.ds_config import (
    check_nvme_offload,
    config_source,
    ds_config_file,
    load_ds_config,
    offloads,
    zero_setting,
    zero_stage,
)
from training.planning.layout import ParallelDims
from training.planning.precision import resolve_precision


def check_layout(recipe: Recipe, model_config: PretrainedConfig, raw_ds_config: dict, precision: Precision,
                 world_size: int, for_gpus: bool = False) -> None:
    """The checks of the ranks' layout, the ZeRO stage, the precision, the optimizer and the objective together:
    first what each feature runs with in each layout (training/parallel/support.py), every refusal at once."""
    check_support(recipe, model_config, ParallelDims.of(recipe.parallelism, world_size))
    stage, parallelism = zero_stage(raw_ds_config), recipe.parallelism
    objective_class(recipe.training.spec).check(recipe, model_config, world_size, stage)
    if precision == Precision.FP8 and stage == 0:
        raise ConfigError(f"precision=fp8 with ZeRO-0 ({ds_config_file(recipe.deepspeed.config).name}): ZeRO-0 runs "
                          f"mixed precision as torch autocast over fp32 weights, which this FP8 path does not "
                          f"support; use deepspeed.config=zero1, zero2 or zero3")
    if parallelism.sequence_parallel > 1:
        check_sequence_parallel(recipe, model_config, world_size, stage, precision)
    if parallelism.tensor_parallel > 1:
        check_tensor_parallel(recipe, model_config, world_size, stage)
    if parallelism.pipeline_stages > 1:
        check_pipeline(model_config, parallelism.pipeline_stages, stage, world_size)
    check_optimizer(recipe, model_config, zero_setting(raw_ds_config))
    check_moe(recipe, model_config)
    if parallelism.expert_parallel > 1:
        check_expert_parallel(recipe, model_config, world_size, stage, bool(offloads(raw_ds_config)))
    if recipe.lora.enabled:
        check_lora(recipe, model_config, precision, for_gpus)
    if not for_gpus:  # a plan for GPUs elsewhere cannot look at their drives
        check_nvme_offload(raw_ds_config, config_source(recipe))


def refusal(recipe: Recipe, model_config: PretrainedConfig, world_size: int, for_gpus: bool) -> str | None:
    """Why check_layout refuses the recipe (with its DeepSpeed config), or None."""
    try:
        raw_ds_config, _ = load_ds_config(recipe)
        check_layout(recipe, model_config, raw_ds_config, resolve_precision(recipe.precision, raw_ds_config, for_gpus),
                     world_size, for_gpus)
    except ConfigError as error:
        return str(error)
    return None
