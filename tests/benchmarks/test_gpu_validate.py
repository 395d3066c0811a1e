"""benchmarks/gpu_validate.py: its CPU smoke end to end (the tests, throughput and GRPO parts run and report; the
stages part's comparison is tools/compare_zero.py, which tests/tools/test_compare_zero.py runs, and its command line
here passes every check compare_zero.py makes before it launches), and the checks it makes of what the parts wrote:
a stage that departs from ZeRO-0 is named, a part past its budget is stopped."""
import csv
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, TRAIN_ENV

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_validate  # noqa: E402

sys.path.insert(0, str(REPO / "tools"))
import compare_zero  # noqa: E402

HEADER = "cell,status,tokens_per_s,final_loss,max_loss_diff,error"


@pytest.mark.slow
def test_the_cpu_smoke_runs_every_part_and_reports_it(tmp_path):
    out = tmp_path / "validate"
    # the default budgets are sized for the GPU run; on a busy 2-core CPU the smoke's stages took more than its 110 s
    budgets = ["--budget", "740", "--tests-budget", "240", "--throughput-budget", "300", "--grpo-budget", "200"]
    result = subprocess.run([sys.executable, "benchmarks/gpu_validate.py", "--smoke", "--output", str(out),
                             "--parts", "tests,throughput,grpo", *budgets],
                            cwd=REPO, env=TRAIN_ENV, capture_output=True, text=True, timeout=1100)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (out / "validate.md").read_text()
    for part in ("tests", "throughput", "grpo"):
        assert f"## {part}: passed" in report, report
    assert re.search(r"- data.packing=bfd: [\d,]+ tokens/s, generation [\d.]+ s per step", report)
    assert "0 failed" in report and "skipped test_resumed_fp16_run_continues_its_loss_scale[zero0]" in report
    ours, trainer = csv.DictReader((out / "throughput" / "results.csv").open())
    assert float(ours["tokens_per_s"]) > 0 and float(ours["planned_gib"]) > 0 and float(ours["plan_ratio"]) > 0
    # the HF Trainer's row arrives with its numbers, and train.py's row is divided by them
    assert trainer["runner"] == "HF Trainer" and trainer["compile"] == "off" and trainer["error"] == ""
    assert float(trainer["tokens_per_s"]) > 0 and float(trainer["first_step_s"]) > 0
    assert float(ours["vs_hf_trainer"]) == float(ours["vs_hf_defaults"]) == pytest.approx(
        float(ours["tokens_per_s"]) / float(trainer["tokens_per_s"]))
    assert "| HF Trainer | bf16 | off | 1 | off |" in report


@pytest.mark.parametrize("smoke", [["--smoke"], []], ids=["smoke", "gpu"])
def test_the_stages_part_passes_compare_zeros_checks(tmp_path, monkeypatch, smoke):
    """compare.py asks run_cell for a cell only once the cell passed train.py's checks (a refused one is a row with
    its error): every stage reaches it."""
    reached = []

    def not_launched(args, cell, output_dir):
        reached.append(cell)
        return "not launched by the test"

    monkeypatch.setattr(compare_zero.compare, "run_cell", not_launched)
    stages = next(part for part in gpu_validate.parts(gpu_validate.parse_args(["--output", str(tmp_path / "v"),
                                                                               *smoke]))
                  if part.name == "stages")
    assert stages.command[1] == "tools/compare_zero.py"
    compare_zero.main(stages.command[2:])
    expected = "0,1" if smoke else gpu_validate.STAGES
    assert reached == [[f"deepspeed.config=zero{stage}"] for stage in expected.split(",")]


def write_stages(folder, *rows: str) -> None:
    folder.mkdir()
    (folder / "comparison.csv").write_text("\n".join([HEADER, *rows]) + "\n")


def test_a_stage_whose_losses_depart_from_zero0_is_named(tmp_path):
    write_stages(tmp_path / "same", "deepspeed.config=zero0,ok,100,6.0,0.0,", "deepspeed.config=zero3,ok,90,6.0,3e-5,")
    write_stages(tmp_path / "apart", "deepspeed.config=zero0,ok,100,6.0,0.0,", "deepspeed.config=zero3,ok,90,6.0,1e-3,")
    write_stages(tmp_path / "failed", "deepspeed.config=zero0,ok,100,6.0,0.0,", "deepspeed.config=zero3,failed,,,,OOM")
    assert gpu_validate.stage_curves(tmp_path / "same").startswith("every stage equals ZeRO-0")
    apart = gpu_validate.stage_curves(tmp_path / "apart")
    assert apart.startswith("NOT every stage") and "zero3: max loss difference vs ZeRO-0 1.00e-03" in apart
    assert gpu_validate.stage_curves(tmp_path / "failed").startswith("NOT every stage")
    assert "did not finish" in gpu_validate.stage_curves(tmp_path / "missing")


@pytest.mark.slow
def test_a_part_past_its_budget_is_stopped_and_recorded(tmp_path):
    part = gpu_validate.Part("tests", 1, [sys.executable, "-c",
                                          "import time; print('started', flush=True); time.sleep(60)"])
    gpu_validate.run_part(part, 1.0, tmp_path / "tests.log")
    assert part.status == "stopped at its budget (1 s)" and part.seconds < 30
    assert "started" in (tmp_path / "tests.log").read_text()
