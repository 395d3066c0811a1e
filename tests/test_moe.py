"""Mixture of experts (training/models/moe.py) through the launcher on 2 CPU ranks, fp32: a shrunk Mixtral checkpoint
(2 layers, 4 experts, top-2) fine-tuned under ZeRO-1 and ZeRO-3.

- Under ZeRO-3, with the ranks routing their tokens to disjoint experts (a probe sends rank r's tokens to experts
  2r and 2r+1, so that each rank leaves half of the experts without a token), the run finishes (each launch has
  a time limit: a hang fails it) and gives the ZeRO-1 run's language-model and router losses under the same
  routing (1e-5 relative).
- metrics.jsonl logs the router's load-balancing loss apart (aux_loss), and `loss` is the language model's
  alone: with moe.aux_loss_coef=0 the first step's loss is the same, and no aux_loss is logged.
- The ZeRO-3 run's hf/ export loads as a Mixtral and gives the trained engine's logits.
- LoRA on the MoE model (peft's all-linear: attention, router and, as peft 0.21 does for fused 3-D experts,
  per-expert adapters) gives the same curve under ZeRO-1 and ZeRO-3.
"""
import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.conftest import REPO, run_train
from tests.test_parallelism import losses

pytestmark = pytest.mark.slow
STEPS = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    config = AutoConfig.for_model("mixtral", vocab_size=4096, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  num_local_experts=4, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory, data_cache):
    args = ["--recipe", "tiny_llama_sft", f"model.name_or_path={base}", data_cache, "precision=fp32",
            f"training.max_steps={STEPS}", "training.warmup_steps=0", "training.lr=3e-3", "logging.every_steps=1",
            "moe.aux_loss_coef=0.02", "training.eval_every_steps=null"]
    outputs = {}
    by_rank = ["--record-routing", "--route-by-rank"]
    for name, more in (("zero1", ["deepspeed.config=zero1", *by_rank]),
                       ("zero3", ["deepspeed.config=zero3", "--record-logits", *by_rank]),
                       ("no router loss", ["deepspeed.config=zero1", "moe.aux_loss_coef=0", "training.max_steps=1",
                                           *by_rank]),
                       *((f"lora {zero}", [f"deepspeed.config={zero}", "lora.enabled=true", "lora.rank=4",
                                           "training.lr=1e-2", *by_rank]) for zero in ("zero1", "zero3"))):
        out = outputs[name] = tmp_path_factory.mktemp(name.replace(" ", "_"))
        result = run_train(["--output-dir", str(out), *args, *more], ranks=2, timeout=300,
                           script="tests/helpers/train_with_probes.py")
        assert result.returncode == 0, result.stderr[-3000:]
    return outputs


def test_the_ranks_route_to_disjoint_experts(runs):
    picked = [json.loads((runs["zero3"] / f"routing_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert picked == [{"0": [0, 1], "1": [0, 1]}, {"0": [2, 3], "1": [2, 3]}]


def test_zero3_gives_the_zero1_curve(runs):
    curve = losses(runs["zero1"])
    assert len(curve) == STEPS and all(map(math.isfinite, curve))
    assert losses(runs["zero3"]) == pytest.approx(curve, rel=1e-5)
    assert losses(runs["zero3"], "aux_loss") == pytest.approx(losses(runs["zero1"], "aux_loss"), rel=1e-5)


def test_the_router_loss_is_logged_apart_from_the_language_model_loss(runs):
    aux = losses(runs["zero1"], "aux_loss")
    assert len(aux) == STEPS and all(a > 0 for a in aux)
    without = runs["no router loss"]
    assert losses(without, "aux_loss") == []
    assert losses(without)[0] == pytest.approx(losses(runs["zero1"])[0], rel=1e-6)  # the same weights at step 1


def test_the_zero3_export_loads_as_the_trained_model(runs):
    """The engine's logits were recorded on rank 0 with the probe's routing (experts 0 and 1): the exported model
    runs here under the same routing."""
    recorded = torch.load(runs["zero3"] / "engine_logits.pt")
    model = AutoModelForCausalLM.from_pretrained(runs["zero3"] / "hf", dtype=torch.float32).eval()
    assert type(model).__name__ == "MixtralForCausalLM"
    for router in (m for m in model.modules() if type(m).__name__ == "MixtralTopKRouter"):
        router.register_forward_hook(lambda module, inputs, output: (
            output[0], output[1], torch.arange(module.top_k).expand_as(output[2])))
    with torch.no_grad():
        logits = model(input_ids=recorded["input_ids"], position_ids=recorded["position_ids"], use_cache=False).logits
    torch.testing.assert_close(logits, recorded["logits"], atol=1e-5, rtol=1e-5)


def test_lora_on_experts_gives_the_same_curve_under_zero1_and_zero3(runs):
    curve = losses(runs["lora zero1"])
    assert len(curve) == STEPS and curve[-1] < curve[0]
    assert losses(runs["lora zero3"]) == pytest.approx(curve, rel=1e-5)
    adapters = json.loads((runs["lora zero3"] / "adapter" / "adapter_config.json").read_text())
    assert adapters["peft_type"] == "LORA"
