"""Which precision a run uses on this machine, decided before anything is built."""
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.precision_config import DeepSpeedFP16Config
from pydantic import ValidationError

from training.base.errors import ConfigError
from training.config.precision import Precision

FP8_CAPABILITY = (8, 9)
FP8_GPUS = "H100, H200, L4, L40S, B200"

DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16, Precision.FP32: torch.float32,
          Precision.FP8: torch.bfloat16}  # fp8: BF16 weights and activations, FP8 matmuls in the linear layers


def is_mixed(precision: Precision) -> bool:
    """16-bit weights and gradients over an fp32 master copy (under ZeRO; at ZeRO-0, torch autocast over fp32)."""
    return DTYPES[precision].itemsize == 2


def weights_dtype(precision: Precision, stage: int) -> torch.dtype:
    """Checkpoint weights load in the run's precision; DeepSpeed keeps the fp32 master copy in its optimizer.
    ZeRO-0 bf16/fp16 (torch autocast over fp32 weights) keeps fp32 weights."""
    return DTYPES[precision] if stage > 0 else torch.float32


def device_type() -> str:
    """DeepSpeed's accelerator: 'cuda' on NVIDIA GPUs, 'cpu' where it falls back to its CPU accelerator."""
    return get_accelerator().device_name()


def bf16_is_native() -> bool:
    return device_type() == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def check_fp8_hardware() -> None:
    """FP8 matmuls need compute capability 8.9+ (Ada, Hopper, Blackwell): refuse elsewhere, before anything is built."""
    needed = f"precision=fp8 needs an NVIDIA GPU of compute capability 8.9 or newer ({FP8_GPUS})"
    if get_accelerator().device_name() != "cuda":
        raise ConfigError(f"{needed}; found no GPU (DeepSpeed's {get_accelerator().device_name()} accelerator). "
                          f"Use precision=bf16 or fp32 here.")
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        raise ConfigError(f"{needed}; found {torch.cuda.get_device_name()} (compute capability "
                          f"{capability[0]}.{capability[1]}). Use precision=bf16 on this GPU.")


def resolve_precision(requested: Precision, ds_config: dict, for_gpus: bool = False) -> Precision:
    """`auto` follows a DeepSpeed config that enables bf16 or fp16 outright; otherwise bf16 where the
    hardware computes it natively and fp32 elsewhere (bf16 on a CPU is emulated and slower).
    for_gpus: a plan for NVIDIA GPUs that this machine may not have (dry run with --num-gpus)."""
    if requested == Precision.AUTO:
        for name in (Precision.BF16, Precision.FP16):
            if ds_config.get(name, {}).get("enabled") is True:
                requested = name
                break
        else:
            return Precision.BF16 if for_gpus or bf16_is_native() else Precision.FP32
    if requested == Precision.FP8 and not for_gpus:
        check_fp8_hardware()
    if requested == Precision.FP16 and device_type() != "cuda" and not for_gpus:
        raise ConfigError(f"precision=fp16 needs an NVIDIA GPU: DeepSpeed refuses fp16 on its {device_type()} "
                          f"accelerator. Use precision=bf16 or precision=fp32 here.")
    return Precision(requested)


def fp16_block(ds_config: dict) -> DeepSpeedFP16Config:
    """The DeepSpeed config's `fp16` block, validated by DeepSpeed's own schema as if fp16 were on (train.py
    turns it off at ZeRO-0, where fp16 runs as torch autocast, but its loss-scaling keys still apply)."""
    try:
        return DeepSpeedFP16Config(**{**ds_config.get("fp16", {}), "enabled": True})
    except ValidationError as error:
        problems = "; ".join(f"fp16.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ConfigError(f"the DeepSpeed config's fp16 block cannot run: {problems}") from None
