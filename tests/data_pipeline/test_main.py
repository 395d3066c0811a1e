"""`python -m data_pipeline prepare` and `dedup` with a user's arguments, through the main(argv) that the command line
calls (tests/test_bad_input.py starts the command itself), and train.py reading what prepare wrote."""
import json
import subprocess
import sys

import datasets
import pytest

from data_pipeline.__main__ import main
from tests.conftest import REPO, SMALL_MODEL, main_in_process, train_in_process


def run_module(*args: str) -> subprocess.CompletedProcess:
    return main_in_process(main, list(args))


@pytest.mark.slow
def test_prepare_writes_the_splits_and_stats_that_train_py_reads(tmp_path):
    output = tmp_path / "prepared"
    result = run_module("prepare", "--recipe", "tiny_llama", "--output", str(output), "data.dedup.near=true",
                        "data.eval.fraction=0.05", f"data.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr[-2000:]
    stats = json.loads((output / "stats.json").read_text())
    assert stats["documents_in"] == 1770
    assert stats["exact_duplicates_removed"] > 0 and stats["near_duplicates_removed"] > 0  # the help() topics repeat
    assert stats["eval_documents"] > 0 and stats["packing_efficiency"] == 1.0
    prepared = datasets.load_from_disk(str(output))
    assert set(prepared) == {"train", "eval"}
    assert set(prepared["train"].column_names) == {"input_ids", "labels", "position_ids", "length"}
    assert len(prepared["train"]) == stats["rows"]
    assert "near_duplicates_removed" in result.stdout
    # a second run refuses to overwrite it
    assert run_module("prepare", "--recipe", "tiny_llama", "--output", str(output)).returncode == 2
    # and train.py trains on it
    run = train_in_process(["--recipe", "tiny_llama", "--output-dir", str(tmp_path / "run"), SMALL_MODEL,
                            "data.sources=[]", f"data.prepared={output}", "training.max_steps=2"])
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["data"] == stats


@pytest.mark.slow
def test_prepared_rows_must_match_seq_len(tmp_path):
    output = tmp_path / "prepared"
    assert run_module("prepare", "--recipe", "tiny_llama", "--output", str(output), "data.seq_len=128",
                      f"data.cache_dir={tmp_path / 'cache'}").returncode == 0
    run = train_in_process(["--recipe", "tiny_llama", "--output-dir", str(tmp_path / "run"), "data.sources=[]",
                     f"data.prepared={output}"])
    assert run.returncode == 2
    assert "holds rows of 128 tokens, but data.seq_len is 256" in run.stderr


@pytest.mark.parametrize("recipe, degree, reason", [
    ("tiny_llama_dpo", "sequence_parallel", "the loss is a function of each sequence's whole log-probability"),
    ("tiny_llama_dpo", "pipeline_stages", "the pipeline's last stage would need each pair's sequences"),
    ("tiny_llama_grpo", "sequence_parallel", "a completion is sampled whole"),
])
def test_prepare_refuses_a_layout_the_run_refuses_before_any_work(tmp_path, recipe, degree, reason):
    """The refusals of training/parallel/support.py's table that the recipe alone decides, as train.py words them,
    before anything is read or written."""
    output = tmp_path / "prepared"
    result = run_module("prepare", "--recipe", recipe, "--output", str(output), f"parallelism.{degree}=2")
    assert result.returncode == 2
    error = " ".join(result.stderr.split())
    assert f"training.objective={recipe.removeprefix('tiny_llama_')} with parallelism.{degree}=2: {reason}" in error
    assert not output.exists()


BASE = ("the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat "
        "and the bird sings a song about the morning sun rising over green hills ")
RECORDS = [{"text": BASE * 3, "id": 1}, {"text": "something else entirely, with its own words " * 6, "id": 2},
           {"text": BASE.upper() * 3, "id": 3}, {"text": (BASE * 3).replace("lazy", "sleepy", 1), "id": 4},
           {"text": "a third distinct document about trains and stations " * 6, "id": 5}]


def test_dedup_keeps_the_first_of_each_group_with_lines_unchanged(tmp_path):
    records, source = RECORDS, tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = run_module("dedup", str(source), str(tmp_path / "out.jsonl"))
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == [1, 2, 5]
    assert (tmp_path / "out.jsonl").read_text().splitlines()[0] == json.dumps(records[0])
    exact_only = run_module("dedup", str(source), str(tmp_path / "exact.jsonl"), "--no-near")
    assert [json.loads(line)["id"] for line in (tmp_path / "exact.jsonl").read_text().splitlines()] == [1, 2, 4, 5]
    assert "exact_duplicates_removed" in exact_only.stdout


@pytest.mark.slow
def test_dedup_in_worker_processes_keeps_the_same_lines(tmp_path):
    """--num-proc 2: datasets.map forks a process pool and a manager. Run as the command runs, in a process of its
    own: forked from a pytest worker that holds other tests' threads (fsspec's, tqdm's, torch's), the manager's
    accepter thread was seen to hang on a lock taken before the fork."""
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    assert run_module("dedup", str(source), str(tmp_path / "one.jsonl")).returncode == 0
    result = subprocess.run([sys.executable, "-m", "data_pipeline", "dedup", str(source), str(tmp_path / "two.jsonl"),
                             "--num-proc", "2"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "two.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"text": \n', r"in.jsonl:2: not valid JSON"),
    ('{"body": "ok"}\n', r"in.jsonl:1: no field 'text' \(fields present: body\); pass --text-field"),
])
def test_dedup_bad_input(tmp_path, content, message):
    (tmp_path / "in.jsonl").write_text(content)
    result = run_module("dedup", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"))
    assert result.returncode == 2
    assert pytest.importorskip("re").search(message, result.stderr)
