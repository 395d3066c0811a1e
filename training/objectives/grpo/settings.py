"""What the grpo section's settings make for the run and its plan: the loss's settings, adaptive entropy control,
the optimizer steps one generation serves and the completions per evaluation prompt."""
from dataclasses import fields

from training.config.recipe import Recipe
from training.objectives.grpo.loss import EntropyControl, LossSettings
from training.objectives.grpo.spec import GrpoSection


def loss_settings(section: GrpoSection) -> LossSettings:
    """The grpo section's loss settings: those of the same name (TRL's), and its `epsilon` as the lower bound, which
    epsilon_high defaults to; the engine mismatch's correction only where an engine other than the trainer samples
    (vllm)."""
    named = {field.name for field in fields(LossSettings)} & set(GrpoSection.model_fields) - {"epsilon_high"}
    settings = section.model_dump(include=named)
    settings["vllm_importance_sampling_correction"] &= section.engine == "vllm"
    return LossSettings(epsilon_low=section.epsilon, epsilon_high=section.epsilon_high or section.epsilon,
                        entropy_bonus=section.entropy_bonus, **settings)


def eval_generations(section: GrpoSection) -> int:
    """Completions per evaluation prompt: num_generations_eval, or num_generations."""
    return section.num_generations_eval or section.num_generations


def entropy_control(section: GrpoSection) -> EntropyControl:
    return EntropyControl(section.entropy_coef, section.entropy_target, section.entropy_coef_delta,
                          section.entropy_coef_min, section.entropy_coef_max)


def steps_per_generation(recipe: Recipe) -> int:
    """The optimizer steps one generation serves: grpo.generation_batch_size over the global batch (checked whole)."""
    return (recipe.grpo.generation_batch_size or recipe.training.global_batch_size) // recipe.training.global_batch_size
