"""benchmarks/generation_batch.py at the smallest size on a CPU: every batch's row comes out with its numbers
(speed is the benchmark's to measure, not a test's)."""
import re
import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import generation_batch  # noqa: E402


def test_each_batch_gets_its_row(tmp_path, monkeypatch):
    config = str(REPO / "recipes/tiny_llama/config.json")
    monkeypatch.setattr(sys, "argv", ["generation_batch.py", "--model-config", config, "--batches", "2,4",
                                      "--prompt-len", "3", "--completion-len", "4", "--output", str(tmp_path)])
    generation_batch.main()
    table = (tmp_path / "table.md").read_text()
    rows = re.findall(r"^\| (\d+) \| [\d.]+ \| [\d,]+ \| [\d.]+ \| - \| [\d.]+ \| [\d.]+ \| - \| - \|$", table, re.M)
    assert rows == ["2", "4"], table
