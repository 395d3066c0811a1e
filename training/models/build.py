"""The run's model, assembled before deepspeed.initialize: a pipeline of stage modules, or the Hugging Face model
with the recipe's changes (long-context tiling, LoRA adapters, MoE leaf modules), then sequence parallelism's
attention and FP8's linear layers. Each change lives in the module that owns it; this is their order."""
import torch
import torch.distributed as dist

from training.models.fp8 import convert_linears_to_fp8
from training.models.long_context import apply_long_context
from training.models.lora import with_lora
from training.models.model import build_model
from training.models.moe import mark_sparse_blocks
from training.parallel.pipeline import TokenMeanLoss, build_pipeline
from training.parallel.sequence_parallel import enable_sequence_parallel
from training.planning.plan import RunPlan
from training.compat.deepspeed import provide_universal_info


def build_run_model(plan: RunPlan) -> tuple[torch.nn.Module, object | None]:
    """The model to hand to deepspeed.initialize, and the `mpu` of sequence parallelism's groups (None without)."""
    recipe = plan.recipe
    if plan.pipeline_stages > 1:
        model = build_pipeline(plan.model_config, plan.pipeline_stages, recipe.parallelism.partition_method,
                               recipe.activation_checkpointing, TokenMeanLoss(), recipe.model.name_or_path,
                               recipe.training.seed, recipe.model.attn_implementation)
    else:
        model = build_model(recipe, plan.model_config, plan.ds_config, plan.precision)
        provide_universal_info(model)
        apply_long_context(model, recipe.long_context)
        model = with_lora(model, recipe.lora, recipe.training.seed)
        mark_sparse_blocks(model)
    mpu = enable_sequence_parallel(model, plan.sequence_parallel, recipe.training.micro_batch_size, recipe.data.seq_len)
    if plan.precision == "fp8":
        converted = convert_linears_to_fp8(model, recipe.fp8, plan.model_config.vocab_size)
        if dist.get_rank() == 0:
            print(f"fp8 ({recipe.fp8.recipe} scaling): {len(converted)} linear layers; the rest stays bf16")
    return model, mpu
