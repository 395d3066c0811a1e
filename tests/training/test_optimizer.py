import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from training.optimizer import lr_schedule, weight_decay_groups
from training.recipe import load_recipe


@pytest.mark.parametrize("tied", [False, True])
def test_no_weight_decay_on_biases_norms_and_embeddings(tied):
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         attention_bias=True, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    decay, no_decay = weight_decay_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert "model.embed_tokens.weight" in no_decay_names
    assert all("norm" in n or n.endswith(".bias") or n == "model.embed_tokens.weight" for n in no_decay_names)
    assert all(n.endswith(".weight") and "norm" not in n and "embed" not in n for n in decay_names)
    assert ("lm_head.weight" in decay_names) is (not tied)  # a tied head is the embedding
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def lrs(schedule: str, total: int = 100, **overrides) -> list[float]:
    settings = {"schedule": schedule, "warmup_steps": 10, "min_lr_ratio": 0.1, **overrides}
    training = load_recipe("tiny_llama", [f"training.{k}={v}" for k, v in settings.items()]).training
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=training.lr)
    scheduler = lr_schedule(training, total)(optimizer)
    values = []
    for _ in range(total):
        values.append(optimizer.param_groups[0]["lr"] / training.lr)
        optimizer.step()
        scheduler.step()
    return values


def test_cosine_warms_up_then_decays_to_the_min_ratio():
    ratio = lrs("cosine")
    assert ratio[0] == 0 and ratio[5] == pytest.approx(0.5) and ratio[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(ratio[10:], ratio[11:]))
    assert ratio[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 89 / 90)), rel=1e-6)
    assert ratio[55] == pytest.approx(0.55, abs=1e-6)  # halfway through the decay: (1 + 0.1) / 2


def test_linear_decays_to_zero():
    ratio = lrs("linear")
    assert ratio[10] == pytest.approx(1.0) and ratio[-1] == pytest.approx(1 / 90)


def test_wsd_holds_then_decays_in_the_last_share_of_steps():
    ratio = lrs("wsd", decay_ratio=0.2)
    assert ratio[10:80] == pytest.approx([1.0] * 70)
    assert 0.1 <= ratio[-1] < 0.2 and all(a >= b for a, b in zip(ratio[80:], ratio[81:]))


def test_constant_after_warmup():
    ratio = lrs("constant")
    assert ratio[10:] == pytest.approx([1.0] * 90)
