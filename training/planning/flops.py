"""Training FLOPs per token, and the GPU peak that MFU divides by.

Per token of a row of `seq_len` tokens, forward + backward (the backward costs twice the forward):
  model FLOPs    = 6 * N  +  12 * layers * q_dim * seq_len
  hardware FLOPs = model FLOPs  +  (with activation checkpointing) 2 * N_layers  +  4 * layers * q_dim * seq_len
N counts the parameters a token multiplies with (all but the embedding tables; a tied LM head counts; in a
mixture of experts only the top-k experts the router picks for it, the active parameters);
With LoRA the frozen weights need no weight gradients: 4 * N + 6 * N_LoRA (the adapters' parameters) instead
of 6 * N. N_layers the decoder layers' alone (checkpointing recomputes their forward, not the head's). The attention term
is QK^T and AV over the whole row (PaLM's and torchtitan's convention; causal masking and packed documents do
less work, so this is an upper bound and comparable with their MFU figures).
MFU = model FLOPs per second / peak dense bf16 FLOP/s of the GPU (FP8 runs too, as torchtitan reports);
hardware FLOP/s count the recomputation as well (HFU = hardware FLOP/s / peak).
"""
import re

from training.planning.shape import ModelShape

# Dense (no sparsity) bf16 tensor-core peaks per GPU, TFLOP/s, from NVIDIA's data sheets. Matched against
# torch.cuda.get_device_name() word by word, most specific first; logging.peak_tflops overrides.
PEAK_BF16_TFLOPS = (
    (("H100", "NVL"), 835.0),
    (("H100", "PCIe"), 756.0),
    (("GH200",), 989.0),
    (("H200",), 989.0),
    (("H100",), 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    (("H20",), 148.0),
    (("B200",), 2250.0),
    (("A100",), 312.0),
    (("L40S",), 362.0),
    (("L4",), 121.0),
    (("A10",), 125.0),
    (("A6000",), 155.0),  # RTX A6000
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


def peak_tflops(device_name: str) -> float | None:
    """The table's peak for a GPU name such as 'NVIDIA H100 80GB HBM3', or None for a GPU not in it."""
    words = set(re.split(r"[\s\-_]+", device_name))
    return next((peak for names, peak in PEAK_BF16_TFLOPS if set(names) <= words), None)
