"""Decoder families, by transformers' `model_type`: one record each of the facts the code reads about a family.

Adding a family is one entry in FAMILIES plus its proof (tests/training/config/test_families.py: the pipeline's
classes are transformers', the AutoEP preset is DeepSpeed's, the activation rule computes for a tiny config of the
type). A model type without an entry runs where nothing needs a fact of its family (data parallelism and ZeRO);
the plan prints no activation estimate for it, and pipeline and expert parallelism refuse it by name.
"""
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Family:
    # which per-layer rule of training/planning/activations.py counts the tensors its layers save for the backward
    # pass: "llama" (a Llama-style decoder: RMSNorm, rotary attention, a SwiGLU MLP or its MoE; the MoE term is read
    # off the shape's experts) or "gpt2"; None: no rule read off its modules (the plan has no activation estimate)
    activations: Literal["llama", "gpt2"] | None = None
    qk_norm: bool = False  # RMSNorm on each head's queries and keys (Qwen3): the "llama" rule's q/k-norm terms
    # transformers' class-name prefix of its modules, <prefix>DecoderLayer, <prefix>RMSNorm and
    # <prefix>RotaryEmbedding in transformers.models.<model_type>.modeling_<model_type>, which the pipeline's stages
    # are built from (training/parallel/pipeline.py); None: not built as a pipeline
    pipeline_prefix: str | None = None
    # with config.sliding_window set and no config.layer_types to say which layers slide, every layer attends within
    # the window (Mistral's config has no layer_types; Qwen2's and Qwen3's do): the pipeline's mask for each layer
    sliding_window: bool = False
    # the preset_model DeepSpeed's AutoEP splits its experts with (training/parallel/expert_parallel.py); None: not a
    # mixture of experts AutoEP splits here
    autoep_preset: str | None = None


FAMILIES: dict[str, Family] = {  # the pipeline's error message lists its families in this order
    "llama": Family(activations="llama", pipeline_prefix="Llama"),
    "mistral": Family(activations="llama", pipeline_prefix="Mistral", sliding_window=True),
    "qwen2": Family(activations="llama", pipeline_prefix="Qwen2"),
    "qwen3": Family(activations="llama", qk_norm=True, pipeline_prefix="Qwen3"),
    "mixtral": Family(activations="llama", autoep_preset="mixtral"),
    "qwen3_moe": Family(activations="llama", qk_norm=True, autoep_preset="qwen3_moe"),
    # DeepSpeed's qwen3_moe preset covers Qwen2-MoE's sparse blocks too (its hf_model_types name both; its shared-
    # expert patterns are Qwen2-MoE's). The "llama" rule's MoE term counts no shared expert: no activation rule.
    "qwen2_moe": Family(autoep_preset="qwen3_moe"),
    "gpt2": Family(activations="gpt2"),
}


def family_of(model_type: str) -> Family:
    """The model type's record; an unknown type's has no facts (no activation rule, no pipeline, no AutoEP)."""
    return FAMILIES.get(model_type, Family())
