"""Benchmarks with lm-evaluation-harness: `python -m training evaluate` on a Hugging Face folder and on a run (its
hf/, its summary.json), in several processes (lm-eval's data parallelism), `eval.benchmarks` at the end of training
(on every rank of the run), the shipped offline task, and the refusals."""
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import (
    REPO,
    SMALL_MODEL,
    TRAIN_ENV,
    main_in_process,
    run_train,
    save_small_checkpoint,
    train_in_process,
)
from training.__main__ import main as training_main
from training.loop.benchmarks import SHIPPED

TASK = "python_docs_mc"
LM_EVAL = pytest.mark.slow  # lm-eval end to end, its task index or its launches (7 to 40 s): not in the fast tier


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("benchmarks") / "model"
    save_small_checkpoint(folder)
    return folder


def evaluate(*args: str):
    return main_in_process(training_main, ["evaluate", *map(str, args)])


def requests_of_rank_0(output: str) -> list[int]:
    """How many loglikelihood requests rank 0 scored, from lm-eval's progress bars (the other ranks show none), one
    number per evaluation."""
    return [int(count) for count in re.findall(r"Running loglikelihood requests: 100%\|[^|]*\| (\d+)/\1 ", output)]


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
    (["--tasks", TASK, "--output-dir", "{tmp}/o", "--limit", "0"], "--limit: must be a whole number above 0, got '0'"),
    (["--tasks", TASK, "--output-dir", "{tmp}/o", "--limit", "-5"], "--limit: must be a whole number above 0"),
    (["--tasks", TASK, "--output-dir", "{tmp}/o", "--batch-size", "0"], "--batch-size: must be a whole number above 0"),
])
def test_what_cannot_be_evaluated_is_refused_before_the_model_loads(model, tmp_path, args, message):
    args = [arg.format(tmp=tmp_path, model=model) for arg in args]
    result = evaluate(model, *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert not (model / "scores").exists()


def test_a_lora_run_without_a_merged_model_says_how_to_get_one(tmp_path):
    run = tmp_path / "lora_run"
    (run / "adapter").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    result = evaluate(run, "--tasks", TASK)
    assert result.returncode == 2 and "is a LoRA run without a merged model" in result.stderr
    assert "export.merge=true" in result.stderr and not (run / "benchmarks").exists()


@pytest.mark.parametrize("gpus, args, message", [
    (0, ["--num-processes", "0", "--output-dir", "{tmp}/o"], "--num-processes: must be a whole number above 0"),
    (0, ["--num-processes", "2", "--output-dir", "{model}/scores"], "an output never goes inside an input"),
    (0, ["--num-processes", "2"], "is a model folder, not a run: give --output-dir"),
    (1, ["--num-processes", "2", "--output-dir", "{tmp}/o"], "this machine has 1 GPU(s) and each process takes one"),
])
def test_what_cannot_be_evaluated_in_processes_is_refused_before_any_starts(model, tmp_path, monkeypatch, gpus, args,
                                                                            message):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    launched = []
    monkeypatch.setattr(subprocess, "run", lambda command, **options: launched.append(command))
    result = evaluate(model, "--tasks", TASK, *[arg.format(tmp=tmp_path, model=model) for arg in args])
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert result.stderr.count("error:") == 1 and launched == []
    assert not (tmp_path / "o").exists() and not (model / "scores").exists()


@LM_EVAL
def test_two_processes_share_the_requests_and_give_one_processs_scores(model, tmp_path):
    """40 questions x 4 endings: rank 0 of two CPU processes scores 80 of the 160 requests, and writes the gathered
    scores alone; they are one process's."""
    one = evaluate(model, "--tasks", TASK, "--output-dir", tmp_path / "one", "--limit", "40")
    assert one.returncode == 0 and requests_of_rank_0(one.stderr) == [160], one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "training", "evaluate", str(model), "--tasks", TASK, "--output-dir",
                          str(tmp_path / "two"), "--limit", "40", "--num-processes", "2"], cwd=REPO, env=TRAIN_ENV,
                         capture_output=True, text=True, timeout=600)
    assert two.returncode == 0 and requests_of_rank_0(two.stderr) == [80], two.stderr[-3000:]
    assert two.stdout.count(f"|{TASK}|") == 1  # rank 0's table only
    alone, shared = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("one", "two"))
    assert shared["n-samples"][TASK]["effective"] == 40
    for metric in ("acc,none", "acc_norm,none"):
        assert shared["results"][TASK][metric] == pytest.approx(alone["results"][TASK][metric], abs=1e-6)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    """Two CPU ranks, 4 steps, a checkpoint every 2, attention dropout 0.1 (training draws random numbers):
    `scored` benchmarks its step-2 checkpoint and its final export (10 questions), `plain` neither."""
    common = ["--recipe", "tiny_llama", SMALL_MODEL.replace("head_dim: 16}", "head_dim: 16, attention_dropout: 0.1}"),
              data_cache, "training.max_steps=4", "checkpointing.every_steps=2", "logging.every_steps=1"]
    outputs = {}
    for name, extra in (("scored", [f"eval.benchmarks=[{TASK}]", "eval.limit=10", "eval.benchmark_checkpoints=true"]),
                        ("plain", [])):
        out = tmp_path_factory.mktemp(name) / "run"
        result = run_train([*common, "--output-dir", str(out), *extra], ranks=2)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        outputs[name] = out
        outputs[name, "console"] = result.stdout + result.stderr
    resumed = tmp_path_factory.mktemp("resumed") / "run"  # a copy of `scored` continued to step 8 on 1 rank, ZeRO-3
    shutil.copytree(outputs["scored"], resumed)
    result = run_train([*common, "--output-dir", str(resumed), "--resume", "training.max_steps=8",
                        "deepspeed.config=zero3", f"eval.benchmarks=[{TASK}]", "eval.limit=10",
                        "eval.benchmark_checkpoints=true"], ranks=1)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    outputs["resumed"] = resumed
    return outputs


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@LM_EVAL
def test_every_rank_of_a_run_scores_a_share_of_its_export(runs):
    """Rank 0 scores 20 of the 40 requests (10 questions x 4 endings), at the checkpoint and at the end; the summary
    holds the scores of benchmarks/results.json, the final scores are the ones one process gives the same export,
    and `evaluate` with another limit replaces them in the summary."""
    out = runs["scored"]
    assert requests_of_rank_0(runs["scored", "console"]) == [20, 20]
    assert f"benchmark {TASK} (lm-eval)" in runs["scored", "console"]
    at_the_end = json.loads((out / "summary.json").read_text())["benchmarks"][TASK]
    scored = json.loads((out / "benchmarks" / "results.json").read_text())["results"][TASK]
    assert at_the_end == {"acc": scored["acc,none"], "acc_norm": scored["acc_norm,none"]}
    again = evaluate(out, "--tasks", TASK, "--limit", "10", "--overwrite")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["benchmarks"][TASK] == pytest.approx(at_the_end, abs=1e-6)
    again = evaluate(out, "--tasks", TASK, "--limit", "20", "--overwrite")
    assert again.returncode == 0, again.stderr[-3000:]
    rescored = json.loads((out / "benchmarks" / "results.json").read_text())
    assert rescored["n-samples"][TASK]["effective"] == 20
    assert json.loads((out / "summary.json").read_text())["benchmarks"][TASK]["acc"] == \
        rescored["results"][TASK]["acc,none"]


