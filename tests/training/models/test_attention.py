"""training/models/attention.py: what `auto` picks where, what is refused, and the document BlockMask that Ulysses
sequence parallelism runs (its whole-row runs on two ranks: tests/test_parallelism.py)."""
import pytest
import torch
from transformers import AutoConfig

from training.base.errors import ConfigError
from training.models.attention import attention_for, document_block_mask, document_flex
from training.parallel.sequence_parallel import document_sdpa

LLAMA = AutoConfig.from_pretrained("recipes/tiny_llama/config.json")


@pytest.mark.parametrize("requested, config, on_gpu, chosen", [
    ("auto", LLAMA, True, "flex_attention"),
    ("auto", LLAMA, False, "sdpa"),  # no FlexAttention backward on a CPU
    ("auto", AutoConfig.for_model("llama", attention_dropout=0.1), True, "sdpa"),  # flex has no attention dropout
    ("auto", AutoConfig.for_model("gpt2"), True, "sdpa"),  # transformers has no flex path for GPT-2
    ("auto", AutoConfig.for_model("llama", hidden_size=32, num_attention_heads=4), True, "sdpa"),  # heads of 8
    ("sdpa", LLAMA, True, "sdpa"),
    ("flex_attention", LLAMA, True, "flex_attention"),
])
def test_auto_takes_flex_attention_on_gpus(requested, config, on_gpu, chosen):
    assert attention_for(requested, config, on_gpu) == chosen


@pytest.mark.parametrize("config, on_gpu, message", [
    (LLAMA, False, "needs a CUDA GPU: torch has no FlexAttention backward pass on a CPU"),
    (AutoConfig.for_model("llama", attention_dropout=0.1), True, "the model's attention_dropout is 0.1"),
    (AutoConfig.for_model("llama", hidden_size=32, num_attention_heads=4), True, "the model's have 8"),
])
def test_flex_attention_where_it_cannot_train_is_refused(config, on_gpu, message):
    with pytest.raises(ConfigError, match=message):
        attention_for("flex_attention", config, on_gpu)


def test_the_document_block_mask_is_causal_within_each_document():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    mask_mod = document_block_mask(positions).mask_mod
    q, k = torch.arange(9)[:, None], torch.arange(9)[None, :]
    for row, documents in enumerate(([0, 0, 0, 1, 1, 2, 2, 2, 2], [0] * 9)):
        documents = torch.tensor(documents)
        expected = (k <= q) & (documents[q] == documents[k])
        assert torch.equal(mask_mod(torch.tensor(row), torch.tensor(0), q, k), expected)


def test_document_flex_is_document_sdpa_with_grouped_heads():
    """What Ulysses runs on the whole rows after its all-to-all: FlexAttention (its reference implementation here,
    forward only on a CPU) with the document BlockMask gives sdpa with the dense document mask; 4 query heads over
    2 key/value heads stay grouped."""
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 4, 24, 16), torch.randn(2, 2, 24, 16), torch.randn(2, 2, 24, 16)
    positions = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)
    positions[1] = torch.arange(24)  # a row of one document
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 2, True, False
    expected, _ = document_sdpa(module, query, key, value, None, position_ids=positions, scaling=0.25)
    got, _ = document_flex(module, query, key, value, None, position_ids=positions, scaling=0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
