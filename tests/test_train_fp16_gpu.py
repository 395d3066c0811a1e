"""precision: fp16 on an NVIDIA GPU, where a resumed run must continue with the loss scale it saved.

Skipped, with the reason, without CUDA (CPU machines: DeepSpeed refuses fp16 there; the scaler's state round
trip is unit-tested in tests/training/planning/test_precision.py). Marked slow (three runs of a few steps).

The fp16 block starts the scale at 2^24 with hysteresis 2 and a window of 2 steps, so that the first steps
overflow and the scale moves before and after the resume; at ZeRO-0 (torch autocast) and ZeRO-1 (DeepSpeed's
fp16 optimizer), 3 steps + --resume to 6 must log the losses and loss scales of 6 steps in one go, and the same
overflow skips (metrics.jsonl's skip events, which carry no loss scale: reading them as steps failed this test on
its first GPU run, an H200).
"""
import json

import pytest
import torch

from tests.conftest import SMALL_MODEL, run_train

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="fp16 needs an NVIDIA GPU; torch.cuda.is_available() is False")]

FP16_BLOCK = ("deepspeed.overrides={fp16: {initial_scale_power: 24, hysteresis: 2, loss_scale_window: 2, "
              "min_loss_scale: 1}}")


@pytest.mark.parametrize("zero", ["zero0", "zero1"])
def test_resumed_fp16_run_continues_its_loss_scale(tmp_path, data_cache, zero):
    common = [SMALL_MODEL, data_cache, "precision=fp16", f"deepspeed.config={zero}", FP16_BLOCK,
              "training.schedule=constant", "training.warmup_steps=0", "logging.every_steps=1"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    runs = [(whole, ["training.max_steps=6"]), (parts, ["training.max_steps=3"]),
            (parts, ["--resume", "training.max_steps=6"])]
    for out, args in runs:
        result = run_train(["--recipe", "tiny_llama", "--output-dir", str(out), *args, *common], ranks=1)
        assert result.returncode == 0, result.stderr[-3000:]
    logged = {path: [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
              for path in (whole, parts)}
    steps = {path: [record for record in records if "event" not in record] for path, records in logged.items()}
    scales = [record["loss_scale"] for record in steps[whole]]
    assert len(set(scales)) > 1, f"the scale never moved, so the test proves nothing: {scales}"
    assert [r["loss_scale"] for r in steps[parts]] == scales
    assert [r["loss"] for r in steps[parts]] == pytest.approx([r["loss"] for r in steps[whole]], rel=1e-3)
    # an overflowing step is withheld and its batch logged as a skip event (training/loop/stability.py), alike
    skips = {path: [(r["step"], r["data_position"]) for r in records if r.get("event") == "skip"]
             for path, records in logged.items()}
    assert skips[parts] == skips[whole]
