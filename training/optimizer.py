"""AdamW parameter groups and the learning-rate schedule (transformers' own schedules)."""
from collections.abc import Callable
from functools import partial

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from transformers.optimization import (get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup,
                                       get_linear_schedule_with_warmup, get_wsd_schedule)

from training.recipe import TrainingSection


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay on matrices; none on biases, norm weights (1-D) and embeddings (tied ones included)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or id(param) in embeddings else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_schedule(training: TrainingSection, total_steps: int) -> Callable[[Optimizer], LambdaLR]:
    """A factory that deepspeed.initialize calls with the optimizer it builds from the ds_config."""
    warmup = training.warmup_steps
    if training.schedule == "cosine":
        return partial(get_cosine_with_min_lr_schedule_with_warmup, num_warmup_steps=warmup,
                       num_training_steps=total_steps, min_lr_rate=training.min_lr_ratio)
    if training.schedule == "linear":
        return partial(get_linear_schedule_with_warmup, num_warmup_steps=warmup, num_training_steps=total_steps)
    if training.schedule == "wsd":
        return partial(get_wsd_schedule, num_warmup_steps=warmup, num_training_steps=total_steps,
                       num_decay_steps=max(1, round(training.decay_ratio * total_steps)),
                       min_lr_ratio=training.min_lr_ratio)
    return partial(get_constant_schedule_with_warmup, num_warmup_steps=warmup)
