"""Self-healing runs on 2 CPU ranks (fp32): poisoned batches are inserted into the data at data position 12
(tests/helpers/train_with_probes.py: `nonfinite` makes one rank's embedding output infinite, `spike` multiplies
every rank's logits by 30, a finite loss about 4x the recent mean), so that a run reads the reference run's
batches with the poisoned one pushed in between.

With `skip`, the poisoned batch's step is not applied and the next batch is trained on instead: the curve is
the reference run's, step for step (measured: equal to the last digit under ZeRO-2 and ZeRO-0; ZeRO-3 against
the ZeRO-2 reference within summation order, tolerance 1e-5 relative). With the guard off, the same data
ruins the run (NaN at ZeRO-0) or bends its curve (a spike under ZeRO-2): the test bites.
"""
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import SMALL_MODEL, run_train, strict_loads
from training.base.strict_json import number

pytestmark = pytest.mark.slow

PROBES = "tests/helpers/train_with_probes.py"
STEPS, POISONED = 20, 12
DETECTOR = ["stability.min_history=5", "stability.window=8"]  # armed within a short run
RUNS = {  # name: (probe spec, ds_config, more overrides)
    "reference": (None, "zero2", []),
    "nonfinite on rank 1, ZeRO-2": (f"nonfinite:{POISONED}:1", "zero2", []),
    "nonfinite on rank 1, ZeRO-0": (f"nonfinite:{POISONED}:1", "zero0", []),
    "spike, ZeRO-3": (f"spike:{POISONED}", "zero3", []),
    "spike, ZeRO-3, rewind": (f"spike:{POISONED + 1}", "zero3",
                              ["stability.policy=rewind", "checkpointing.every_steps=4"]),
    "nonfinite, ZeRO-0, guard off": (f"nonfinite:{POISONED}:1", "zero0", ["stability.enabled=false"]),
    "spike, ZeRO-2, guard off": (f"spike:{POISONED}", "zero2", ["stability.enabled=false"]),
    "3 nonfinite in a row, ZeRO-2": (f"nonfinite:{POISONED},{POISONED + 1},{POISONED + 2}:1", "zero2",
                                      ["stability.max_skips=3", "checkpointing.every_steps=4"]),
}


def lines(out: Path) -> list[dict]:
    """metrics.jsonl, read as strictly as jq does (a NaN loss is the text "nan": strict_json)."""
    return [strict_loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [number(record["loss"]) for record in lines(out) if "event" not in record]


def events(out: Path) -> list[dict]:
    return [record for record in lines(out) if "event" in record]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    results = {}
    for name, (probe, ds_config, overrides) in RUNS.items():
        out = tmp_path_factory.mktemp("run")
        args = ["--output-dir", str(out), "--recipe", "tiny_llama", SMALL_MODEL, data_cache, "precision=fp32",
                f"training.max_steps={STEPS}", "logging.every_steps=1", f"deepspeed.config={ds_config}", *DETECTOR,
                *overrides]
        probe_args = ["--insert-poisoned-batches", probe] if probe else []
        results[name] = (out, run_train(probe_args + args, ranks=2, script=PROBES if probe else "train.py"))
    return results


@pytest.mark.parametrize("name, tolerance", [
    ("nonfinite on rank 1, ZeRO-2", 1e-6),
    ("nonfinite on rank 1, ZeRO-0", 1e-6),
    ("spike, ZeRO-3", 1e-5),
])
def test_a_skipped_batch_is_the_only_difference(runs, name, tolerance):
    out, result = runs[name]
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert losses(out) == pytest.approx(losses(runs["reference"][0]), rel=tolerance)
    (event,) = events(out)
    reason = "loss_spike" if "spike" in name else "nonfinite_loss"
    assert (event["event"], event["step"], event["data_position"], event["reason"]) == ("skip", POISONED + 1, POISONED,
                                                                                         reason)
    summary = strict_loads((out / "summary.json").read_text())
    assert summary["stability"]["skip"] == 1 and summary["stability"]["events"] == [event]
    assert summary["steps"] == STEPS and summary["tokens_seen"] == json.loads(
        (runs["reference"][0] / "summary.json").read_text())["tokens_seen"]  # the skipped batch is not counted


def test_the_reference_run_has_no_events_and_reports_its_weights(runs):
    out, result = runs["reference"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert not events(out)
    last = lines(out)[-1]
    assert last["param_norm"] > 0 and 0 < last["update_ratio"] < 0.1


def test_a_rewind_goes_back_to_the_checkpoint_and_past_the_spike(runs):
    out, result = runs["spike, ZeRO-3, rewind"]
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (event,) = events(out)
    assert (event["event"], event["step"], event["reason"], event["rewound_to"]) == ("rewind", POISONED + 2,
                                                                                   "loss_spike", POISONED)
    assert event["batches_passed_over"] == 2  # the one after the checkpoint and the spike's
    steps = [record["step"] for record in lines(out) if "event" not in record]
    assert steps == list(range(1, STEPS + 1))  # the steps after the checkpoint were rewritten, once each
    reference = losses(runs["reference"][0])
    assert losses(out)[:POISONED] == pytest.approx(reference[:POISONED], rel=1e-5)
    assert math.isfinite(losses(out)[-1])
    weights = load_file(out / "hf" / "model.safetensors")
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())


def test_without_the_guard_the_same_data_ruins_the_run(runs):
    out, result = runs["nonfinite, ZeRO-0, guard off"]
    assert result.returncode == 0 and math.isnan(losses(out)[-1]) and not events(out)
    assert strict_loads((out / "summary.json").read_text())["final_loss"] == "nan"
    out, result = runs["spike, ZeRO-2, guard off"]
    assert result.returncode == 0
    curve, reference = losses(out), losses(runs["reference"][0])
    assert curve[POISONED] > 3 * reference[POISONED]  # the spike was trained on
    assert abs(curve[-1] - reference[-1]) > 1e-2


def test_repeated_skips_save_and_stop_with_exit_3_and_resume_goes_on(runs, data_cache):
    out, result = runs["3 nonfinite in a row, ZeRO-2"]
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-3000:]
    assert (f"stopped by the stability guard after step {POISONED} of {STEPS}: 3 batches skipped within 100 steps "
            f"(stability.max_skips)") in result.stderr
    assert [e["event"] for e in events(out)] == ["skip", "skip", "stop"]
    run_state = json.loads((out / "checkpoints" / f"global_step{POISONED}" / "run_state.json").read_text())
    assert (run_state["step"], run_state["data_position"]) == (POISONED, POISONED + 3)
    probe, ds_config, overrides = RUNS["3 nonfinite in a row, ZeRO-2"]
    resumed = run_train(["--insert-poisoned-batches", probe, "--output-dir", str(out), "--resume", "--recipe",
                         "tiny_llama", SMALL_MODEL, data_cache, "precision=fp32", f"training.max_steps={STEPS}",
                         "logging.every_steps=1", f"deepspeed.config={ds_config}", *DETECTOR, *overrides],
                        ranks=2, script=PROBES)  # the same data, poisoned batches included
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(out) == pytest.approx(losses(runs["reference"][0]), rel=1e-6)  # past the poison, on the same data
