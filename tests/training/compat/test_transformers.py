"""Canaries of training/compat/transformers.py (docs/compat.md)."""
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import REPO
from training.compat.transformers import (
    attention_implementation,
    set_attention_implementation,
    set_checkpointing_function,
)


def small_config():
    return AutoConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json", num_hidden_layers=1, hidden_size=32,
                                      intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def test_the_attention_implementation_lives_on_the_config():
    model = AutoModelForCausalLM.from_config(small_config(), attn_implementation="sdpa")
    assert attention_implementation(model.config) == "sdpa"
    config = small_config()
    set_attention_implementation(config, "eager")
    assert attention_implementation(config) == "eager" == config._attn_implementation


def test_the_checkpoint_function_reaches_every_layer():
    model, calls = AutoModelForCausalLM.from_config(small_config()), []

    def counting(function, *args, **kwargs):
        calls.append(function)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)

    set_checkpointing_function(model, counting)
    model.train()
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    assert len(calls) == model.config.num_hidden_layers


def test_generate_compiles_on_a_cpu_only_when_told_to():
    """generate compiles its decoding passes on a static KV cache where _valid_auto_compile_criteria says so: on a
    CPU only with the CompileConfig's private _compile_all_devices, which compiled_decoding sets (and a config built
    by hand leaves unset)."""
    from transformers import CompileConfig, GenerationConfig, StaticCache

    from training.compat.transformers import compiled_decoding
    model = AutoModelForCausalLM.from_config(small_config())
    cache = {"past_key_values": StaticCache(config=model.config, max_cache_len=8)}
    assert CompileConfig()._compile_all_devices is None
    assert not model._valid_auto_compile_criteria(cache, GenerationConfig(compile_config=CompileConfig()))
    assert model._valid_auto_compile_criteria(cache, GenerationConfig(compile_config=compiled_decoding("cpu")))
    assert "_compile_all_devices" not in compiled_decoding("cpu").to_dict()  # torch.compile is never handed it
