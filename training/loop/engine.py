"""The DeepSpeed engine of a run: deepspeed.initialize with the recipe's optimizer, parameter groups and schedule, then
what this repository changes in it (training/compat/)."""
from contextlib import nullcontext

import deepspeed
import torch
from deepspeed.runtime.pipe.engine import PipelineEngine

from training.compat.deepspeed.autoep import autoep_output_recorders
from training.compat.deepspeed.engine_step import use_fp16_block_loss_scaling
from training.loop.optimizer import client_optimizer, lr_schedule
from training.loop.shaped_optimizer import attach_shaped_optimizer
from training.parallel.pipeline import report_grad_norm
from training.planning.plan import RunPlan
from training.planning.precision import device_type, fp16_block
from training.planning.shape import weight_decay_groups


def start_engine(plan: RunPlan, model: torch.nn.Module, mpu: object | None,
                 total_steps: int) -> deepspeed.DeepSpeedEngine:
    training = plan.recipe.training
    with autoep_output_recorders() if plan.dims.expert_parallel > 1 else nullcontext():
        engine, *_ = deepspeed.initialize(model=model, config=plan.ds_config,
                                          optimizer=client_optimizer(plan.ds_config),
                                          model_parameters=weight_decay_groups(model, training.weight_decay),
                                          lr_scheduler=lr_schedule(training, total_steps), mpu=mpu)
    use_fp16_block_loss_scaling(engine, fp16_block(plan.ds_config), device_type())
    attach_shaped_optimizer(engine)
    if isinstance(engine, PipelineEngine) and not plan.zero_stage:
        report_grad_norm(engine, withhold_nonfinite=plan.recipe.stability.enabled)
    return engine
