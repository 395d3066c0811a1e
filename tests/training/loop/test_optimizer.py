import math

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

import train
from training.base.errors import ConfigError
from training.config.recipe import load_recipe
from training.loop.optimizer import client_optimizer, lr_schedule, muon_name_rule_mismatch
from training.planning.ds_config import load_ds_config, resolve_ds_config
from training.planning.shape import weight_decay_groups


@pytest.mark.parametrize("tied", [False, True])
def test_no_weight_decay_on_biases_norms_and_embeddings(tied):
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, attention_bias=True, tie_word_embeddings=tied)
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


def resolved(*overrides: str) -> dict:
    recipe = load_recipe("tiny_llama", list(overrides))
    raw, path = load_ds_config(recipe)
    return resolve_ds_config(raw, path, recipe, 64, 2, "fp32")


def test_the_optimizer_section_follows_the_recipe():
    assert resolved()["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                                    "weight_decay": 0.1, "torch_adam": True,
                                                                    "fused": False}}  # on a CPU: torch's foreach
    lion = resolved("optimizer.name=lion", "training.lr=3e-4", "training.betas=[0.9, 0.99]")
    assert lion["optimizer"] == {"type": "Lion", "params": {"lr": 3e-4, "betas": [0.9, 0.99], "weight_decay": 0.1}}
    assert lion["zero_allow_untested_optimizer"] is True  # lion-pytorch's, a client optimizer
    assert resolved("optimizer.name=lion", "deepspeed.config=zero2_offload")["zero_force_ds_cpu_optimizer"] is False
    muon = resolved("optimizer.name=muon", "optimizer.muon_lr=0.01", "deepspeed.config=zero3")
    assert muon["optimizer"]["type"] == "Muon"
    assert {key: muon["optimizer"]["params"][key] for key in ("lr", "muon_lr", "momentum")} == \
        {"lr": 3e-3, "muon_lr": 0.01, "momentum": 0.95}
    assert muon["zero_optimization"]["reduce_scatter"] is False  # DeepSpeed's ZeRO-3 Muon refuses it
    adamw8bit = resolved("optimizer.name=adamw8bit", "deepspeed.config=zero3_offload", "precision=bf16")
    assert adamw8bit["optimizer"] == {"type": "AdamW8bit", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                                       "weight_decay": 0.1}}
    assert adamw8bit["zero_allow_untested_optimizer"] is True and adamw8bit["zero_force_ds_cpu_optimizer"] is False
    adafactor = resolved("optimizer.name=adafactor", "training.lr=1e-2")
    assert adafactor["optimizer"] == {"type": "Adafactor", "params": {"lr": 1e-2, "weight_decay": 0.1}}


def test_a_json_optimizer_type_that_contradicts_the_recipe_is_refused(tmp_path):
    with pytest.raises(ConfigError, match='optimizer.type="Lion" .* contradicts optimizer.name="AdamW"'):
        resolved("deepspeed.overrides={optimizer: {type: Lion}}")


@pytest.mark.parametrize("override, message", [
    ("optimizer.muon_lr=0.01", "optimizer.muon_lr applies to optimizer.name=muon, not adamw"),
    ("optimizer.name=sgd", "optimizer.name: Input should be 'adamw', 'adamw8bit', 'adafactor', 'lion' or 'muon'"),
])
def test_invalid_optimizer_settings(override, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe("tiny_llama", [override])


@pytest.mark.parametrize("overrides, message", [
    (["deepspeed.config=zero1"], "training.grad_clip=1.0 at ZeRO-1: DeepSpeed's ZeRO Muon measures the norm after"),
    (["deepspeed.config=zero2_offload", "training.grad_clip=0"], "ZeRO-Offload: DeepSpeed's CPU optimizers are"),
    (["parallelism.tensor_parallel=2", "training.grad_clip=0"], "not built with Muon"),
    (["model.config=GPT2", "training.grad_clip=0"],  # a model whose embeddings DeepSpeed's name rule takes
     "DeepSpeed picks Muon's parameters by name, which for this model (gpt2) also takes transformer.wte.weight"),
])
def test_muon_refusals_exit_2(overrides, message, no_model_building, capsys, tmp_path):
    if overrides[0] == "model.config=GPT2":
        AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=4096).save_pretrained(tmp_path)
        overrides = [f"model.config={tmp_path}/config.json", *overrides[1:]]
    args = ["--recipe", "tiny_llama", "--dry-run", "--num-gpus", "2", "--gpu-mem", "80", "optimizer.name=muon",
            *overrides]
    assert train.main(args) == 2
    assert message in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "qwen3"])
