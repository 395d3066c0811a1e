"""training/loop/engine.py: the micro-batch's target count reaches a compiled model without recompiling it."""
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from training.loop.engine import loss_divisor


def count_each_step(compiled: bool) -> None:
    """Three steps of a torch.compile'd model, each with another target count, as train.py passes it."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, use_cache=False))
    engine = SimpleNamespace(is_compiled=compiled, device=torch.device("cpu"))
    model = torch.compile(model, backend="eager")  # dynamo's guards alone, no code generation
    ids = torch.randint(0, 64, (1, 12))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for count in (11.0, 9.0, 7.0):
            model(input_ids=ids, labels=ids, num_items_in_batch=loss_divisor(engine, count))


def test_a_compiled_model_is_traced_once_whatever_the_target_count():
    count_each_step(compiled=True)


def test_a_float_count_would_recompile_the_model_each_step():
    """Why loss_divisor hands a compiled engine a tensor: dynamo specializes on a float's value."""
    with pytest.raises(Exception, match="[Rr]ecompil"):
        count_each_step(compiled=False)
