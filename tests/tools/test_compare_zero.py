"""tools/compare_zero.py (compare.py's short form for ZeRO stages) on 2 CPU ranks: every stage, one table, one CSV,
one picture; compare.py's grid of --vary values. The cells run on the session's warm ranks (the comparison is the
subject; tests/tools/test_compare.py's slow test and gpu_validate's smoke launch theirs through the real launcher)."""
import csv
import sys

import pytest

from tests.conftest import REPO, SMALL_MODEL, run_train

sys.path.insert(0, str(REPO / "tools"))
import compare_zero  # noqa: E402


def read_rows(output_dir):
    with (output_dir / "comparison.csv").open() as file:
        return {row["cell"].removeprefix("deepspeed.config=zero"): row for row in csv.DictReader(file)}


@pytest.fixture
def warm_cells(monkeypatch):
    """compare.run_cell on the warm ranks: train.py's arguments and the cell's log and error as compare.py's own."""
    compare = compare_zero.compare

    def run_warm(args, cell, output_dir):
        result = run_train(compare.train_args(args, cell, output_dir), ranks=args.num_gpus)
        log_path = compare.cell_log(args, cell, output_dir)
        log_path.write_text(result.stdout + result.stderr)
        return compare.cell_error(result.returncode, log_path)

    monkeypatch.setattr(compare, "run_cell", run_warm)


@pytest.mark.slow
def test_compare_stages_on_tiny_llama(tmp_path, data_cache, monkeypatch, warm_cells):
    """Losses agree across ZeRO 0-3, ZeRO-3 holds less model state per rank than ZeRO-0, each stage's measured model
    states are its estimate within 5% (fp32, AdamW; ZeRO-1 in tests/test_optimizers.py), and a stage that fails (here
    ZeRO-1, made to fail as an out-of-memory run would) is a row with its error while the others run."""
    launch = compare_zero.compare.run_cell

    def run_or_fail(args, cell, output_dir):
        if cell == ["deepspeed.config=zero1"]:
            return "exit 1: torch.OutOfMemoryError: (made to fail by the test)"
        return launch(args, cell, output_dir)

    monkeypatch.setattr(compare_zero.compare, "run_cell", run_or_fail)
    out = tmp_path / "compare"
    assert compare_zero.main(["--recipe", "tiny_llama", "--stages", "0,1,2,3", "--num-gpus", "2", "--steps", "4",
                              "--output-dir", str(out), SMALL_MODEL, data_cache, "training.warmup_steps=1"]) == 0
    rows = read_rows(out)
    assert [rows[stage]["status"] for stage in "0123"] == ["ok", "failed", "ok", "ok"]
    assert "OutOfMemoryError" in rows["1"]["error"]
    for stage in "023":
        assert float(rows[stage]["max_loss_diff"]) < 1e-4  # fp32: ZeRO stages reorder sums only
        assert float(rows[stage]["tokens_per_s"]) > 0 and float(rows[stage]["final_loss"]) > 0
        assert float(rows[stage]["estimated_model_states_bytes"]) == \
            pytest.approx(float(rows[stage]["model_states_bytes"]), rel=0.05), stage
    assert float(rows["0"]["max_loss_diff"]) == 0.0
    assert float(rows["3"]["model_states_bytes"]) < 0.7 * float(rows["0"]["model_states_bytes"])
    assert float(rows["3"]["estimated_model_states_bytes"]) < float(rows["0"]["estimated_model_states_bytes"])
    table = (out / "comparison.md").read_text()
    assert "| deepspeed.config=zero1 | failed: exit 1: torch.OutOfMemoryError" in table
    assert "| deepspeed.config=zero3 |" in table
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "deepspeed.config=zero3" / "summary.json").is_file()
    assert (out / "deepspeed.config=zero3.log").is_file()


@pytest.mark.slow
def test_compare_understands_pipeline_stages(tmp_path, data_cache, warm_cells):
    """With 2 pipeline stages on 2 ranks ZeRO-2 is refused before anything runs; ZeRO 0 and 1 run as pipelines
    and are estimated per stage."""
    out = tmp_path / "compare"
    assert compare_zero.main(["--recipe", "tiny_llama", "--stages", "0,1,2", "--num-gpus", "2", "--steps", "3",
                              "--output-dir", str(out), SMALL_MODEL, data_cache, "parallelism.pipeline_stages=2",
                              "training.warmup_steps=1"]) == 0
    rows = read_rows(out)
    assert rows["2"]["status"] == "failed" and "supports ZeRO 0 and 1 only" in rows["2"]["error"]
    assert not (out / "deepspeed.config=zero2.log").exists()  # refused by the checks, never launched
    assert rows["0"]["status"] == rows["1"]["status"] == "ok"
    assert float(rows["1"]["max_loss_diff"]) < 1e-5
    assert rows["1"]["estimate_source"] == "ZeRO arithmetic"
    assert "pipeline_stages" in (out / "deepspeed.config=zero1" / "resolved_recipe.yaml").read_text()


def test_vary_makes_a_grid_and_keeps_bracketed_commas():
    args = compare_zero.compare.parse_args(["--recipe", "tiny_llama", "--vary", "optimizer.name=adamw,lion",
                                            "--vary", "training.betas=[0.9, 0.95],[0.9, 0.99]"])
    assert args.cells == [["optimizer.name=adamw", "training.betas=[0.9, 0.95]"],
                          ["optimizer.name=adamw", "training.betas=[0.9, 0.99]"],
                          ["optimizer.name=lion", "training.betas=[0.9, 0.95]"],
                          ["optimizer.name=lion", "training.betas=[0.9, 0.99]"]]
    assert compare_zero.compare.cell_folder(args.cells[1]) == "optimizer.name=adamw__training.betas=_0.9_0.99_"
