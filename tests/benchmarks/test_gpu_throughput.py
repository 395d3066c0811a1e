"""benchmarks/gpu_throughput.py's run selection and the ratios and verdicts of its table, on made-up summaries (the
runs themselves are the slow smoke in test_gpu_validate.py)."""
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_throughput  # noqa: E402
from gpu_throughput import Result, Run, rows, select_runs  # noqa: E402


def names(only: str) -> list[str]:
    return [run.name for run in select_runs(only)]


def test_a_name_selects_its_run_and_a_pattern_every_run_with_its_tokens():
    assert names("bf16-noac-zero1") == ["bf16-noac-zero1"]  # train.py, eager: not its compiled or HF twins
    assert names("hf-bf16-noac-zero1-compile") == ["hf-bf16-noac-zero1-compile"]
    assert names("noac-zero1") == ["bf16-noac-zero1", "fp8-noac-zero1", "hf-bf16-noac-zero1", "bf16-noac-zero1-compile",
                                   "fp8-noac-zero1-compile", "hf-bf16-noac-zero1-compile"]
    assert len(names("train-eager")) == 8 and all(not name.startswith("hf") for name in names("train-eager"))
    assert len(names("hf")) == 8 and len(names("fp8")) == 8 and len(select_runs(None)) == 24
    with pytest.raises(ValueError, match="unknown token"):
        select_runs("bf16-noac-zero2")


def result(name: str, tokens_per_s: float | None, **summary) -> Result:
    run = next(run for run in gpu_throughput.ALL_RUNS if run.name == name)
    if tokens_per_s is None:
        return Result(run, error="exit 1: out of memory")
    return Result(run, {"mean_tokens_per_s": tokens_per_s, **summary})


def test_each_train_py_run_is_divided_by_its_hf_twin_and_by_the_trainer_defaults():
    table = {(row["runner"], row["precision"], row["compile"]): row for row in rows([
        result("bf16-noac-zero1", 130.0, mfu=0.5), result("fp8-noac-zero1", 150.0),
        result("hf-bf16-noac-zero1", 100.0, first_step_s=1.5),
        result("bf16-noac-zero1-compile", 260.0, mfu=0.5), result("fp8-noac-zero1-compile", 390.0),
        result("hf-bf16-noac-zero1-compile", 250.0, first_step_s=40.0)])}
    eager, compiled = table["train.py", "bf16", "off"], table["train.py", "bf16", "on"]
    assert eager["vs_hf_trainer"] == eager["vs_hf_defaults"] == pytest.approx(1.3)
    assert compiled["vs_hf_trainer"] == pytest.approx(260 / 250) and compiled["vs_hf_defaults"] == pytest.approx(2.6)
    fp8 = table["train.py", "fp8", "on"]
    assert fp8["fp8_speedup"] == pytest.approx(1.5)  # against the compiled bf16 run, not the eager one
    assert fp8["vs_hf_trainer"] is None and fp8["vs_hf_defaults"] == pytest.approx(3.9)  # no HF fp8 run
    assert compiled["target"] == "MFU >= 45%: met; >= 1.3x HF defaults: met"
    assert table["train.py", "fp8", "off"]["target"] == ">= 1.25x bf16: NOT met; >= 1.3x HF defaults: met"
    hf = table["HF Trainer", "bf16", "on"]
    assert hf["vs_hf_trainer"] is None and hf["vs_hf_defaults"] is None and hf["target"] is None
    assert hf["first_step_s"] == 40.0


def test_a_failed_or_missing_trainer_run_leaves_the_ratio_empty_and_says_why():
    table = rows([result("bf16-noac-zero3", 130.0), result("hf-bf16-noac-zero3", None), result("bf16-ac-zero3", 90.0)])
    assert table[0]["vs_hf_trainer"] is None and table[0]["vs_hf_defaults"] is None
    assert table[0]["target"].endswith(">= 1.3x HF defaults: no HF Trainer run to compare with")
    assert table[1]["error"] == "exit 1: out of memory" and table[2]["vs_hf_defaults"] is None


def test_overrides_that_a_run_name_sets_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_throughput.py", "--allow-cpu", "compile=true"])
    with pytest.raises(SystemExit) as exit_info:
        gpu_throughput.main()
    assert exit_info.value.code == 2
    assert "compile=true: each run's name sets precision, activation_checkpointing, deepspeed.config, compile" in \
        capsys.readouterr().err


def test_run_names_round_trip_through_their_tokens():
    for run in gpu_throughput.ALL_RUNS:
        assert select_runs(run.name) == [run]
        assert run.trainer_defaults == Run("bf16", run.checkpointing, run.zero, compiled=False, trainer=True)
