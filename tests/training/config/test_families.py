"""The family record is the one home of what the code reads about a decoder family: each fact is true of the
libraries (transformers' classes, DeepSpeed's presets, the modules the activation rule was read off), and a record
added to FAMILIES alone reaches the plan's activation rule and the pipeline's check."""
import importlib
from dataclasses import replace

import pytest
import torch
from deepspeed.module_inject.auto_ep_config import PRESET_MODELS
from transformers import AutoConfig, AutoModelForCausalLM

from training.base.errors import ConfigError
from training.config.families import FAMILIES, family_of
from training.config.recipe import load_recipe
from training.parallel.expert_parallel import check_expert_parallel
from training.parallel.pipeline import check_pipeline
from training.planning.activations import layer_bytes_per_token
from training.planning.shape import model_shape

TINY = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}
TINY_MOE = {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 8}
TINY_GPT2 = {"vocab_size": 64, "n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 64}


def tiny_config(model_type: str):
    """A two-layer config of the type (an AutoEP type with 4 experts)."""
    family = family_of(model_type)
    sizes = TINY_GPT2 if family.activations == "gpt2" else {**TINY, **(TINY_MOE if family.autoep_preset else {})}
    return AutoConfig.for_model(model_type, **sizes)


def pipeline_families() -> list[str]:
    return [model_type for model_type, family in FAMILIES.items() if family.pipeline_prefix]


@pytest.mark.parametrize("model_type", pipeline_families())
def test_each_pipeline_prefix_names_transformers_classes(model_type):
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    for name in ("DecoderLayer", "RMSNorm", "RotaryEmbedding"):
        assert isinstance(getattr(module, f"{family_of(model_type).pipeline_prefix}{name}"), type)
    config = tiny_config(model_type)
    check_pipeline(config, stages=2, zero_stage=1, world_size=2)
    # a window without layer_types to place it is the record's to tell (Mistral); a family with the flag has one
    untold = getattr(config, "layer_types", None) is None and getattr(config, "sliding_window", None) is not None
    assert family_of(model_type).sliding_window == untold


@pytest.mark.parametrize("model_type", [model_type for model_type, family in FAMILIES.items()
                                        if family.autoep_preset])
def test_each_autoep_preset_is_one_deepspeed_has_for_the_type(model_type):
    preset = PRESET_MODELS[family_of(model_type).autoep_preset]
    assert model_type in preset.hf_model_types


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_activation_rule_computes_for_a_tiny_config_of_the_type(model_type):
    family, config = family_of(model_type), tiny_config(model_type)
    per_layer = layer_bytes_per_token(model_shape(config), 32, 2, "sdpa")
    assert (per_layer is not None) == (family.activations is not None)
    if family.activations == "llama":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert family.qk_norm == any(name.endswith(".q_norm") for name, _ in model.named_modules())


def test_the_refusals_name_the_families_that_run():
    with pytest.raises(ConfigError) as error:
        check_pipeline(tiny_config("gpt2"), stages=2, zero_stage=1, world_size=2)
    assert str(error.value) == ("parallelism.pipeline_stages: gpt2 models are not supported; pipeline parallelism "
                                "supports llama, mistral, qwen2, qwen3 (Llama-family decoders)")
    recipe = load_recipe("tiny_llama", ["parallelism.expert_parallel=2"])
    with pytest.raises(ConfigError) as error:
        check_expert_parallel(recipe, tiny_config("llama"), world_size=2, zero_stage=1, offloaded=False)
    assert str(error.value) == ("parallelism.expert_parallel=2: llama is not a mixture of experts that AutoEP splits "
                                "here (mixtral, qwen2_moe, qwen3_moe); remove parallelism.expert_parallel")


def test_a_family_added_to_the_record_reaches_the_activation_rule_and_the_pipeline(monkeypatch):
    """Helium's decoder is Llama's (transformers' HeliumDecoderLayer, HeliumRMSNorm, HeliumRotaryEmbedding): one
    entry, a copy of llama's with its prefix, and the plan counts its activations and the pipeline builds it."""
    config, shape = tiny_config("helium"), model_shape(tiny_config("llama"))
    with pytest.raises(ConfigError, match="helium models are not supported"):
        check_pipeline(config, stages=2, zero_stage=1, world_size=2)
    assert layer_bytes_per_token(replace(shape, model_type="helium"), 32, 2, "sdpa") is None

    monkeypatch.setitem(FAMILIES, "helium", replace(FAMILIES["llama"], pipeline_prefix="Helium"))
    check_pipeline(config, stages=2, zero_stage=1, world_size=2)
    assert (layer_bytes_per_token(replace(shape, model_type="helium"), 32, 2, "sdpa")
            == layer_bytes_per_token(shape, 32, 2, "sdpa"))
    with pytest.raises(ConfigError, match="supports llama, mistral, qwen2, qwen3, helium "):
        check_pipeline(tiny_config("gpt2"), stages=2, zero_stage=1, world_size=2)
