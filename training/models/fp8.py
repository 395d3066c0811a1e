"""precision: fp8: the linear layers' matmuls in FP8 (torchao's float8 training), everything else in BF16.

torchao rather than Transformer Engine: it swaps the Hugging Face model's own nn.Linear modules for
Float8Linear (same parameters, same state-dict names, so ZeRO partitioning, checkpoints and the hf/ export
are unchanged), needs no CUDA build, and installs as a small wheel. Weights, master weights and optimizer
states stay as in bf16 training (DeepSpeed's bf16 path); only the matmuls' inputs are cast to FP8 with
dynamic scales, per tensor (`tensorwise`, fastest) or per row (`rowwise`, closer to bf16).
"""
from fnmatch import fnmatch

import torch

from training.config.sections import Fp8Section


def convert_linears_to_fp8(model: torch.nn.Module, section: Fp8Section, vocab_size: int) -> list[str]:
    """Swap the model's linear layers for torchao's Float8Linear, in place, and return their names (the filter's
    choice; fp8_linear_count counts what the model holds).

    Kept in BF16: the LM head (the layer with vocab_size outputs) unless fp8.lm_head, modules matching
    fp8.exclude, and layers whose sizes are not multiples of 16 (FP8 matmuls need them)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = []

    def fp8_eligible(module: torch.nn.Module, name: str) -> bool:
        if not isinstance(module, torch.nn.Linear):
            return True  # torchao asks for every module; containers are walked into
        keep = ((module.out_features == vocab_size and not section.lm_head)
                or any(fnmatch(name, pattern) for pattern in section.exclude)
                or module.in_features % 16 or module.out_features % 16)
        if not keep:
            converted.append(name)
        return not keep

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(section.recipe),
                               module_filter_fn=fp8_eligible)
    return converted


def fp8_linear_count(model: torch.nn.Module) -> int:
    """The model's linear layers that compute in FP8 (torchao's Float8Linear): what the summary reports, so that a
    run whose conversion silently did nothing shows 0."""
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(module, Float8Linear) for module in model.modules())
