"""benchmarks/generation_engines.py at the smallest size on a CPU: each batch gets a row per engine, generate's ratio
to itself 1 (speed is the benchmark's to measure, not a test's). Its GRPO runs launch train.py: not here."""
import re
import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import generation_engines  # noqa: E402


def test_each_batch_gets_a_row_per_engine(tmp_path, monkeypatch):
    config = str(REPO / "recipes/tiny_llama/config.json")
    monkeypatch.setattr(sys, "argv", ["generation_engines.py", "--model-config", config, "--batches", "2,4",
                                      "--prompt-len", "3", "--completion-len", "4", "--engines", "generate,static",
                                      "--output", str(tmp_path)])
    generation_engines.main()
    table = (tmp_path / "table.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (\w+) \| [\d.]+ \| [\d,.]+ \| [\d,]+ \| [\d.]+ \| ([\d.]+)x \| - \| - \|$", table,
                      re.M)
    assert [(batch, engine) for batch, engine, _ in rows] == [("2", "generate"), ("2", "static"), ("4", "generate"),
                                                              ("4", "static")], table
    assert all(ratio == "1.00" for _, engine, ratio in rows if engine == "generate")
