"""The recipe's `precision`: what a run's weights, activations and matmuls compute in. AUTO is decided on the machine
before anything is built (training/planning/precision.py); every later reader holds one of the other four."""
from enum import StrEnum


class Precision(StrEnum):
    AUTO = "auto"  # bf16 where the hardware computes it natively, fp32 elsewhere; or what the DeepSpeed config enables
    BF16 = "bf16"
    FP16 = "fp16"  # NVIDIA GPUs only, with DeepSpeed's loss scaling
    FP32 = "fp32"
    FP8 = "fp8"  # BF16 weights and activations, FP8 matmuls in the linear layers (training/models/fp8.py)
