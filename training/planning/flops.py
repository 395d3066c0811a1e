"""Training FLOPs per token; the GPU's peak, which MFU divides by, and its memory bandwidth, which bounds decoding.

Per token of a row of `seq_len` tokens, forward + backward (the backward costs twice the forward):
  model FLOPs    = 6 * N  +  12 * layers * q_dim * seq_len
  hardware FLOPs = model FLOPs  +  (with activation checkpointing) 2 * N_layers  +  4 * layers * q_dim * seq_len
N counts the parameters a token multiplies with (all but the embedding tables; a tied LM head counts; in a
mixture of experts only the top-k experts the router picks for it, the active parameters);
With LoRA the frozen weights need no weight gradients: 4 * N + 6 * N_LoRA (the adapters' parameters) instead
of 6 * N. N_layers the decoder layers' alone (checkpointing recomputes their forward, not the head's). The attention
term is QK^T and AV over the whole row (PaLM's and torchtitan's convention; causal masking and packed documents do
less work, so this is an upper bound and comparable with their MFU figures).
MFU = model FLOPs per second / peak dense bf16 FLOP/s of the GPU (FP8 runs too, as torchtitan reports);
hardware FLOP/s count the recomputation as well (HFU = hardware FLOP/s / peak).
"""
import re
from typing import NamedTuple

from training.planning.shape import ModelShape


class GpuSpec(NamedTuple):
    peak_tflops: float  # dense (no sparsity) bf16 tensor-core peak, TFLOP/s
    bandwidth: float  # memory bandwidth, bytes/s


# From NVIDIA's data sheets; where a GPU comes with more than one memory, the fastest (a time bound computed from it
# stays a bound). Matched against torch.cuda.get_device_name() word by word, most specific first;
# logging.peak_tflops overrides the peak.
GPUS = (
    (("H100", "NVL"), GpuSpec(835.0, 3.9e12)),
    (("H100", "PCIe"), GpuSpec(756.0, 2.0e12)),
    (("GH200",), GpuSpec(989.0, 4.9e12)),
    (("H200",), GpuSpec(989.0, 4.8e12)),
    (("H100",), GpuSpec(989.0, 3.35e12)),  # SXM ("NVIDIA H100 80GB HBM3")
    (("H20",), GpuSpec(148.0, 4.0e12)),
    (("B200",), GpuSpec(2250.0, 8.0e12)),
    (("A100",), GpuSpec(312.0, 2.039e12)),
    (("L40S",), GpuSpec(362.0, 0.864e12)),
    (("L4",), GpuSpec(121.0, 0.3e12)),
    (("A10",), GpuSpec(125.0, 0.6e12)),
    (("A6000",), GpuSpec(155.0, 0.768e12)),  # RTX A6000
)


def flops_per_token(shape: ModelShape, seq_len: int, recompute: bool) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per trained token; the formulas are in the module docstring."""
    attention = 12 * shape.num_layers * shape.q_dim * seq_len
    lora = shape.lora_parameters
    weights = 6 * shape.matmul_parameters if lora is None else 4 * shape.matmul_parameters + 6 * lora
    model = weights + attention
    if not recompute:
        return model, model
    return model, model + 2 * (sum(shape.layer_parameters) - shape.inactive_expert_parameters) + attention / 3


def gpu_spec(device_name: str) -> GpuSpec | None:
    """The table's row for a GPU name such as 'NVIDIA H100 80GB HBM3', or None for a GPU not in it."""
    words = set(re.split(r"[\s\-_]+", device_name))
    return next((spec for names, spec in GPUS if set(names) <= words), None)


def peak_tflops(device_name: str) -> float | None:
    """The table's bf16 peak for a GPU name, or None for a GPU not in it."""
    spec = gpu_spec(device_name)
    return spec.peak_tflops if spec else None
