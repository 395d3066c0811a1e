"""The engine's optimizer step where DeepSpeed leaves it to torch: fp16's loss scaling at ZeRO-0 (torch autocast), the
gradient norm it does not report without ZeRO, a step withheld, and the pipeline engine's step (PATCHES,
__init__.py)."""
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.precision_config import DeepSpeedFP16Config

from training.compat.torch import found_inf


class FP16BlockGradScaler(torch.amp.GradScaler):
    """fp16 at ZeRO-0 (torch autocast) with the loss scaling that the DeepSpeed config's `fp16` block asks for.

    There DeepSpeed makes a default GradScaler (scale 2^16, doubled after 2,000 clean steps, halved at every
    overflow) whatever the block says, and its checkpoints leave the scale out. This one keeps torch's
    mechanics (scale the loss, unscale, skip a step whose gradients hold inf/nan) and takes each new scale from
    DeepSpeed's own loss scaler built from the block: `initial_scale_power`, `loss_scale_window`,
    `hysteresis`, `consecutive_hysteresis`, `min_loss_scale`, or a static `loss_scale`. Its state_dict
    includes that scaler's state, which train.py's checkpoints save and restore."""

    POLICY_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

    def __init__(self, block: DeepSpeedFP16Config, device: str):
        self.policy = CreateLossScaler(torch.float16, block.loss_scale, block.loss_scale == 0,
                                       block.dynamic_loss_scale_args())
        super().__init__(device, init_scale=float(self.policy.cur_scale))
        self.overflow = False

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        result = super().step(optimizer, *args, **kwargs)
        self.overflow = found_inf(self, optimizer)
        return result

    def update(self, new_scale: float | None = None) -> None:
        self.policy.update_scale(self.overflow)
        super().update(new_scale=float(self.policy.cur_scale))

    def state_dict(self) -> dict:
        policy = {key: getattr(self.policy, key) for key in self.POLICY_STATE if hasattr(self.policy, key)}
        return {**super().state_dict(), "deepspeed_loss_scaler": policy}

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        for key, value in state.pop("deepspeed_loss_scaler").items():
            setattr(self.policy, key, value)
        super().load_state_dict(state)


def z0_grad_scaler(engine: DeepSpeedEngine) -> torch.amp.GradScaler | None:
    """fp16's grad scaler at ZeRO-0 (torch autocast); None otherwise."""
    return engine.torch_autocast_z0_gradscaler


def use_fp16_block_loss_scaling(engine: DeepSpeedEngine, block: DeepSpeedFP16Config, device: str) -> None:
    """At ZeRO-0 with fp16, replace DeepSpeed's default GradScaler with one that follows the config's fp16 block."""
    if engine.torch_autocast_z0_gradscaler is not None:
        engine.torch_autocast_z0_gradscaler = FP16BlockGradScaler(block, device)


def loss_scale(engine: DeepSpeedEngine) -> float | None:
    """fp16's current loss scale (logged: a scale that keeps falling means overflowing gradients); None otherwise."""
    if engine.torch_autocast_z0_gradscaler is not None:
        return engine.torch_autocast_z0_gradscaler.get_scale()
    return float(engine.optimizer.loss_scale) if engine.fp16_enabled() else None


def zero0_grad_norm(engine: DeepSpeedEngine, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The gradient norm that DeepSpeed does not report without ZeRO: over this rank's gradients (a pipeline's tied
    copies once), summed in squares over the ranks of `group` (a pipeline's stages), and unscaled by fp16's
    ZeRO-0 loss scale, since the gradients are still scaled when the engine steps."""
    grads = [p.grad.float() for p in engine.module.parameters()  # float(): a no-op for fp32 gradients
             if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=engine.device)
    if group is not None:
        squares = norm.square()
        dist.all_reduce(squares, group=group)
        norm = squares.sqrt()
    scaler = engine.torch_autocast_z0_gradscaler
    return norm / scaler.get_scale() if scaler else norm


@contextmanager
def withheld_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """DeepSpeed's engine leaves the learning-rate schedule alone and counts a skipped step when its optimizer
    reports `overflow`; a torch optimizer has no such flag and steps on whatever gradients it holds. For one
    step its `step` does nothing and it reports an overflow; the engine then clears the gradients as usual."""
    optimizer.step, optimizer.overflow = (lambda *args, **kwargs: None), True
    try:
        yield
    finally:
        del optimizer.step, optimizer.overflow


def measure_before_model_step(engine: PipelineEngine, grad_norm: Callable[[], torch.Tensor],
                              withhold_nonfinite: bool) -> None:
    """Have the pipeline engine take `grad_norm()` as its gradient norm where it steps (after the data-parallel
    reduction, before clipping), and withhold a step whose norm is not finite when asked."""
    take_model_step = engine._take_model_step

    def norm_then_step(lr_kwargs=None):
        engine._global_grad_norm = grad_norm()
        nonfinite = withhold_nonfinite and not torch.isfinite(engine._global_grad_norm).item()
        with withheld_step(engine.optimizer) if nonfinite else nullcontext():
            take_model_step(lr_kwargs)

    engine._take_model_step = norm_then_step
