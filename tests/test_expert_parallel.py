"""Expert parallelism (training/parallel/expert_parallel.py) through the launcher on CPU ranks, fp32: shrunk Mixtral and
Qwen3-MoE checkpoints (2 layers, 4 experts, top-2) fine-tuned with the router's loss on, with and without AutoEP.

- parallelism.expert_parallel=2 gives the ZeRO-1 data-parallel run's per-step losses, router losses, gradient norms
  and parameter norms (1e-5 relative) and the same tokens per expert, for both families on 2 ranks, and under ZeRO-2
  with a routing that sends all of each rank's tokens to the other rank's experts (a probe: rank r's tokens go to
  experts of rank r+1); expert_parallel=4 on 4 ranks (one expert per rank) gives the 4-rank data-parallel run's.
- The hf/ export loads as the original model class (both families) and gives the trained engine's logits; `python -m
  training export` of the final checkpoint writes the same weights.
- A run killed (SIGKILL) while saving its step-3 checkpoint resumes from step 2 in its layout, and through a universal
  checkpoint on 4 ranks at ZeRO-2 with expert_parallel=4, and gives the uninterrupted run's curve; resuming it without
  expert parallelism is refused before anything is built, with the way out.
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.conftest import REPO, run_train
from tests.test_parallelism import losses

pytestmark = pytest.mark.slow
STEPS = 3
FAMILIES = {
    "mixtral": {"num_local_experts": 4},
    "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": []},
}


def save_moe_checkpoint(path, family: str) -> None:
    config = AutoConfig.for_model(family, vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
                                  bos_token_id=1, eos_token_id=2, **FAMILIES[family])
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer").save_pretrained(path)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    paths = {family: tmp_path_factory.mktemp(family) for family in FAMILIES}
    for family, path in paths.items():
        save_moe_checkpoint(path, family)
    return paths


def common(base, data_cache) -> list[str]:
    return ["--recipe", "tiny_llama_sft", f"model.name_or_path={base}", data_cache, "precision=fp32",
            f"training.max_steps={STEPS}", "training.warmup_steps=0", "training.lr=3e-3", "logging.every_steps=1",
            "moe.aux_loss_coef=0.02", "training.eval_every_steps=null", "training.micro_batch_size=2",
            "training.global_batch_size=8", "checkpointing.every_steps=2"]


RUNS = {  # name: (family, ranks, options)
    "dp": ("mixtral", 2, ["deepspeed.config=zero1"]),
    "ep": ("mixtral", 2, ["deepspeed.config=zero1", "parallelism.expert_parallel=2", "--record-logits"]),
    "dp across": ("mixtral", 2, ["deepspeed.config=zero1", "--record-routing", "--route-across"]),
    "ep across": ("mixtral", 2, ["deepspeed.config=zero2", "parallelism.expert_parallel=2", "--record-routing",
                                 "--route-across"]),
    "qwen dp": ("qwen3_moe", 2, ["deepspeed.config=zero1"]),
    "qwen ep": ("qwen3_moe", 2, ["deepspeed.config=zero1", "parallelism.expert_parallel=2", "--record-logits"]),
    "dp 4 ranks": ("mixtral", 4, ["deepspeed.config=zero1"]),
    "ep 4 ranks": ("mixtral", 4, ["deepspeed.config=zero2", "parallelism.expert_parallel=4"]),
}


@pytest.fixture(scope="module")
def runs(bases, tmp_path_factory, data_cache):
    outputs = {}
    for name, (family, ranks, options) in RUNS.items():
        out = outputs[name] = tmp_path_factory.mktemp(name.replace(" ", "_"))
        result = run_train(["--output-dir", str(out), *common(bases[family], data_cache), *options], ranks=ranks,
                           timeout=300, script="tests/helpers/train_with_probes.py")
        assert result.returncode == 0, result.stderr[-3000:]
    return outputs


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("reference, run", [("dp", "ep"), ("dp across", "ep across"), ("qwen dp", "qwen ep"),
                                            ("dp 4 ranks", "ep 4 ranks")])
def test_expert_parallel_gives_the_data_parallel_run(runs, reference, run):
    expected, got = records(runs[reference]), records(runs[run])
    assert len(got) == STEPS and all(r["aux_loss"] > 0 for r in got)
    for key in ("loss", "aux_loss", "grad_norm", "param_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in expected], rel=1e-5), key
    assert [r["expert_tokens"] for r in got] == [r["expert_tokens"] for r in expected]


def test_the_routing_sends_every_token_to_the_other_ranks_experts(runs):
    picked = [json.loads((runs["ep across"] / f"routing_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert picked == [{"0": [2, 3], "1": [2, 3]}, {"0": [0, 1], "1": [0, 1]}]  # under EP rank 0 holds experts 0 and 1
    tokens = records(runs["ep across"])[0]["expert_tokens"]
    assert all(layer[0] == layer[2] > 0 and layer[1] == layer[3] > 0 for layer in tokens)


def test_the_expert_load_is_logged_per_layer(runs):
    record = records(runs["ep"])[0]
    assert len(record["expert_tokens"]) == 2 and all(len(layer) == 4 for layer in record["expert_tokens"])
    # every token of the step's 8 rows is sent to 2 experts in each layer
    assert {sum(layer) for layer in record["expert_tokens"]} == {2 * 8 * 256}
    assert 1 <= record["expert_load_max"] <= 2


@pytest.mark.parametrize("run, model_class", [("ep", "MixtralForCausalLM"), ("qwen ep", "Qwen3MoeForCausalLM")])
def test_the_export_loads_as_the_original_model_with_the_engines_logits(runs, run, model_class):
    recorded = torch.load(runs[run] / "engine_logits.pt")
    model = AutoModelForCausalLM.from_pretrained(runs[run] / "hf", dtype=torch.float32).eval()
    assert type(model).__name__ == model_class
    with torch.no_grad():
        logits = model(input_ids=recorded["input_ids"], position_ids=recorded["position_ids"], use_cache=False).logits
    torch.testing.assert_close(logits, recorded["logits"], atol=1e-5, rtol=1e-5)


def test_the_checkpoint_exports_as_the_hf_folder(runs, tmp_path):
    from training.__main__ import main
    assert main(["export", str(runs["ep"] / "checkpoints"), str(tmp_path / "out")]) == 0
    exported, final = (load_file(tmp_path / "out" / "model.safetensors"),
                       load_file(runs["ep"] / "hf" / "model.safetensors"))
    assert exported.keys() == final.keys()
    for name, tensor in final.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0)


def test_a_killed_run_resumes_in_its_layout_and_on_other_ranks(runs, bases, data_cache, tmp_path):
    """Killed while saving step 3: resumed from step 2 in its layout, and (a copy) through a universal checkpoint on 4
    ranks at ZeRO-2 with the experts split 4 ways, both give the uninterrupted run's curve and expert counts; resuming
    without expert parallelism is refused before anything is built."""
    killed_dir, moved_dir = tmp_path / "killed", tmp_path / "moved"
    run = [*common(bases["mixtral"], data_cache), *RUNS["ep"][2][:2]]
    killed = run_train(["--kill-after-deepspeed-save", "3", "--output-dir", str(killed_dir), *run], ranks=2,
                       timeout=300, script="tests/helpers/train_with_probes.py")  # step 3's save: the last
    assert killed.returncode != 0 and (killed_dir / "checkpoints" / "latest").read_text() == "global_step2"
    refused = run_train(["--output-dir", str(killed_dir), *run[:-1], "parallelism.expert_parallel=1", "--resume"],
                        ranks=2, timeout=300)
    assert refused.returncode == 2
    assert "expert_parallel 2 -> 1" in refused.stderr and "parallelism.expert_parallel=2" in refused.stderr
    shutil.copytree(killed_dir, moved_dir)
    for out, ranks, more in ((killed_dir, 2, []),
                             (moved_dir, 4, ["deepspeed.config=zero2", "parallelism.expert_parallel=4"])):
        resumed = run_train(["--output-dir", str(out), *run, *more, "--resume"], ranks=ranks, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert losses(out) == pytest.approx(losses(runs["ep"]), rel=1e-5)
        assert losses(out, "expert_tokens") == losses(runs["ep"], "expert_tokens")
    assert (moved_dir / "checkpoints" / "universal").is_dir()