@LM_EVAL
def test_a_periodic_checkpoint_is_scored_as_its_export_is_by_evaluate(runs, tmp_path):
    """eval.benchmark_checkpoints: the step-2 checkpoint's results are in it and its scores in metrics.jsonl at step 2;
    `python -m training export` of that checkpoint, then `evaluate`, gives the same scores. The final checkpoint is
    left to the end-of-run benchmark, and the checkpoint keeps no exported model."""
    checkpoints = runs["scored"] / "checkpoints"
    results = json.loads((checkpoints / "global_step2" / "benchmarks" / "results.json").read_text())["results"][TASK]
    logged, = [record for record in records(runs["scored"]) if "benchmarks" in record]
    scores = {"acc": results["acc,none"], "acc_norm": results["acc_norm,none"]}
    assert logged == {"event": "benchmark", "step": 2, "benchmarks": {TASK: scores}}
    assert not (checkpoints / "global_step4" / "benchmarks").exists()
    assert not list(checkpoints.glob("*/benchmarked_model"))
    exported = main_in_process(training_main, ["export", str(checkpoints / "global_step2"), str(tmp_path / "hf")])
    assert exported.returncode == 0, exported.stderr[-2000:]
    again = evaluate(tmp_path / "hf", "--tasks", TASK, "--limit", "10", "--output-dir", tmp_path / "scores")
    assert again.returncode == 0, again.stderr[-3000:]
    rescored = json.loads((tmp_path / "scores" / "results.json").read_text())["results"][TASK]
    assert (rescored["acc,none"], rescored["acc_norm,none"]) == (results["acc,none"], results["acc_norm,none"])


