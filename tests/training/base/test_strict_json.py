"""Every JSON line and file the commands write is strict JSON (training/base/strict_json.py, issue 68): a non-finite
number is written as text, which jq and JavaScript read, and read back as the number."""
import ast
import math
from pathlib import Path

import pytest

from tests.conftest import REPO, strict_loads
from training.base.strict_json import dumps, number
from training.loop.metrics import MetricsLogger


def test_non_finite_numbers_are_written_as_text_at_any_depth_and_read_back():
    value = {"loss": math.nan, "grad_norm": math.inf, "nested": [{"low": -math.inf}, (1.5, 2)], "name": "nan"}
    line = dumps(value)
    assert strict_loads(line) == {"loss": "nan", "grad_norm": "inf", "nested": [{"low": "-inf"}, [1.5, 2]],
                                  "name": "nan"}
    assert math.isnan(number("nan")) and number("inf") == math.inf and number("-inf") == -math.inf
    assert number(0.25) == 0.25 and number(None) is None
    with pytest.raises(TypeError):  # what json itself cannot write stays an error, not a line readers refuse
        dumps({"tensor": object()})


def test_metrics_jsonl_is_strict_json_with_non_finite_records_events_and_scores(tmp_path):
    """The run's writer of metrics.jsonl, given what a run without the stability guard, a skipped step and a
    benchmark of a broken model log."""
    logger = MetricsLogger(tmp_path, total_steps=3, start_step=0, tensorboard=False, enabled=True)
    logger.log({"step": 1, "loss": math.nan, "lr": 1e-3, "grad_norm": math.inf, "tokens_per_s": 10.0,
                "peak_mem_bytes": 0})
    logger.event({"event": "skip", "step": 2, "data_position": 2, "reason": "nonfinite_loss", "loss": -math.inf})
    logger.benchmarks(2, {"python_docs_mc": {"acc": math.nan}})
    logger.close()
    lines = [strict_loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [lines[0]["loss"], lines[0]["grad_norm"], lines[1]["loss"]] == ["nan", "inf", "-inf"]
    assert lines[2]["benchmarks"] == {"python_docs_mc": {"acc": "nan"}}
    logger = MetricsLogger(tmp_path, total_steps=3, start_step=2, tensorboard=False, enabled=True)  # a resume reads it
    logger.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


# json.dumps that writes no file a command leaves: text inside messages, keys that are compared, the prepared data's
# own encoding of a row's fields (read back by json.loads), the datasets library's own files, the bodies of
# requests to vLLM's server, and assets and benchmarks' inputs written from ints and strings
NOT_AN_OUTPUT = {"training/compat/datasets.py", "data_pipeline/preference.py", "data_pipeline/prompts.py",
                 "data_pipeline/files.py", "data_pipeline/prepare.py", "tools/compare.py", "tools/make_tiny_assets.py",
                 "tools/make_eval_task.py", "benchmarks/hf_trainer.py", "benchmarks/data_filters.py",
                 "benchmarks/data_engines.py", "benchmarks/data_pipeline.py",
                 "training/objectives/grpo/vllm_engine.py"}


def plain_json_calls(path: Path) -> list[int]:
    """The lines of `path` that call json.dump or json.dumps outside an f-string."""
    tree = ast.parse(path.read_text())
    in_fstrings = {id(node) for joined in ast.walk(tree) if isinstance(joined, ast.JoinedStr)
                   for node in ast.walk(joined)}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and id(node) not in in_fstrings
            and isinstance(node.func, ast.Attribute) and node.func.attr in ("dump", "dumps")
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "json"]


def test_every_file_a_command_writes_as_json_goes_through_strict_json():
    """The writers' side of the rule: a json.dumps of the product (train.py, training/, data_pipeline/, tools/,
    benchmarks/) that is not strict_json's is one of the uses above, which write no output file."""
    sources = [REPO / "train.py", *[path for folder in ("training", "data_pipeline", "tools", "benchmarks")
                                    for path in (REPO / folder).rglob("*.py")]]
    plain = {path.relative_to(REPO).as_posix(): lines for path in sources
             if path.name != "strict_json.py" and (lines := plain_json_calls(path))}
    assert set(plain) <= NOT_AN_OUTPUT, {name: lines for name, lines in plain.items() if name not in NOT_AN_OUTPUT}
