"""Which kernels a run uses, decided from the recipe before anything is built: the plan counts their memory
(training/planning/activations.py) and the model is built with them (training/parallel/build.py). The fused loss itself:
training/models/fused_loss.py."""
from training.config.precision import Precision
from training.config.recipe import Recipe

CHUNK_TOKENS = 2048  # per chunk: [2048, vocab] logits, 1 GB in fp32 for 128k; few chunks to add up


def uses_fused_loss(recipe: Recipe, router_loss: bool) -> bool:
    """Whether the run's loss is the fused one: for the language-model objective, where train.py builds the model's
    loss itself. The pipeline's last stage has its own loss; tensor parallelism replaces the head with its split
    one; long_context.logits_tile_tokens tiles the head and loss its own way (recomputing in the backward pass);
    an objective whose loss is not the model's next-token loss reads the logits itself; an MoE model with a
    router_loss adds it in its own forward; and where another module replaces the head."""
    parallelism = recipe.parallelism
    return (recipe.fused_loss and recipe.training.spec.model_loss and parallelism.pipeline_stages == 1
            and parallelism.tensor_parallel == 1 and not recipe.long_context.logits_tile_tokens
            and not router_loss and not replaced_head(recipe))


def replaced_head(recipe: Recipe) -> bool:
    """Whether another module takes the head's place: FP8's Float8Linear (fp8.lm_head), or LoRA's modules_to_save
    (a trained copy of the head or the tied embedding). The fused loss computes with the head's own weight."""
    return (recipe.precision == Precision.FP8 and recipe.fp8.lm_head) or (recipe.lora.enabled and
                                                                  bool(recipe.lora.modules_to_save))