@LM_EVAL
def test_a_run_resumed_in_another_layout_scores_its_checkpoints_and_replaces_its_final_scores(runs):
    """The resume (1 rank, ZeRO-3, through a universal conversion) keeps the step-2 scores, scores its step-6
    checkpoint, and replaces the end-of-run results its first part wrote."""
    out = runs["resumed"]
    assert [record["step"] for record in records(out) if record.get("event") == "benchmark"] == [2, 6]
    assert (out / "checkpoints" / "global_step6" / "benchmarks" / "results.json").exists()
    assert json.loads((out / "summary.json").read_text())["steps"] == 8
    assert (out / "benchmarks" / "results.json").stat().st_mtime > (out / "hf" / "config.json").stat().st_mtime


@LM_EVAL
def test_scoring_checkpoints_leaves_the_training_as_it_was(runs):
    """lm-eval seeds the random generators; the run goes on with its own states, so the dropout draws, and the
    losses, are the run's without the benchmarks."""
    scored, plain = ([record["loss"] for record in records(runs[name]) if "loss" in record and "event" not in record]
                     for name in ("scored", "plain"))
    assert len(scored) == 4 and scored == plain


def test_a_lora_run_needs_its_merged_export_to_be_benchmarked(model):
    args = ["--recipe", "tiny_llama", "--dry-run", f"eval.benchmarks=[{TASK}]", "lora.enabled=true",
            f"model.name_or_path={model}", "model.config=null"]
    refused = train_in_process(args)
    assert refused.returncode == 2 and "export.merge: true" in refused.stderr, refused.stderr[-2000:]
    assert train_in_process([*args, "export.merge=true"]).returncode == 0


@pytest.mark.parametrize("extra, message", [
    ([], "name the tasks"),
    ([f"eval.benchmarks=[{TASK}]", "checkpointing.every_steps=null"], "saved every checkpointing.every_steps"),
    ([f"eval.benchmarks=[{TASK}]", "checkpointing.every_steps=2", "lora.enabled=true", "export.merge=true"],
     "holds the adapters alone"),
])
def test_scoring_checkpoints_needs_tasks_periodic_checkpoints_and_full_weights(model, extra, message):
    refused = train_in_process(["--recipe", "tiny_llama", "--dry-run", f"model.name_or_path={model}",
                                "model.config=null", "eval.benchmark_checkpoints=true", *extra])
    assert refused.returncode == 2 and message in refused.stderr, refused.stderr[-2000:]
    assert refused.stderr.count("error") == 1
