"""Which precision a run uses on this machine, decided before anything is built."""
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
from deepspeed.runtime.precision_config import DeepSpeedFP16Config
from pydantic import ValidationError

from training.config.errors import ConfigError
from training.models.fp8 import check_fp8_hardware

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp8": torch.bfloat16}  # fp8: BF16 weights and activations, FP8 matmuls in the linear layers


def is_mixed(precision: str) -> bool:
    """16-bit weights and gradients over an fp32 master copy (under ZeRO; at ZeRO-0, torch autocast over fp32)."""
    return DTYPES[precision].itemsize == 2


def device_type() -> str:
    """DeepSpeed's accelerator: 'cuda' on NVIDIA GPUs, 'cpu' where it falls back to its CPU accelerator."""
    return get_accelerator().device_name()


def bf16_is_native() -> bool:
    return device_type() == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_precision(requested: str, ds_config: dict, for_gpus: bool = False) -> str:
    """`auto` follows a DeepSpeed config that enables bf16 or fp16 outright; otherwise bf16 where the
    hardware computes it natively and fp32 elsewhere (bf16 on a CPU is emulated and slower).
    for_gpus: a plan for NVIDIA GPUs that this machine may not have (dry run with --num-gpus)."""
    if requested == "auto":
        for name in ("bf16", "fp16"):
            if ds_config.get(name, {}).get("enabled") is True:
                requested = name
                break
        else:
            return "bf16" if for_gpus or bf16_is_native() else "fp32"
    if requested == "fp8" and not for_gpus:
        check_fp8_hardware()
    if requested == "fp16" and device_type() != "cuda" and not for_gpus:
        raise ConfigError(f"precision=fp16 needs an NVIDIA GPU: DeepSpeed refuses fp16 on its {device_type()} "
                          f"accelerator. Use precision=bf16 or precision=fp32 here.")
    return requested


class FP16BlockGradScaler(torch.amp.GradScaler):
    """fp16 at ZeRO-0 (torch autocast) with the loss scaling that the DeepSpeed config's `fp16` block asks for.

    There DeepSpeed makes a default GradScaler (scale 2^16, doubled after 2,000 clean steps, halved at every
    overflow) whatever the block says, and its checkpoints leave the scale out. This one keeps torch's
    mechanics (scale the loss, unscale, skip a step whose gradients hold inf/nan) and takes each new scale from
    DeepSpeed's own loss scaler built from the block: `initial_scale_power`, `loss_scale_window`,
    `hysteresis`, `consecutive_hysteresis`, `min_loss_scale`, or a static `loss_scale`. Its state_dict
    includes that scaler's state, which train.py's checkpoints save and restore."""

    POLICY_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

    def __init__(self, ds_config: dict, device: str):
        block = fp16_block(ds_config)
        self.policy = CreateLossScaler(torch.float16, block.loss_scale, block.loss_scale == 0,
                                       block.dynamic_loss_scale_args())
        super().__init__(device, init_scale=float(self.policy.cur_scale))
        self.overflow = False

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        result = super().step(optimizer, *args, **kwargs)
        self.overflow = sum(found.item() for found in self._found_inf_per_device(optimizer).values()) > 0
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


def fp16_block(ds_config: dict) -> DeepSpeedFP16Config:
    """The DeepSpeed config's `fp16` block, validated by DeepSpeed's own schema as if fp16 were on (train.py
    turns it off at ZeRO-0, where fp16 runs as torch autocast, but its loss-scaling keys still apply)."""
    try:
        return DeepSpeedFP16Config(**{**ds_config.get("fp16", {}), "enabled": True})
    except ValidationError as error:
        problems = "; ".join(f"fp16.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ConfigError(f"the DeepSpeed config's fp16 block cannot run: {problems}") from None


def use_fp16_block_loss_scaling(engine: DeepSpeedEngine) -> None:
    """At ZeRO-0 with fp16, replace DeepSpeed's default GradScaler with one that follows the config's fp16 block."""
    if engine.torch_autocast_z0_gradscaler is not None:
        engine.torch_autocast_z0_gradscaler = FP16BlockGradScaler(engine.config, device_type())


def loss_scale(engine: DeepSpeedEngine) -> float | None:
    """fp16's current loss scale (logged: a scale that keeps falling means overflowing gradients); None otherwise."""
    if engine.torch_autocast_z0_gradscaler is not None:
        return engine.torch_autocast_z0_gradscaler.get_scale()
    return float(engine.optimizer.loss_scale) if engine.fp16_enabled() else None
