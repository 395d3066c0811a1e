"""Canary of training/compat/peft.py (docs/compat.md)."""
import warnings

from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import REPO


def test_peft_still_asks_the_deprecated_name():
    config = AutoConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json", num_hidden_layers=1, hidden_size=32,
                                        intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = AutoModelForCausalLM.from_config(config)
    model.activation_checkpointing_enable()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_peft_model(model, LoraConfig(target_modules=["q_proj"]))
    assert any("is_gradient_checkpointing" in str(w.message) and w.category is FutureWarning for w in caught), \
        "peft no longer reads is_gradient_checkpointing: compat/peft.py quiet_gradient_checkpointing_warning can go"
