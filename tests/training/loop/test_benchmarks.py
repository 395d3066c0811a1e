"""Benchmarks with lm-evaluation-harness: `python -m training evaluate` on a Hugging Face folder and on a run (its
hf/, its summary.json), `eval.benchmarks` at the end of training, the shipped offline task, and the refusals."""
import json

import pytest

from tests.conftest import SMALL_MODEL, main_in_process, save_small_checkpoint, train_in_process
from training.__main__ import main as training_main
from training.loop.benchmarks import SHIPPED

TASK = "python_docs_mc"
LM_EVAL = pytest.mark.slow  # lm-eval end to end, or its task index: 7 to 16 s each, kept out of the fast tier


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("benchmarks") / "model"
    save_small_checkpoint(folder)
    return folder


def evaluate(*args: str):
    return main_in_process(training_main, ["evaluate", *map(str, args)])


def test_the_shipped_task_is_200_four_way_questions_with_one_true_ending():
    questions = [json.loads(line) for line in (SHIPPED / TASK / "questions.jsonl").read_text().splitlines()]
    assert len(questions) == 200 and all(len(q["choices"]) == 4 and len(set(q["choices"])) == 4 for q in questions)
    assert {q["answer"] for q in questions} == {0, 1, 2, 3}  # the true ending is not always in one place


@LM_EVAL
def test_a_model_folder_is_scored_into_the_output_folder(model, tmp_path):
    out = tmp_path / "scores"
    result = evaluate(model, "--tasks", TASK, "--output-dir", out, "--limit", "20")
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert 0 <= results["results"][TASK]["acc,none"] <= 1 and results["n-samples"][TASK]["effective"] == 20
    assert "|python_docs_mc|" in (out / "results.md").read_text()
    again = evaluate(model, "--tasks", TASK, "--output-dir", out, "--limit", "20")
    assert again.returncode == 2 and "pass --overwrite" in again.stderr


@pytest.mark.parametrize("args, message", [
    (["--tasks", TASK], "is a model folder, not a run: give --output-dir"),
    pytest.param(["--tasks", "no_such_task_anywhere", "--output-dir", "{tmp}/o"],
                 "neither shipped here (eval_tasks/: python_docs_mc)", marks=LM_EVAL),
    (["--tasks", TASK, "--output-dir", "{model}/scores"], "an output never goes inside an input"),
])
def test_what_cannot_be_evaluated_is_refused_before_the_model_loads(model, tmp_path, args, message):
    args = [arg.format(tmp=tmp_path, model=model) for arg in args]
    result = evaluate(model, *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert not (model / "scores").exists()


@LM_EVAL
def test_a_run_scores_its_export_at_the_end_and_evaluate_adds_to_its_summary(tmp_path, data_cache):
    out = tmp_path / "run"
    result = train_in_process(["--recipe", "tiny_llama", "--output-dir", str(out), SMALL_MODEL, data_cache,
                               "training.max_steps=2", f"eval.benchmarks=[{TASK}]", "eval.limit=10"])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    scored = json.loads((out / "benchmarks" / "results.json").read_text())["results"][TASK]
    assert summary["benchmarks"][TASK] == {"acc": scored["acc,none"], "acc_norm": scored["acc_norm,none"]}
    assert f"benchmark {TASK} (lm-eval)" in result.stdout
    again = evaluate(out, "--tasks", TASK, "--limit", "20", "--overwrite")
    assert again.returncode == 0, again.stderr[-3000:]
    rescored = json.loads((out / "benchmarks" / "results.json").read_text())
    assert rescored["n-samples"][TASK]["effective"] == 20
    assert json.loads((out / "summary.json").read_text())["benchmarks"][TASK]["acc"] == \
        rescored["results"][TASK]["acc,none"]


def test_a_lora_run_needs_its_merged_export_to_be_benchmarked(model):
    args = ["--recipe", "tiny_llama", "--dry-run", f"eval.benchmarks=[{TASK}]", "lora.enabled=true",
            f"model.name_or_path={model}", "model.config=null"]
    refused = train_in_process(args)
    assert refused.returncode == 2 and "export.merge: true" in refused.stderr, refused.stderr[-2000:]
    assert train_in_process([*args, "export.merge=true"]).returncode == 0
