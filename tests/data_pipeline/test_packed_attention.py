"""A packed row gives every document exactly the per-token loss it has when run alone."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from data_pipeline.pack import pack_concat

LENGTHS = [7, 12, 5, 8]  # 32 tokens: two slices of 16 under sequence parallelism, the second document spans both


def packed_row() -> tuple[dict[str, torch.Tensor], list[np.ndarray]]:
    """One row of four random documents packed as data_pipeline packs them, and the documents."""
    rng = np.random.default_rng(0)
    documents = [rng.integers(1, 97, size=n) for n in LENGTHS]
    rows = pack_concat(np.concatenate(documents), np.array(LENGTHS), seq_len=sum(LENGTHS))
    return {name: torch.from_numpy(rows[name][0]).long() for name in ("input_ids", "labels", "position_ids")}, documents


def sharp_model(model_type: str = "llama", attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A tiny seeded model (GQA: llama 4 heads over 2 key/value heads, qwen2 over 1; heads of 16, FlexAttention's
    least on a GPU) whose queries are scaled up so that attention is peaked, as in a trained model: attending across
    documents then changes the loss clearly."""
    torch.manual_seed(0)
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[
        model_type]
    config = config_class(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2 if model_type == "llama" else 1,
                          max_position_embeddings=64, use_cache=False, attn_implementation=attn_implementation)
    model = model_class(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
    return model


def per_token_loss(model, input_ids, position_ids, labels) -> torch.Tensor:
    logits = model(input_ids=input_ids[None], position_ids=position_ids[None]).logits[0]
    return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100, reduction="none")


def losses_alone(model, documents: list[np.ndarray], device: str = "cpu") -> list[torch.Tensor]:
    """Each document's per-token loss (targets 2..n) run on its own."""
    with torch.no_grad():
        return [per_token_loss(model, ids, torch.arange(len(ids), device=device), ids).cpu()
                for ids in (torch.from_numpy(document).long().to(device) for document in documents)]


def assert_documents_kept_apart(packed: torch.Tensor, alone: list[torch.Tensor], tolerance: float = 1e-5) -> None:
    """packed: the row's per-token losses (target t + 1 at index t)."""
    start = 0
    for expected in alone:
        torch.testing.assert_close(packed[start:start + len(expected)], expected, rtol=tolerance, atol=tolerance)
        start += len(expected) + 1
    assert torch.all(packed[np.cumsum(LENGTHS)[:-1] - 1] == 0)  # a document's first token is never a target


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager", "flex_attention"])
def test_documents_do_not_attend_across_boundaries(attn_implementation):
    """flex_attention: transformers' document BlockMask, run here by FlexAttention's reference implementation
    (compiling its kernel for a CPU takes half a minute; the kernel itself runs on CUDA,
    tests/test_gpu_invariants.py)."""
    model = sharp_model(attn_implementation=attn_implementation)
    row, documents = packed_row()
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        packed = per_token_loss(model, row["input_ids"], row["position_ids"], row["labels"])
        alone = losses_alone(model, documents)
    assert_documents_kept_apart(packed, alone)
