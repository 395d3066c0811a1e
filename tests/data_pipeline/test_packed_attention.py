"""A packed row gives every document exactly the per-token loss it has when run alone."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from data_pipeline.pack import pack_concat


def per_token_loss(model, input_ids, position_ids, labels) -> torch.Tensor:
    logits = model(input_ids=input_ids[None], position_ids=position_ids[None]).logits[0]
    return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100, reduction="none")


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_documents_do_not_attend_across_boundaries(attn_implementation):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = attn_implementation
    rng = np.random.default_rng(0)
    lengths = np.array([7, 12, 5, 9])
    documents = [rng.integers(1, 97, size=n) for n in lengths]
    rows = pack_concat(np.concatenate(documents), lengths, seq_len=int(lengths.sum()))
    row = {name: torch.from_numpy(rows[name][0]).long() for name in ("input_ids", "labels", "position_ids")}
    with torch.no_grad():
        packed = per_token_loss(model, row["input_ids"], row["position_ids"], row["labels"])
        start = 0
        for document in documents:
            ids = torch.from_numpy(document).long()
            alone = per_token_loss(model, ids, torch.arange(len(ids)), ids)
            inside = packed[start:start + len(ids) - 1]  # targets 2..n of this document
            torch.testing.assert_close(inside, alone, rtol=1e-5, atol=1e-5)
            start += len(ids)
        # the first token of each following document is never a target
        boundaries = np.cumsum(lengths)[:-1]
        assert torch.all(packed[boundaries - 1] == 0)
