"""The optimizer: AdamW, AdamW8bit, Adafactor, Lion or Muon built from the DeepSpeed config's optimizer section,
the checks before a run, and the learning-rate schedule (transformers' own schedules). An optimizer's record
(training/config/optimizers.py) names its builder and its check here.

AdamW8bit (torchao's: quantized moments, about 2 bytes per parameter) and Adafactor (torch's: factored second
moment, a row and a column per matrix) are the memory-lean ones; they step each parameter in its own shape under
ZeRO (training/loop/shaped_optimizer.py), and the plan counts their states share by share
(training/planning/optimizer_states.py).

Lion is lion-pytorch's, handed to DeepSpeed as the client optimizer (built from the config's section): DeepSpeed
0.19.8's own Lion kernels take sign(0) as +1 (CPU) or -1 (CUDA), so a weight whose update direction is exactly
zero, such as the embedding row of a token the batches never hold, still moves by the learning rate every step.

Muon orthogonalizes the update of the decoder layers' matrices (Newton-Schulz on the Nesterov momentum); the
embeddings, the LM head, norms and biases get AdamW, the standard split. DeepSpeed 0.19.8 draws that line by
parameter name (2-D and not named embed or lm_head, `deepspeed.set_optimizer_flags`); `check_muon` refuses a
model where the name rule would put anything else on Muon (GPT-2's `wte`, for one). Its ZeRO 1-3 path writes
the orthogonalized update where the gradient was before the norm is taken, so there the logged grad_norm is the
updates' norm and clipping is refused.
"""
from collections.abc import Callable
from functools import partial

import torch
from lion_pytorch import Lion
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.optimization import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
    get_wsd_schedule,
)

from training.base.errors import ConfigError
from training.base.loader import load
from training.compat.deepspeed.initialize import muon_flags
from training.config.optimizers import OPTIMIZERS
from training.config.recipe import Recipe
from training.config.sections import TrainingSection
from training.loop.shaped_optimizer import ShapedOptimizer
from training.planning.shape import decoder_layers


def check_optimizer(recipe: Recipe, config: PretrainedConfig, setting: str) -> None:
    """What the recipe's optimizer cannot run with at the ZeRO `setting` ('2', '3_offload'), before anything is
    built: its record's check."""
    check = OPTIMIZERS[recipe.optimizer.name].check
    if check:
        load(check)(recipe, config, setting)


def check_muon(recipe: Recipe, config: PretrainedConfig, setting: str) -> None:
    """Muon's record's check (module docstring): clipping under ZeRO, offload and the name rule, in one error."""
    problems = []
    if setting != "0" and recipe.training.grad_clip:
        problems.append(f"training.grad_clip={recipe.training.grad_clip} at ZeRO-{setting[0]}: DeepSpeed's ZeRO Muon "
                        f"measures the norm after orthogonalizing (the updates' norm, about 60 times the gradients' "
                        f"on tiny_llama) and would clip the updates by it; set training.grad_clip=0, or use "
                        f"deepspeed.config=zero0, where train.py clips the gradients")
    if setting.endswith("_offload"):
        problems.append("ZeRO-Offload: DeepSpeed's CPU optimizers are Adam, Adagrad and Lion; use "
                        "deepspeed.config=zero1, zero2 or zero3")
    stray = muon_name_rule_mismatch(config)
    if stray:
        problems.append(f"DeepSpeed picks Muon's parameters by name, which for this model ({config.model_type}) "
                        f"also takes {', '.join(stray[:3])}: not a decoder layer's matrix; use adamw or lion")
    if problems:
        raise ConfigError("optimizer.name=muon:\n" + "\n".join(f"  {p}" for p in problems))


def muon_name_rule_mismatch(config: PretrainedConfig) -> list[str]:
    """The parameters DeepSpeed's name rule puts on Muon that are not a decoder layer's matrix, or the reverse."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    matrices = {id(p) for p in decoder_layers(model).parameters() if p.ndim >= 2}
    on_muon = muon_flags(model)
    return [name for name, p in model.named_parameters() if on_muon[name] != (id(p) in matrices)]


def client_optimizer(ds_config: dict) -> Callable[[list], Optimizer] | None:
    """None: DeepSpeed builds the optimizer its config names; else what the builder of the record of that type
    makes of the config's optimizer params (a factory of the parameter groups)."""
    optimizer = ds_config["optimizer"]
    builder = next((record.builder for record in OPTIMIZERS.values() if record.deepspeed_type == optimizer["type"]),
                   None)
    return load(builder)(optimizer["params"]) if builder else None


def lion(params: dict) -> Callable[[list], Optimizer]:
    """lion-pytorch's Lion (module docstring)."""
    return partial(Lion, betas=tuple(params["betas"]), lr=params["lr"], weight_decay=params["weight_decay"])


def adamw8bit(params: dict) -> Callable[[list], Optimizer]:
    """torchao's AdamW8bit inside a ShapedOptimizer, which shows it each parameter in its own shape under ZeRO
    (training/loop/shaped_optimizer.py)."""
    return partial(ShapedOptimizer, build=partial(adamw8bit_groups, betas=tuple(params["betas"]), eps=params["eps"]),
                   lr=params["lr"], weight_decay=params["weight_decay"])


def adafactor(params: dict) -> Callable[[list], Optimizer]:
    """torch's Adafactor inside a ShapedOptimizer, as adamw8bit."""
    return partial(ShapedOptimizer, build=lambda groups: [torch.optim.Adafactor(groups)], lr=params["lr"],
                   weight_decay=params["weight_decay"])


def adamw8bit_groups(groups: list[dict], betas: tuple[float, float], eps: float) -> list[Optimizer]:
    """torchao's AdamW8bit, with torch's AdamW (fp32 moments) on the embeddings (training/loop/shaped_optimizer.py).
    torchao is imported here, as training/models/fp8.py does: its import takes about 2 s that other runs need not
    pay."""
    from torchao.optim import AdamW8bit

    chosen = [(library, [g for g in groups if g["embedding"] == embedding])
              for library, embedding in ((AdamW8bit, False), (torch.optim.AdamW, True))]
    return [library(chosen_groups, betas=betas, eps=eps) for library, chosen_groups in chosen if chosen_groups]


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
                       num_decay_steps=training.decay_steps(total_steps),
                       min_lr_ratio=training.min_lr_ratio)
    return partial(get_constant_schedule_with_warmup, num_warmup_steps=warmup)
