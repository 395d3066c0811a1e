"""precision: fp8 on a GPU with FP8 tensor cores (compute capability 8.9+: H100, H200, L4, L40S, B200).

Skipped, with the reason, everywhere else (CPU machines, older GPUs); marked slow (launcher runs).
On such a GPU: `python -m pytest tests/test_train_fp8_gpu.py -rs` (a few minutes).

The model is tiny_llama widened to 8 layers x 512 (8 heads of 64, 4 KV heads, MLP 1536; ~29M parameters),
seq_len 512, 8 rows per step, 1 GPU through the `deepspeed` launcher, ZeRO-1, the same seed and data for
bf16 and fp8. Its 56 decoder linear layers run in FP8 (tensorwise scaling); the LM head stays bf16.

Tolerance of the loss-curve comparison (300 steps, every step logged): the mean |fp8 loss - bf16 loss|
over the last 50 logged steps < 0.05 (nats), and the final losses within 2% of the bf16 one. FP8 matmuls
change the numbers of every step, so the curves must also differ somewhere (they are not the same run).
"""
import json
import math

import pytest
import torch

from tests.conftest import run_train

FP8_CAPABILITY = (8, 9)


def fp8_gpu() -> tuple[bool, str]:
    """Whether this machine has a GPU that computes FP8, and if not why."""
    if not torch.cuda.is_available():
        return False, "needs an NVIDIA GPU with FP8 (compute capability 8.9+); torch.cuda.is_available() is False"
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        return False, (f"needs compute capability 8.9+ for FP8 matmuls; {torch.cuda.get_device_name()} has "
                       f"{capability[0]}.{capability[1]}")
    return True, ""


HAS_FP8_GPU, NO_FP8_GPU = fp8_gpu()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_FP8_GPU, reason=NO_FP8_GPU)]

MODEL = ("model.config_overrides={num_hidden_layers: 8, hidden_size: 512, intermediate_size: 1536, "
         "num_attention_heads: 8, num_key_value_heads: 4, head_dim: 64}")
LAYERS = 8
COMMON = [MODEL, "data.seq_len=512", "training.micro_batch_size=8", "training.global_batch_size=8",
          "training.lr=1.0e-3", "training.warmup_steps=20", "deepspeed.config=zero1", "checkpointing.every_steps=null",
          "logging.every_steps=1"]
STEPS, LAST_LOGGED, MEAN_ABS_DIFF, FINAL_REL_DIFF = 300, 50, 0.05, 0.02


def peak_overrides() -> list[str]:
    """MFU needs the GPU's bf16 peak: training/planning/flops.py's table knows H100/H200/L4/L40S/B200; another FP8 GPU
    gets a stated one, so that the mfu key is checked everywhere."""
    from training.planning.flops import peak_tflops
    return [] if peak_tflops(torch.cuda.get_device_name()) else ["logging.peak_tflops=100"]


def records(out) -> list[dict]:
    """metrics.jsonl's step records, without the stability guard's events (a skipped batch, a spike)."""
    return [record for record in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "event" not in record and "loss" in record]


@pytest.fixture(scope="module")
def bf16_and_fp8(tmp_path_factory, data_cache) -> dict:
    """The same 300 steps in bf16 and in fp8: {precision: (output dir, launcher stdout)}."""
    runs = {}
    for precision in ("bf16", "fp8"):
        out = tmp_path_factory.mktemp(f"run_{precision}")
        result = run_train(["--recipe", "tiny_llama", "--output-dir", str(out), "--overwrite", data_cache, *COMMON,
                            *peak_overrides(), f"training.max_steps={STEPS}", f"precision={precision}"],
                           ranks=1, timeout=1800)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[precision] = out, result.stdout
    return runs


def test_fp8_loss_curve_tracks_bf16(bf16_and_fp8):
    (bf16_out, _), (fp8_out, _) = bf16_and_fp8["bf16"], bf16_and_fp8["fp8"]
    # q, k, v, o, gate, up, down of every layer compute in FP8, counted on the model: FP8 silently off shows 0
    assert json.loads((fp8_out / "summary.json").read_text())["kernels"]["fp8_linear_layers"] == LAYERS * 7
    bf16, fp8 = records(bf16_out), records(fp8_out)
    assert [r["step"] for r in bf16] == [r["step"] for r in fp8] == list(range(1, STEPS + 1))
    bf16_loss, fp8_loss = [r["loss"] for r in bf16], [r["loss"] for r in fp8]
    assert all(map(math.isfinite, fp8_loss))
    assert fp8_loss != bf16_loss, "the fp8 run gave bf16's losses exactly: were its matmuls FP8?"
    assert fp8_loss[-1] < fp8_loss[0] - 2  # it learns
    diffs = [abs(a - b) for a, b in zip(fp8_loss[-LAST_LOGGED:], bf16_loss[-LAST_LOGGED:])]
    assert sum(diffs) / len(diffs) < MEAN_ABS_DIFF, (f"mean |diff| over the last {LAST_LOGGED} steps: "
                                                     f"{sum(diffs) / len(diffs):.4f}")
    assert abs(fp8_loss[-1] - bf16_loss[-1]) < FINAL_REL_DIFF * bf16_loss[-1], (fp8_loss[-1], bf16_loss[-1])


def test_gpu_summary_reports_tflops_and_mfu(bf16_and_fp8):
    from training.planning.flops import peak_tflops
    peak = peak_tflops(torch.cuda.get_device_name()) or 100.0
    for precision, (out, _) in bf16_and_fp8.items():
        summary = json.loads((out / "summary.json").read_text())
        assert summary["precision"] == precision
        assert {"mean_tokens_per_s", "tflops", "hardware_tflops", "mfu", "peak_mem_bytes",
                "peak_mem_reserved_bytes"} <= set(summary), sorted(summary)
        assert summary["tflops"] > 0 and summary["hardware_tflops"] == pytest.approx(summary["tflops"])  # no recompute
        assert summary["mfu"] == pytest.approx(summary["tflops"] / peak) and 0 < summary["mfu"] < 1
        assert summary["peak_mem_reserved_bytes"] >= summary["peak_mem_bytes"] > 0
        assert {"tflops", "mfu", "peak_mem_reserved_bytes"} <= set(records(out)[-1])


def test_fp8_zero3_with_activation_checkpointing_exports_hf(tmp_path, data_cache):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    args = ["--recipe", "tiny_llama", "--output-dir", str(out), data_cache, *COMMON, *peak_overrides(),
            "training.max_steps=30", "precision=fp8", "deepspeed.config=zero3", "activation_checkpointing=true",
            "logging.every_steps=5"]
    result = run_train(args, ranks=1, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kernels"]["fp8_linear_layers"] == LAYERS * 7
    assert (summary["precision"], summary["zero_stage"], summary["activation_checkpointing"]) == ("fp8", 3, True)
    assert all(math.isfinite(r["loss"]) for r in records(out)) and math.isfinite(summary["final_loss"])
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["hardware_tflops"] > summary["tflops"] > 0  # the recomputed forward counts as hardware FLOPs
    # hf/ holds plain Linear weights (Float8Linear keeps the names), gathered from the ZeRO-3 partitions
    model, info = AutoModelForCausalLM.from_pretrained(out / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.num_hidden_layers == LAYERS and model.dtype == torch.bfloat16
    assert all(p.abs().sum() > 0 for p in model.parameters())
    model = model.cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 100, 200, 300]], device="cuda")).logits
    assert torch.isfinite(logits).all()
