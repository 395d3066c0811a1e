"""FP8 on a machine without FP8 hardware: the refusals, the DeepSpeed config and the layer conversion (torchao's
float8 matmuls also run on PyTorch's CPU backend, so the converted model's numbers are checked here too)."""
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import train
from tests.conftest import SMALL_MODEL, run_train
from training.base.errors import ConfigError
from training.config.recipe import load_recipe
from training.config.sections import Fp8Section
from training.models.fp8 import convert_linears_to_fp8
from training.planning import precision
from training.planning.ds_config import load_ds_config, resolve_ds_config


def test_fp8_is_refused_without_a_gpu(capsys):
    assert train.main(["--recipe", "tiny_llama", "--dry-run", "precision=fp8"]) == 2
    error = capsys.readouterr().err
    assert "precision=fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (H100, H200, L4, L40S, B200)" in error
    assert "found no GPU (DeepSpeed's cpu accelerator)" in error


def test_fp8_is_refused_on_a_gpu_without_fp8(monkeypatch):
    monkeypatch.setattr(precision.get_accelerator(), "device_name", lambda *args: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError,
                       match=r"found NVIDIA A100-SXM4-80GB \(compute capability 8.0\). Use precision=bf16"):
        precision.check_fp8_hardware()


def test_fp8_with_zero0_is_refused(monkeypatch, capsys):
    monkeypatch.setattr("training.planning.precision.check_fp8_hardware", lambda: None)  # as on an H100
    assert train.main(["--recipe", "tiny_llama", "--dry-run", "precision=fp8", "deepspeed.config=zero0"]) == 2
    assert "precision=fp8 with ZeRO-0 (zero0.json)" in capsys.readouterr().err


def test_fp8_plan_for_gpus(capsys):
    assert train.main(["--recipe", "tiny_llama", "--dry-run", "--num-gpus", "8", "--gpu-mem", "80", "precision=fp8",
                       "training.global_batch_size=64", "deepspeed.config=zero3"]) == 0
    assert "precision fp8" in capsys.readouterr().out


@pytest.mark.parametrize("stage", [1, 3])
def test_fp8_runs_deepspeeds_bf16_path(stage):
    recipe = load_recipe("tiny_llama", ["precision=fp8", f"deepspeed.config=zero{stage}"])
    raw, path = load_ds_config(recipe)
    config = resolve_ds_config(raw, path, recipe, 256, 1, "fp8")
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert config["data_types"]["grad_accum_dtype"] == "fp32"


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained("recipes/tiny_llama/config.json")
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def test_linear_layers_become_fp8_and_the_lm_head_stays_bf16():
    from torchao.float8.float8_linear import Float8Linear
    model = tiny_model()
    converted = convert_linears_to_fp8(model, Fp8Section(exclude=["model.layers.0.*"]), vocab_size=4096)
    assert len(converted) == 3 * 7  # q, k, v, o, gate, up, down in layers 1-3
    assert "model.layers.1.mlp.down_proj" in converted and "lm_head" not in converted
    assert isinstance(model.model.layers[3].self_attn.q_proj, Float8Linear)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert type(model.lm_head) is torch.nn.Linear
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the weights stay bf16
    assert "model.layers.1.mlp.down_proj.weight" in model.state_dict()  # same names: checkpoints and export unchanged


@pytest.mark.slow
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_model_loss_and_gradients_track_bf16(scaling):
    reference, model = tiny_model(), tiny_model()
    convert_linears_to_fp8(model, Fp8Section(recipe=scaling), vocab_size=4096)
    input_ids = torch.randint(0, 4096, (2, 128), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (reference, model):
        loss = m(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-3)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        cosine = torch.nn.functional.cosine_similarity(p.grad.flatten().float(), q.grad.flatten().float(), dim=0)
        assert cosine > 0.98, name


def losses(run_dir) -> list[float]:
    return [record["loss"] for record in map(json.loads, (run_dir / "metrics.jsonl").open())]


@pytest.mark.slow
def test_fp8_trains_through_deepspeed_zero_stages_with_checkpointing(tmp_path, data_cache):
    """The whole FP8 path on 2 CPU ranks (the hardware check switched off: torchao's FP8 matmuls run on the
    CPU too): ZeRO-1, and ZeRO-3 with activation checkpointing, track the bf16 run within 1% per step over
    8 steps, and the exported hf/ is a plain bf16 model."""
    common = ["--recipe", "tiny_llama", SMALL_MODEL, data_cache, "training.max_steps=8", "training.warmup_steps=1",
              "logging.every_steps=1"]
    runs = {"bf16": ["precision=bf16", "deepspeed.config=zero1"],
            "fp8": ["precision=fp8", "deepspeed.config=zero1"],
            "fp8_zero3_ckpt": ["precision=fp8", "deepspeed.config=zero3", "activation_checkpointing=true"]}
    for name, args in runs.items():
        result = run_train([*common, "--output-dir", str(tmp_path / name), *args], ranks=2,
                           script="tests/helpers/train_fp8_on_cpu.py")
        assert result.returncode == 0, result.stderr[-3000:]
        if name != "bf16":  # 2 layers x 7, counted on the model; lm_head stays bf16
            assert json.loads((tmp_path / name / "summary.json").read_text())["kernels"]["fp8_linear_layers"] == 14
            assert "14 linear layers in FP8 (tensorwise)" in result.stdout
    reference = losses(tmp_path / "bf16")
    for name in ("fp8", "fp8_zero3_ckpt"):
        assert losses(tmp_path / name) == pytest.approx(reference, rel=1e-2)
        assert losses(tmp_path / name) != reference  # FP8 matmuls did run
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8_zero3_ckpt" / "hf")
    assert type(exported.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert exported.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
