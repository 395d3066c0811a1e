"""training/models/fused_loss.py: the fused head and loss give transformers' loss and gradients (fp32, within 1e-5),
chunk by chunk, without ever holding more than one chunk's logits; without labels the model is unchanged."""
import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from training.config.recipe import load_recipe
from training.models import fused_loss
from training.models.fused_loss import fuse_head_and_loss, summed_token_loss
from training.planning.kernels import uses_fused_loss

ROWS, SEQ_LEN, VOCAB, CHUNK = 2, 40, 101, 24  # 80 tokens: 4 chunks, the last one short


def llama() -> torch.nn.Module:
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, use_cache=False))


def gpt2() -> torch.nn.Module:  # tied embeddings: the head's weight is the token embedding's
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def batch() -> dict:
    labels = torch.randint(0, VOCAB, (ROWS, SEQ_LEN))
    labels[:, :5] = -100  # a prompt without targets
    labels[1, 20:23] = -100
    return {"input_ids": torch.randint(0, VOCAB, (ROWS, SEQ_LEN)), "labels": labels,
            "position_ids": torch.arange(SEQ_LEN).repeat(ROWS, 1)}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(fused_loss, "CHUNK_TOKENS", CHUNK)


@pytest.mark.parametrize("build,frozen_head", [(llama, False), (gpt2, False), (llama, True)],
                         ids=["llama", "gpt2-tied", "llama-frozen-head"])
def test_the_fused_loss_gives_the_models_loss_and_gradients(build, frozen_head):
    """frozen_head: as under LoRA, where the head takes no gradient (and the fused loss computes none for it)."""
    torch.manual_seed(0)
    model, inputs = build(), batch()
    if frozen_head:
        model.lm_head.weight.requires_grad_(False)
    fused = copy.deepcopy(model)
    fuse_head_and_loss(fused)
    targets = int((inputs["labels"][:, 1:] != -100).sum())
    expected = model(**inputs, num_items_in_batch=targets).loss
    loss = fused(**inputs, num_items_in_batch=targets).loss
    expected.backward()
    (loss * 3).backward()  # an incoming gradient other than 1 (accumulation, a loss scale) reaches every chunk
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, weight), fused_weight in zip(model.named_parameters(), fused.parameters()):
        if frozen_head and name == "lm_head.weight":
            assert fused_weight.grad is None
            continue
        torch.testing.assert_close(fused_weight.grad, 3 * weight.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_no_more_than_one_chunk_of_logits_exists(monkeypatch):
    widths = []
    real = fused_loss.loss_and_logits_grad
    monkeypatch.setattr(fused_loss, "loss_and_logits_grad",
                        lambda logits, targets: (widths.append(logits.shape[0]), real(logits, targets))[1])
    model = llama()
    fuse_head_and_loss(model)
    model(**batch()).loss.backward()
    assert widths == [CHUNK, CHUNK, CHUNK, ROWS * SEQ_LEN - 3 * CHUNK]


def test_shift_labels_are_taken_as_given_and_without_a_count_the_loss_is_the_token_mean():
    """Under sequence parallelism a rank's labels come shifted already (data_pipeline/loader.py model_inputs)."""
    torch.manual_seed(0)
    model, inputs = llama(), batch()
    fused = copy.deepcopy(model)
    fuse_head_and_loss(fused)
    shifted = F.pad(inputs["labels"][:, 1:], (0, 1), value=-100)
    expected = model(**inputs, shift_labels=shifted).loss
    torch.testing.assert_close(fused(**inputs, shift_labels=shifted).loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused(**inputs).loss, expected, rtol=1e-5, atol=1e-6)


def test_without_labels_or_gradients_the_model_is_unchanged():
    torch.manual_seed(0)
    model, inputs = llama(), batch()
    fused = copy.deepcopy(model)
    fuse_head_and_loss(fused)
    without_labels = {name: inputs[name] for name in ("input_ids", "position_ids")}
    torch.testing.assert_close(fused(**without_labels).logits, model(**without_labels).logits)
    with torch.no_grad():  # evaluation: chunked, no gradient taken
        torch.testing.assert_close(fused(**inputs, num_items_in_batch=1).loss,
                                   model(**inputs, num_items_in_batch=1).loss, rtol=1e-5, atol=1e-5)


def test_every_target_ignored_gives_zero_loss_and_zero_gradients():
    hidden = torch.randn(30, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    loss = summed_token_loss(hidden, weight, torch.full((30,), -100))
    loss.backward()
    assert loss.item() == 0 and not hidden.grad.any() and not weight.grad.any()


def test_the_fused_loss_applies_to_the_lm_objective_where_train_py_builds_the_loss():
    assert uses_fused_loss(load_recipe("tiny_llama"), router_loss=False)
    assert not uses_fused_loss(load_recipe("tiny_llama"), router_loss=True)  # an MoE model adds it in its forward
    for overrides in (["fused_loss=false"], ["parallelism.pipeline_stages=2"], ["parallelism.tensor_parallel=2"],
                      ["long_context.logits_tile_tokens=64"], ["precision=fp8", "fp8.lm_head=true"]):
        assert not uses_fused_loss(load_recipe("tiny_llama", overrides), router_loss=False), overrides
    assert uses_fused_loss(load_recipe("tiny_llama", ["precision=fp8"]), router_loss=False)  # the head stays bf16
    assert uses_fused_loss(load_recipe("tiny_llama_sft", ["lora.enabled=true"]), router_loss=False)
    assert not uses_fused_loss(load_recipe("tiny_llama_sft", ["lora.enabled=true", "lora.modules_to_save=[lm_head]"]),
                               router_loss=False)
    assert not uses_fused_loss(load_recipe("tiny_llama_dpo"), router_loss=False)


def test_the_chunks_loss_and_gradient_trace_as_one_graph():
    """What CUDA compiles into two passes over a chunk's logits: one graph, no break (dynamo's eager backend here)."""
    logits, targets = torch.randn(24, VOCAB), torch.randint(0, VOCAB, (24,))
    targets[:3] = -100
    traced = torch.compile(fused_loss.token_loss_and_logits_grad, backend="eager", fullgraph=True)
    for got, expected in zip(traced(logits.clone(), targets),
                             fused_loss.token_loss_and_logits_grad(logits.clone(), targets)):
        torch.testing.assert_close(got, expected)
