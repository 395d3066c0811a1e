"""LoRA: low-rank adapters (peft) trained on a frozen base model, under ZeRO 0-3.

The adapters are added after the base model is built (under ZeRO-3 a checkpoint loads inside zero.Init,
already partitioned) and before deepspeed.initialize, which converts the new adapter parameters to ZeRO-3
parameters itself. Only the adapters (and lora.modules_to_save) require gradients, so only they get gradient
buffers and optimizer states. Checkpoints leave the frozen base weights out (they come again from
model.name_or_path on resume). The export (training/state/export.py) writes peft's adapter folder, and with
export.merge the base weights with the adapters merged into them.
"""
import importlib.util

import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PretrainedConfig, PreTrainedModel

from training.base.errors import ConfigError
from training.compat.peft import quiet_gradient_checkpointing_warning
from training.config.optimizers import OPTIMIZERS
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.config.sections import LoraSection
from training.planning.precision import device_type
from training.planning.shape import adapted_parameters, lora_config

ADAPTER_DIR = "adapter"  # beside hf/ in the output folder
ADAPTER_CONFIG = "adapter_config.json"  # in a LoRA checkpoint's hf/ folder, beside the model config
QLORA_REQUIREMENTS = "requirements-qlora.txt"
quiet_gradient_checkpointing_warning()


def with_lora(model: PreTrainedModel, section: LoraSection, seed: int) -> torch.nn.Module:
    """The model with adapters when lora.enabled (else as it is). The adapters' random initialization is seeded
    here, so that every rank and every ZeRO stage starts from the same adapters (loading a checkpoint inside
    zero.Init draws other random numbers than loading it whole)."""
    if not section.enabled:
        return model
    torch.manual_seed(seed)
    return get_peft_model(model, lora_config(section))


def trainable_parameters(section: LoraSection, model_config: PretrainedConfig) -> int:
    """The parameters a LoRA run trains (adapters and modules_to_save), counted on the meta device; a ConfigError
    naming the setting when peft cannot place the adapters on this model."""
    with torch.device("meta"):
        return adapted_parameters(AutoModelForCausalLM.from_config(model_config), section)


def check_nf4(precision: Precision, for_gpus: bool) -> None:
    if precision != Precision.BF16:
        raise ConfigError(f"lora.quantize=nf4 (QLoRA) computes in bf16 over the 4-bit weights: set precision=bf16 "
                          f"(not {precision})")
    if for_gpus:
        return  # a plan for GPUs elsewhere
    if device_type() != "cuda":
        raise ConfigError("lora.quantize=nf4 (QLoRA) loads the base model in 4 bits through bitsandbytes, whose "
                          "4-bit layers need a CUDA GPU, and this machine has none: run it on an NVIDIA GPU (plan it "
                          "here with --dry-run --num-gpus N), or set lora.quantize=none")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"lora.quantize=nf4 (QLoRA) needs bitsandbytes, an optional extra: pip install -r "
                          f"{QLORA_REQUIREMENTS}")


def check_lora(recipe: Recipe, model_config: PretrainedConfig, precision: Precision, for_gpus: bool) -> None:
    """What LoRA runs with: ZeRO 0-3 and the optimizers whose record does not refuse it; the settings below are
    refused (and the parallel degrees training/parallel/support.py's table refuses)."""
    lora, optimizer = recipe.lora, recipe.optimizer.name
    refused = [
        (precision == Precision.FP8, "precision=fp8 (the FP8 conversion would replace the adapted linear layers)"),
        (OPTIMIZERS[optimizer].lora_refused, f"optimizer.name={optimizer} ({OPTIMIZERS[optimizer].lora_refused})"),
    ]
    problems = [reason for condition, reason in refused if condition]
    if problems:
        raise ConfigError(f"lora.enabled with {'; '.join(problems)}: use LoRA with data parallelism and ZeRO 0-3")
    if lora.quantize == "nf4":
        check_nf4(precision, for_gpus)
    trainable_parameters(lora, model_config)


def nf4_quantization(dtype: torch.dtype) -> BitsAndBytesConfig:
    """QLoRA's 4-bit NormalFloat base weights (with double quantization), computing in `dtype`. The 4-bit weights
    are stored in `dtype`-sized elements, so that ZeRO-3 can partition and gather them like any other weight."""
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)


def lora_files(model: torch.nn.Module) -> tuple:
    """What a LoRA run's checkpoints keep in hf/ besides the model config and tokenizer: the adapters' config, so
    that the checkpoint exports on its own (export_adapters)."""
    return (model.peft_config["default"],) if isinstance(model, PeftModel) else ()