def test_muon_takes_exactly_the_decoder_layers_matrices(model_type):
    config = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    assert muon_name_rule_mismatch(config) == []




def test_lion_leaves_a_weight_without_a_gradient_where_it_is():
    """DeepSpeed 0.19.8's Lion kernels move it by the learning rate every step (sign(0) taken as +1 or -1);
    lion-pytorch's, which train.py hands to DeepSpeed, leaves it."""
    used, unused = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    optimizer = client_optimizer(resolved("optimizer.name=lion", "training.lr=1e-3"))([used, unused])
    for _ in range(3):
        used.grad, unused.grad = torch.full((4,), 0.5), torch.zeros(4)
        optimizer.step()
    torch.testing.assert_close(unused.detach(), torch.full((4,), (1 - 1e-4) ** 3), rtol=0, atol=1e-7)  # decay only
    torch.testing.assert_close(used.detach(), torch.full((4,), (1 - 1e-4) ** 3 - 3e-3), rtol=0, atol=1e-6)


def test_adamw_is_torchs_fused_kernel_on_cuda_where_the_config_names_none(monkeypatch):
    from deepspeed.accelerator import get_accelerator
    monkeypatch.setattr(get_accelerator(), "device_name", lambda *_: "cuda")
    for setting in ("zero0", "zero1", "zero2", "zero3"):
        params = resolved(f"deepspeed.config={setting}")["optimizer"]["params"]
        assert (params["torch_adam"], params["fused"]) == (True, True), setting
    for setting in ("zero2_offload", "zero3_offload"):  # DeepSpeed's CPU Adam steps there
        assert {"torch_adam", "fused"}.isdisjoint(resolved(f"deepspeed.config={setting}")["optimizer"]["params"])
    kept = resolved("deepspeed.overrides={optimizer: {params: {fused: false}}}")["optimizer"]["params"]
    assert (kept["torch_adam"], kept["fused"]) == (True, False)
    deepspeeds = resolved("deepspeed.overrides={optimizer: {params: {torch_adam: false}}}")["optimizer"]["params"]
    assert deepspeeds["torch_adam"] is False and "fused" not in deepspeeds  # DeepSpeed's FusedAdam, as asked


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_fused_adamw_takes_the_unfused_steps(stage, one_rank):
    """torch's fused AdamW (CUDA's default here; torch runs the same kernel's CPU form) under each ZeRO stage: 5 steps
    of a tiny Llama give the foreach implementation's weights within 1e-6 (fp32)."""
    import deepspeed

    weights = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, use_cache=False))
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True,
                                                            "fused": fused}}}
        engine, optimizer, *_ = deepspeed.initialize(model=model, config=config,
                                                     model_parameters=weight_decay_groups(model, 0.1))
        inner = getattr(optimizer, "optimizer", optimizer)
        assert inner.defaults["fused"] is fused
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        for _ in range(5):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            weights[fused] = [p.detach().clone() for p in engine.module.parameters()]
        engine.destroy()
    for foreach, fused in zip(weights[False], weights[True]):
        torch.testing.assert_close(fused, foreach, rtol=1e-6, atol=1e-6)
    torch.manual_seed(0)
    start = LlamaForCausalLM(engine.module.config).parameters()
    assert all((after - before).abs().max() > 1e-3 for before, after in zip(start, weights[True]))  # 5 real steps
