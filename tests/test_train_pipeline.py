"""Pipeline parallelism on 2 CPU ranks = 2 stages, against the same recipe without it (ZeRO-1 over 2
data-parallel ranks): the same global batches, so the same losses.

Tolerance, fp32: 1e-5 on losses near 8 over 6 steps. The stages compute the same layers on the same
batch; only the order of the final additions differs (measured: 1e-6 at most, weights after 4 steps
bitwise equal). The stages compute the plain loss (the fused loss is off under pipeline parallelism), so the
data-parallel runs here do too (fused_loss=false): the weights compare at 1e-6 only if both sides add the
gradients up the same way. The fused loss's own equality with the plain one is proved in
tests/training/models/test_fused_loss.py.
"""
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.conftest import SMALL_MODEL, run_train, save_small_checkpoint

pytestmark = pytest.mark.slow

TIED = SMALL_MODEL.replace("head_dim: 16}", "head_dim: 16, tie_word_embeddings: true}")
COMMON = ["--recipe", "tiny_llama", "precision=fp32", "deepspeed.config=zero1", "training.max_steps=6",
          "training.schedule=constant", "training.warmup_steps=0", "logging.every_steps=1", "data.eval.fraction=0.05",
          "training.eval_every_steps=3", "fused_loss=false"]


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama saved in several safetensors shards: each stage reads only its own tensors."""
    path = tmp_path_factory.mktemp("checkpoint")
    save_small_checkpoint(path, max_shard_size="300KB")
    assert len(list(path.glob("model-*.safetensors"))) > 1
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache, checkpoint) -> dict:
    """(model, variant) -> output dir; variant 1: ZeRO-1 on 2 data-parallel ranks, 2: 2 stages, "4 ranks":
    2 stages x 2 data-parallel ranks, "checkpointing": 2 stages with activation checkpointing, "zero0": 2 stages
    without ZeRO."""
    from_checkpoint = f"model.name_or_path={checkpoint}"
    plan = [("untied", 1, [SMALL_MODEL], 2), ("untied", 2, [SMALL_MODEL], 2), ("tied", 1, [TIED], 2),
            ("tied", 2, [TIED], 2), ("untied", "4 ranks", [SMALL_MODEL], 4),
            ("untied", "checkpointing", [SMALL_MODEL, "activation_checkpointing=true"], 2),
            ("untied", "zero0", [SMALL_MODEL, "deepspeed.config=zero0"], 2),
            ("checkpoint", 1, ["model.config=null", from_checkpoint], 2),
            ("checkpoint", 2, ["model.config=null", from_checkpoint], 2)]
    results = {}
    for name, variant, overrides, ranks in plan:
        out = tmp_path_factory.mktemp(f"{name}_{variant}".replace(" ", "_"))
        stages = 1 if variant == 1 else 2
        result = run_train([*COMMON, *overrides, data_cache, f"parallelism.pipeline_stages={stages}", "--output-dir",
                            str(out), "--record-logits"], ranks=ranks, script="tests/helpers/train_with_probes.py")
        assert result.returncode == 0, result.stderr[-3000:]
        (out / "stdout.txt").write_text(result.stdout)
        results[name, variant] = out
    return results


@pytest.mark.parametrize("name", ["untied", "tied", "checkpoint"])
def test_pipeline_tracks_the_data_parallel_run(runs, name):
    pipelined, plain = losses(runs[name, 2]), losses(runs[name, 1])
    assert len(pipelined) == 6
    assert pipelined[0] == pytest.approx(plain[0], abs=1e-6)  # same weights, same batch
    assert pipelined == pytest.approx(plain, abs=1e-5)
    summary = json.loads((runs[name, 2] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["ds_config"]["gradient_accumulation_steps"] == 2  # dp 1 x 2 micro


@pytest.mark.parametrize("name", ["untied", "tied", "checkpoint"])
def test_eval_loss_is_the_data_parallel_runs(runs, name):
    evaluated = [[r["eval_loss"] for r in map(json.loads, (runs[name, s] / "metrics.jsonl").read_text().splitlines())
                  if "eval_loss" in r] for s in (2, 1)]
    assert len(evaluated[0]) == 2 and evaluated[0] == pytest.approx(evaluated[1], abs=1e-5)


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_exported_folder_gives_the_pipeline_engines_logits(runs, name):
    recorded = torch.load(runs[name, 2] / "engine_logits.pt")
    model = AutoModelForCausalLM.from_pretrained(runs[name, 2] / "hf")
    with torch.no_grad():
        logits = model(input_ids=recorded["input_ids"], position_ids=recorded["position_ids"], use_cache=False).logits
    torch.testing.assert_close(logits, recorded["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_export_gives_the_trained_weights(runs, name):
    """hf/ of the pipeline run holds the weights the data-parallel run trained (whose export round trip
    tests/test_train_finetune.py checks), and from_pretrained gives the same logits from both."""
    pipelined, plain = (load_file(runs[name, s] / "hf" / "model.safetensors") for s in (2, 1))
    assert pipelined.keys() == plain.keys()
    for key in plain:
        torch.testing.assert_close(pipelined[key], plain[key], rtol=0, atol=1e-6)
    batch = torch.arange(1, 33)[None] * 37 % 4000
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(runs[name, s] / "hf")(input_ids=batch).logits for s in (2, 1)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)
    model = AutoModelForCausalLM.from_pretrained(runs[name, 2] / "hf")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (name == "tied")


@pytest.mark.parametrize("variant", ["4 ranks", "checkpointing", "zero0"])
def test_data_parallel_pipelines_and_activation_checkpointing_track_it_too(runs, variant):
    assert losses(runs["untied", variant]) == pytest.approx(losses(runs["untied", 1]), abs=1e-5)


def grad_norms(out) -> list[float]:
    return [json.loads(line)["grad_norm"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name, variant", [("untied", 2), ("tied", 2), ("untied", "zero0")])
def test_pipeline_reports_the_data_parallel_runs_gradient_norm(runs, name, variant):
    """The pre-clipping norm over both stages' gradients (the tied embedding counted once); at ZeRO-0 the pipeline
    engine reports none of its own, so train.py computes it."""
    assert grad_norms(runs[name, variant]) == pytest.approx(grad_norms(runs[name, 1]), rel=1e-4)


def test_pipeline_resume_continues_the_curve(runs, tmp_path, data_cache):
    out = tmp_path / "parts"
    args = [*COMMON, SMALL_MODEL, data_cache, "parallelism.pipeline_stages=2", "--output-dir", str(out)]
    assert run_train([*args, "training.max_steps=3"], ranks=2).returncode == 0
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    result = run_train([*args, "--resume"], ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(out) == pytest.approx(losses(runs["untied", 2]), abs=1e-6)
    (damaged / "checkpoints" / "global_step3" / "layer_01-model_states.pt").unlink()
    result = run_train([*args[:-1], str(damaged), "--resume"], ranks=2)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "global_step3 is damaged" in result.stderr and "layer_01-model_states.pt" in result.stderr


@pytest.mark.parametrize("model_type, tied", [("llama", False), ("llama", True), ("mistral", False), ("qwen2", False),
                                             ("qwen3", True)])
def test_each_family_as_a_pipeline_gives_the_models_loss(model_type, tied):
    """Same weights, same packed batch (two documents a row): the 2-stage pipeline's loss is the model's."""
    result = run_train([model_type, *(["tied"] if tied else [])], ranks=2, script="tests/helpers/pipeline_loss.py")
    assert result.returncode == 0, result.stderr[-3000:]
    values = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert values["pipeline"] == pytest.approx(values["transformers"], abs=1e-5)


def test_dry_run_plans_the_stages_deepspeed_builds(runs, monkeypatch, capsys):
    """--dry-run's layers per stage are those DeepSpeed's PipelineModule reports building."""
    import train
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.main([*COMMON, SMALL_MODEL, "parallelism.pipeline_stages=2", "--dry-run"]) == 0
    planned = re.findall(r"│ (\d) +│ +(\d+)-(\d+) │", capsys.readouterr().out)
    built = re.findall(r"stage=(\d) layers=(\d+)", (runs["untied", 2] / "stdout.txt").read_text())
    assert [(stage, int(end) - int(start) + 1) for stage, start, end in planned] == [(s, int(n)) for s, n in built]
