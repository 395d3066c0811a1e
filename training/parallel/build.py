"""The run's model, assembled before deepspeed.initialize: a pipeline of stage modules, or the Hugging Face model
with the recipe's changes (long-context tiling or the fused head and loss, LoRA adapters, MoE leaf modules), then
sequence parallelism's attention, FP8's linear layers and the compiled decoder layers. Each change lives in the
module that owns it; this is their order."""
import torch
import torch.distributed as dist

from training.compat.deepspeed.universal import provide_universal_info
from training.config.precision import Precision
from training.models.compile import compile_layers, use_compile_cache
from training.models.fp8 import convert_linears_to_fp8, fp8_linear_count
from training.models.fused_loss import fuse_head_and_loss
from training.models.long_context import apply_long_context
from training.models.lora import with_lora
from training.models.model import build_model
from training.models.moe import mark_sparse_blocks
from training.parallel.pipeline import TokenMeanLoss, build_pipeline
from training.parallel.sequence_parallel import enable_sequence_parallel
from training.planning.kernels import uses_fused_loss
from training.planning.plan import RunPlan


def build_run_model(plan: RunPlan) -> tuple[torch.nn.Module, object | None, dict]:
    """The model to hand to deepspeed.initialize, the `mpu` of sequence parallelism's groups (None without), and
    the kernels it runs (for the summary: the attention, whether the loss is fused, the layers compiled and, under
    fp8, the linear layers that compute in FP8, counted on the model itself)."""
    recipe = plan.recipe
    fused_loss = uses_fused_loss(recipe, router_loss=getattr(plan.model_config, "output_router_logits", False))
    if plan.dims.pipeline_stages > 1:
        model = build_pipeline(plan.model_config, plan.dims.pipeline_stages, recipe.parallelism.partition_method,
                               recipe.activation_checkpointing, TokenMeanLoss(), recipe.model.name_or_path,
                               recipe.training.seed, recipe.model.attn_implementation)
    else:
        model = build_model(recipe, plan.model_config, plan.ds_config, plan.precision)
        provide_universal_info(model)
        apply_long_context(model, recipe.long_context)
        if fused_loss:
            fuse_head_and_loss(model)
        model = with_lora(model, recipe.lora, recipe.training.seed)
        mark_sparse_blocks(model)
    mpu = enable_sequence_parallel(model, plan.dims.sequence_parallel, recipe.training.micro_batch_size,
                                   recipe.data.seq_len)
    if plan.precision == Precision.FP8:
        convert_linears_to_fp8(model, recipe.fp8, plan.model_config.vocab_size)
    compile_cache_dir = use_compile_cache(recipe.compile_cache_dir)  # before the first compile (the first step)
    kernels = {"attention": recipe.model.attn_implementation, "fused_loss": fused_loss,
               "compiled_layers": compile_layers(model) if recipe.compile else 0,
               "compile_cache_dir": str(compile_cache_dir),
               **({"fp8_linear_layers": fp8_linear_count(model), "fp8_recipe": recipe.fp8.recipe}
                  if plan.precision == Precision.FP8 else {})}
    if dist.get_rank() == 0:
        print("kernels: " + describe_kernels(kernels))
    return model, mpu, kernels


def describe_kernels(kernels: dict) -> str:
    """One line: 'flex_attention, fused loss, 16 layers compiled, 112 linear layers in FP8 (tensorwise)'."""
    parts = [kernels["attention"], "fused loss" if kernels["fused_loss"] else "plain loss",
             f"{kernels['compiled_layers']} layers compiled" if kernels["compiled_layers"] else "eager"]
    if cache := kernels.get("compile_cache"):  # at the end of the run: what its compiles found in the cache
        graphs = cache["fx_graph_hits"] + cache["fx_graph_misses"]
        if graphs:
            parts.append(f"{cache['fx_graph_hits']} of {graphs} compiled graphs from the cache")
    if "fp8_linear_layers" in kernels:
        parts.append(f"{kernels['fp8_linear_layers']} linear layers in FP8 ({kernels['fp8_recipe']}), the rest bf16")
    return ", ".join(parts)
