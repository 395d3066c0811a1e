"""`python -m data_pipeline prepare --engine datatrove`: the data stage as a datatrove job, checked against
the in-process path on the same corpus (2 files, so 2 tasks each read one), with the local executor."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import psutil
import pytest

from data_pipeline.__main__ import main  # noqa: E402
from data_pipeline.dedup import MinHasher, normalize  # noqa: E402
from data_pipeline.prepare import build_dataset, deduplicate, drop_empty  # noqa: E402
from data_pipeline.scale import Layout, deduplicated  # noqa: E402
from data_pipeline.sources import load_documents  # noqa: E402
from tests.conftest import REPO, SMALL_MODEL, run_train  # noqa: E402
from training.config.recipe import load_recipe  # noqa: E402
from training.models.model import load_tokenizer  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
NEAR = "data.dedup.near=true"
JOB = (NEAR, "data.eval.fraction=0.05")  # the shared job: every stage, decontamination included


def near_copy(text: str, seed: int) -> str:
    """The text with one word replaced: a near duplicate (word 5-gram Jaccard above 0.8 for long texts)."""
    words = text.split()
    words[np.random.default_rng(seed).integers(len(words))] = "CHANGED"
    return " ".join(words)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """tiny_llama's corpus as two shards of one source, with exact duplicates (case and spacing changed, some in the
    other file), near duplicates (one word changed) of long documents, and an empty document."""
    folder = tmp_path_factory.mktemp("corpus")
    lines = (REPO / "recipes/tiny_llama/corpus.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    rng = np.random.default_rng(0)
    long_ones = [i for i, t in enumerate(texts) if len(t.split()) >= 150]
    near_pairs = [(texts[i], near_copy(texts[i], i)) for i in rng.choice(long_ones, 40, replace=False)]
    exact = [texts[i].upper().replace(" ", "  ") for i in rng.choice(len(texts), 40, replace=False)]
    halves = [texts[:len(texts) // 2] + exact[:20],
              texts[len(texts) // 2:] + exact[20:] + [c for _, c in near_pairs] + [" "]]
    paths = []
    for index, half in enumerate(halves):
        paths.append(folder / f"part-{index}.jsonl")
        paths[-1].write_text("".join(json.dumps({"text": t}) + "\n" for t in half))
    return {"sources": f"data.sources=[{{path: '{folder}/part-*.jsonl'}}]", "near_pairs": near_pairs}


def prepare_command(output: Path, *overrides: str, tasks: int = 2, workers: int = 2) -> list[str]:
    return [sys.executable, "-m", "data_pipeline", "prepare", "--recipe", "tiny_llama", "--output", str(output),
            "--engine", "datatrove", "--tasks", str(tasks), "--workers", str(workers), *overrides]


def run_job(output: Path, *overrides: str, tasks: int = 2, workers: int = 2) -> None:
    done = subprocess.run(prepare_command(output, *overrides, tasks=tasks, workers=workers), cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


@pytest.fixture(scope="module")
def job(corpus, tmp_path_factory) -> Path:
    """The corpus prepared by a datatrove job: exact and near dedup, an evaluation split, 2 tasks on 2 workers."""
    output = tmp_path_factory.mktemp("job") / "prepared"
    run_job(output, corpus["sources"], *JOB)
    return output


def stats_of(prepared: Path) -> dict:
    return json.loads((prepared / "stats.json").read_text())


def recipe_data(corpus: dict, *overrides: str):
    return load_recipe("tiny_llama", [corpus["sources"], *overrides]).data


def kept_by_job(config, work: Path, tasks: int) -> list[str]:
    """The documents the job's deduplication kept: its reading steps replayed over each task's files,
    with the duplicate lists the job wrote."""
    texts = []
    for rank in range(tasks):
        documents = None
        for step in deduplicated(config, Layout(work)):
            documents = step(documents, rank, tasks)
        texts += [document.text for document in documents]
    return texts


def kept_in_process(config) -> list[str]:
    return deduplicate(drop_empty(load_documents(config.sources), {}), config.dedup, 1, {})["text"]


def shingle_set(text: str) -> set:
    hashes, _ = MinHasher(1, "word", 5).shingle_hashes([normalize(text).encode()])
    return set(hashes.tolist())


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b)


def near_quality(unique: list[str], kept: list[str], near_pairs: list[tuple[str, str]], threshold: float) -> tuple:
    """(precision, recall) of the near-duplicate removals against exact Jaccard: a removed document is right
    if some other document is at least `threshold` similar; recall counts the planted pairs with one removed."""
    kept_set = {normalize(t) for t in kept}
    removed = [t for t in unique if normalize(t) not in kept_set]
    shingles = [shingle_set(t) for t in unique]
    right = sum(any(jaccard(shingle_set(r), s) >= threshold and normalize(u) != normalize(r)
                    for u, s in zip(unique, shingles)) for r in removed)
    found = sum(normalize(a) not in kept_set or normalize(b) not in kept_set for a, b in near_pairs)
    return right / max(1, len(removed)), found / len(near_pairs)


@pytest.mark.slow
def test_exact_dedup_keeps_the_same_documents_as_the_in_process_path(corpus, job):
    config = recipe_data(corpus)  # exact only
    in_process = kept_in_process(config)
    by_job = kept_by_job(recipe_data(corpus, NEAR), job.with_name("prepared.datatrove"), 2)
    stats = json.loads((job / "stats.json").read_text())
    assert stats["exact_duplicates_removed"] == len(load_documents(config.sources)) - 1 - len(in_process) >= 40
    assert stats["empty_documents_removed"] == 1
    exact_survivors = {normalize(t) for t in in_process}
    assert {normalize(t) for t in by_job} <= exact_survivors  # near dedup only removes more
    assert len(exact_survivors) == len(in_process)  # one of each group, as in-process


@pytest.mark.slow
def test_near_dedup_agrees_with_the_in_process_path_within_lsh_noise(corpus, job):
    config = recipe_data(corpus, NEAR)
    unique = kept_in_process(recipe_data(corpus))
    assert all(jaccard(shingle_set(a), shingle_set(b)) >= 0.8 for a, b in corpus["near_pairs"])
    by_job = kept_by_job(config, job.with_name("prepared.datatrove"), 2)
    in_process = kept_in_process(config)
    assert stats_of(job)["eval_documents"] == pytest.approx(0.05 * len(by_job), rel=0.25)
    assert len(datasets.load_from_disk(str(job))["eval"]) >= 1
    job_quality = near_quality(unique, by_job, corpus["near_pairs"], config.dedup.threshold)
    own_quality = near_quality(unique, in_process, corpus["near_pairs"], config.dedup.threshold)
    print(f"precision, recall: datatrove {job_quality}, in-process {own_quality}; removed "
          f"{len(unique) - len(by_job)} against {len(unique) - len(in_process)}")
    assert job_quality[0] >= 0.9 and job_quality[1] >= 0.95
    assert own_quality[0] >= 0.9 and own_quality[1] >= 0.95
    differ = {normalize(t) for t in by_job} ^ {normalize(t) for t in in_process}
    assert len(differ) <= 0.02 * len(unique)
    stats = json.loads((job / "stats.json").read_text())
    assert stats["near_duplicates_removed"] == len(unique) - len(by_job)


def assert_same_rows(got: datasets.DatasetDict, expected: datasets.DatasetDict, split: str) -> None:
    for column in ("input_ids", "labels", "position_ids", "length"):
        assert np.array_equal(np.asarray(got[split][column]), np.asarray(expected[split][column])), (split, column)


@pytest.mark.slow
def test_one_task_writes_the_in_process_rows_row_for_row(corpus, job, tmp_path):
    output = tmp_path / "prepared"
    run_job(output, corpus["sources"], tasks=1, workers=1)
    config = recipe_data(corpus)
    expected, expected_stats, _ = build_dataset(config, load_tokenizer(load_recipe("tiny_llama").tokenizer_path, False))
    written = datasets.load_from_disk(str(output))
    assert_same_rows(written, expected, "train")
    job_key = json.loads((tmp_path / "prepared.datatrove/job.json").read_text())["fingerprint"]  # as in-process
    task = json.loads((tmp_path / "prepared.datatrove/rows/train-00000/state.json").read_text())
    assert task["_fingerprint"] == f"{job_key}-task-0"
    assert written["train"]._fingerprint != datasets.load_from_disk(str(job))["train"]._fingerprint  # another job's
    stats = json.loads((output / "stats.json").read_text())
    for key in ("documents_in", "exact_duplicates_removed", "near_duplicates_removed", "documents_out", "tokens_out",
                "rows"):
        assert stats[key] == expected_stats[key], key


@pytest.mark.slow
def test_a_phased_job_writes_the_in_process_rows_with_their_sources_and_scores(tmp_path):
    """data.phases over scored sources: one task packs each source apart, with each row's source and score, as the
    in-process engine does, row for row."""
    lines = (REPO / "recipes/tiny_llama/corpus.jsonl").read_text().splitlines()
    sources = []
    for name, part in (("first", lines[:300]), ("second", lines[300:500])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": json.loads(line)["text"], "quality": (i * 37 % 101) / 100}) + "\n"
                                for i, line in enumerate(part)))
        sources.append(f"{{path: {path}, label: {name}, score_field: quality}}")
    overrides = [f"data.sources=[{', '.join(sources)}]",
                 "data.phases=[{name: main, weights: {first: 1, second: 2}, order: highest_score_first}]"]
    output = tmp_path / "prepared"
    run_job(output, *overrides, tasks=1, workers=1)
    config = load_recipe("tiny_llama", overrides).data
    expected, _, _ = build_dataset(config, load_tokenizer(load_recipe("tiny_llama").tokenizer_path, False))
    written = datasets.load_from_disk(str(output))
    assert_same_rows(written, expected, "train")
    for column in ("source", "score"):
        assert np.array_equal(np.asarray(written["train"][column]), np.asarray(expected["train"][column])), column
    assert written["train"].features["source"].names == ["first", "second"]
    assert not np.isnan(np.asarray(written["train"]["score"])).any()


@pytest.mark.slow
def test_chat_sources_are_tokenized_with_their_template_and_packed_as_in_process(tmp_path):
    """tiny_llama_sft's conversations (loss on the assistant replies only), bfd packing, one task."""
    chat = ["data.sources=[{path: recipes/tiny_llama_sft/chat.jsonl, messages_field: messages}]",
            "data.packing=bfd", "data.long_documents=truncate"]
    output = tmp_path / "prepared"
    run_job(output, *chat, tasks=1, workers=1)
    recipe = load_recipe("tiny_llama", chat)
    expected, expected_stats, _ = build_dataset(recipe.data, load_tokenizer(recipe.tokenizer_path, False))
    got = datasets.load_from_disk(str(output))
    assert_same_rows(got, expected, "train")
    assert (np.asarray(got["train"]["labels"]) == -100).mean() > 0.3  # the prompts take no loss
    assert stats_of(output)["long_documents_truncated"] == expected_stats["long_documents_truncated"]


@pytest.mark.slow
def test_decontamination_against_eval_sources_removes_what_the_in_process_path_removes(corpus, tmp_path):
    """Each task checks its documents against every evaluation document, so the removals are the
    in-process path's; the evaluation split is packed by the same code, row for row."""
    texts = [json.loads(line)["text"] for line in (REPO / "recipes/tiny_llama/corpus.jsonl").read_text().splitlines()]
    evaluation = tmp_path / "eval.jsonl"
    planted = [near_copy(t, 1) for t in texts if len(t.split()) >= 150][:10]
    evaluation.write_text("".join(json.dumps({"text": t}) + "\n" for t in planted + texts[-1:]))
    overrides = (corpus["sources"], f"data.eval.sources=[{{path: {evaluation}}}]")
    output = tmp_path / "prepared"
    run_job(output, *overrides)
    recipe = load_recipe("tiny_llama", list(overrides))
    expected, expected_stats, _ = build_dataset(recipe.data, load_tokenizer(recipe.tokenizer_path, False))
    stats = stats_of(output)
    assert stats["decontaminated_removed"] == expected_stats["decontaminated_removed"] >= 11
    assert stats["eval_documents"] == expected_stats["eval_documents"] == 11
    assert_same_rows(datasets.load_from_disk(str(output)), expected, "eval")


@pytest.mark.slow
def test_the_jobs_rows_train_tiny_llama_to_the_in_process_first_loss(corpus, job, tmp_path):
    in_process = tmp_path / "in_process"
    assert main(["prepare", "--recipe", "tiny_llama", "--output", str(in_process), corpus["sources"], *JOB]) == 0
    losses = []
    for prepared in (job, in_process):
        out = tmp_path / f"run-{prepared.name}"
        done = run_train(["--recipe", "tiny_llama", "--output-dir", str(out), f"data.prepared={prepared}",
                          "data.sources=[]", SMALL_MODEL, "training.max_steps=1", "logging.every_steps=1",
                          "training.eval_every_steps=null"])
        assert done.returncode == 0, done.stderr[-3000:]
        losses.append(json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=0.01)  # different rows first, the same model and data


def rerun_matches_the_uninterrupted_job(output: Path, corpus: dict, job: Path) -> None:
    """Run the killed job's command again: the tasks that had finished do not run again (their logs keep
    their times), the others do, and the result is the uninterrupted job's."""
    work = output.with_name(f"{output.name}.datatrove")
    assert not (output / "stats.json").exists()
    finished = {p: p.stat().st_mtime_ns for p in (work / "logs").glob("*/stats/*.json")}
    assert finished
    run_job(output, corpus["sources"], *JOB, workers=1)
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in finished.items())
    assert len(list((work / "logs").glob("*/stats/*.json"))) > len(finished)
    rerun, uninterrupted = datasets.load_from_disk(str(output)), datasets.load_from_disk(str(job))
    for split in ("train", "eval"):
        assert_same_rows(rerun, uninterrupted, split)
    stats, expected = stats_of(output), stats_of(job)
    assert {k: v for k, v in stats.items() if k != "sources"} == {k: v for k, v in expected.items() if k != "sources"}


def start_job(output: Path, corpus: dict, workers: int) -> subprocess.Popen:
    return subprocess.Popen(prepare_command(output, corpus["sources"], *JOB, workers=workers), cwd=REPO, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(path: Path, process: subprocess.Popen) -> None:
    while not path.exists():
        assert process.poll() is None, f"the job ended before {path} appeared: {process.stderr.read()[-3000:]}"
        time.sleep(0.01)


@pytest.mark.slow
def test_a_killed_job_reruns_only_unfinished_tasks_and_ends_as_an_uninterrupted_one(corpus, job, tmp_path):
    """With --workers 1 the job runs its tasks in its own process: SIGKILL it while the second task of the
    last stage runs, as a lost node or a preemption would, then run the same command again."""
    output = tmp_path / "prepared"
    process = start_job(output, corpus, workers=1)
    wait_for(tmp_path / "prepared.datatrove/logs/rows/completions/00000", process)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (tmp_path / "prepared.datatrove/logs/rows/completions/00001").exists()
    rerun_matches_the_uninterrupted_job(output, corpus, job)


@pytest.mark.slow
def test_a_job_whose_worker_is_killed_stops_and_its_rerun_finishes_it(corpus, job, tmp_path):
    """SIGKILL one of the 2 pool workers while it tokenizes and packs (the OOM killer's way): the job ends with exit 1
    and the advice to rerun instead of waiting forever for the lost task; the rerun finishes it. The job's processes
    are suspended as soon as both tasks have begun, so that the worker killed is one whose task is unfinished, and
    stay so for a second, so that the job's watchdog (end_if_a_worker_dies, polling every 0.2 s) has seen them."""
    output = tmp_path / "prepared"
    process = start_job(output, corpus, workers=2)
    stage = tmp_path / "prepared.datatrove/logs/rows"
    logs = [stage / f"logs/task_{task:05d}.log" for task in (0, 1)]  # datatrove opens them as each task begins
    while not all(log.exists() for log in logs):
        assert process.poll() is None, process.stderr.read()[-3000:]
        time.sleep(0.002)
    children = psutil.Process(process.pid).children()  # the pool's workers (forked) and datatrove's manager
    for child in children:
        child.suspend()
    time.sleep(1)
    unfinished = [str(log) for task, log in enumerate(logs) if not (stage / f"completions/{task:05d}").exists()]
    worker = next(child for child in children if any(file.path in unfinished for file in child.open_files()))
    worker.kill()
    for child in children:
        if child != worker:
            child.resume()
    assert process.wait(timeout=60) == 1
    assert "run the same command again" in process.stderr.read()
    assert len(list((stage / "completions").glob("*"))) < 2
    rerun_matches_the_uninterrupted_job(output, corpus, job)


def test_bad_job_options_are_refused_before_any_stage_runs(corpus, tmp_path, capsys):
    output = tmp_path / "prepared"
    base = ["prepare", "--recipe", "tiny_llama", "--output", str(output), "--engine", "datatrove", corpus["sources"]]
    assert main([*base, "--executor", "slurm"]) == 2
    assert "--slurm-partition" in capsys.readouterr().err
    text = tmp_path / "book.txt"
    text.write_text("one document")
    assert main([*base[:-1], f"data.sources=[{{path: {text}}}]"]) == 2
    assert "book.txt" in capsys.readouterr().err
    assert main([*base[:-1], f"data.sources=[{{path: '{tmp_path}/part-*.jsonl'}}]"]) == 2
    assert "no file matches" in capsys.readouterr().err
    assert main([*base, "data.sources.0.text_field=body"]) == 2
    assert "no field 'body'" in capsys.readouterr().err
    assert not (tmp_path / "prepared.datatrove").exists()


def test_no_ray_cluster_is_named_before_anything_is_written(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # where Ray looks for the address of a cluster `ray start` left
    output = tmp_path / "prepared"
    assert main(["prepare", "--recipe", "tiny_llama", "--output", str(output), "--engine", "datatrove", "--executor",
                 "ray", corpus["sources"]]) == 2
    error = capsys.readouterr().err
    assert "--executor ray: no Ray cluster at auto" in error and "ray start --head" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_rerun_with_other_settings_is_refused(corpus, job, capsys):
    work = job.with_name("prepared.datatrove")
    before = (work / "job.json").read_text()
    fresh = job.with_name("other")
    (fresh.with_name("other.datatrove")).mkdir()
    (fresh.with_name("other.datatrove") / "job.json").write_text(before)
    args = ["prepare", "--recipe", "tiny_llama", "--output", str(fresh), "--engine", "datatrove", corpus["sources"]]
    assert main([*args, *JOB, "--tasks", "3"]) == 2
    assert "--tasks" in capsys.readouterr().err
    assert main([*args, "data.seq_len=128", *JOB]) == 2
    assert "data section" in capsys.readouterr().err
    earlier = {key: value for key, value in json.loads(before).items() if key != "stages"}  # as version 1 wrote it
    (fresh.with_name("other.datatrove") / "job.json").write_text(json.dumps(earlier))
    assert main([*args, *JOB]) == 2
    assert "version of the stages" in capsys.readouterr().err


def test_each_kind_of_source_gets_its_datatrove_reader(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datatrove.pipeline.readers import HuggingFaceDatasetReader, JsonlReader, ParquetReader

    from data_pipeline.config import DataSource
    from data_pipeline.scale import reader
    (tmp_path / "part-0.jsonl").write_text('{"text": "a document"}\n')
    pq.write_table(pa.table({"text": ["a document"]}), tmp_path / "part-0.parquet")
    for suffix, kind in ((".jsonl", JsonlReader), (".parquet", ParquetReader)):
        made = reader(DataSource(path=str(tmp_path / f"part-*{suffix}")), 0)
        assert isinstance(made, kind) and made.glob_pattern == f"part-*{suffix}"
    hub = reader(DataSource(hub="HuggingFaceFW/fineweb-edu", subset="sample-10BT"), 1)
    assert isinstance(hub, HuggingFaceDatasetReader) and hub.dataset_options == {"name": "sample-10BT",
                                                                                 "split": "train"}
    document = hub.adapter({"text": "a document"}, "hub", 3)
    score = document["metadata"].pop("score")
    assert document["text"] == "a document" and document["metadata"] == {"source": 1, "messages": None}
    assert math.isnan(score)  # no score_field


def test_slurm_stages_are_chained_jobs_with_the_options(corpus, tmp_path):
    from data_pipeline.scale import JobOptions, executor, stages
    config = recipe_data(corpus, NEAR)
    tokenizer = load_tokenizer(load_recipe("tiny_llama").tokenizer_path, False)
    options = JobOptions("slurm", tasks=64, slurm_partition="cpu", cpus_per_task=2, mem_per_cpu_gb=4)
    previous = None
    for name, steps, tasks in stages(config, tokenizer, Layout(tmp_path), tmp_path / "out", options.tasks):
        current = executor(options, name, steps, tasks, str(tmp_path / name), previous, "tiny")
        assert current.depends is previous and current.partition == "cpu" and current.cpus_per_task == 2
        previous = current
    assert [s[0] for s in stages(config, tokenizer, Layout(tmp_path), tmp_path, 64)] == [
        "signatures", "exact_duplicates", "minhash_buckets", "minhash_clusters", "rows", "assemble"]


@pytest.mark.parametrize("name, content, message", [
    ("a.jsonl", b'{"text": "fine"}\n{"text": 5}\n', "a.jsonl:2: field 'text' is a JSON int (5), not a string"),
    ("a.jsonl", b'{"text": "fine"}\n{"text": ["a"]}\n',
     "a.jsonl:2: field 'text' is a JSON list ([\"a\"]), not a string"),
    ("a.jsonl", b'{"text": "fine"}\n{"text": \n', "a.jsonl:2: not valid JSON (Expecting value at column 10)"),
    ("a.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n{"text": "lost"}\n', "a.jsonl:2: not UTF-8"),
    ("a.csv", b'text\nfine\ncaf\xe9\n', "a.csv:3: not UTF-8"),
    ("a.jsonl", b"", "a.jsonl is empty (0 bytes): it holds no documents"),
    ("a.jsonl", b"\n \n", "a.jsonl is empty (only whitespace)"),
    ("a.json", b'[{"text": "fine"},\n {"text": "also fine"}]\n',
     "a.json is one JSON array; the datatrove engine reads"),
], ids=["int text", "list text", "bad JSON", "latin-1 jsonl", "latin-1 csv", "empty", "whitespace", "JSON array"])
def test_bad_source_lines_are_named_before_the_job_starts(name, content, message, tmp_path, tree_guard, capsys):
    """datatrove's reader would skip the line (or the rest of the file) with a warning, or a task would fail with
    a traceback in its log: check_sources reads every line first."""
    (tmp_path / name).write_bytes(content)
    args = ["prepare", "--recipe", "tiny_llama", "--output", str(tmp_path / "prepared"), "--engine", "datatrove",
            f"data.sources=[{{path: {tmp_path / name}}}]"]
    with tree_guard():
        assert main(args) == 2
    error = " ".join(capsys.readouterr().err.split())
    assert f"{tmp_path}/{message}" in error and error.startswith("error: ") and "Traceback" not in error, error
    assert not (tmp_path / "prepared.datatrove").exists()


def test_a_parquet_column_of_numbers_and_a_chat_field_of_text_are_named(tmp_path, tree_guard, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "part-0.parquet")
    (tmp_path / "chat.jsonl").write_text('{"messages": "hello"}\n')
    base = ["prepare", "--recipe", "tiny_llama", "--output", str(tmp_path / "prepared"), "--engine", "datatrove"]
    with tree_guard():
        assert main([*base, f"data.sources=[{{path: '{tmp_path}/part-*.parquet'}}]"]) == 2
        error = capsys.readouterr().err
        assert f"{tmp_path / 'part-0.parquet'}: column 'text' holds int64 values, not strings" in error
        assert main([*base, f"data.sources=[{{path: {tmp_path / 'chat.jsonl'}, messages_field: messages}}]"]) == 2
        assert f"{tmp_path / 'chat.jsonl'}:1: field 'messages' is a JSON str" in capsys.readouterr().err


@pytest.mark.slow
def test_a_bad_line_is_refused_from_the_command_line_without_a_traceback(tmp_path, tree_guard):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"text": 5}\n')
    command = prepare_command(tmp_path / "prepared", f"data.sources=[{{path: {tmp_path / 'a.jsonl'}}}]")
    with tree_guard():
        done = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    assert f"{tmp_path / 'a.jsonl'}:2: field 'text' is a JSON int (5), not a string" in done.stderr


@pytest.mark.slow
def test_filters_that_keep_nothing_end_the_job_with_what_each_removed(tmp_path, tree_guard):
    """Before: datatrove's reader stopped the next stage with `RuntimeError: No files found on ...filtered!`."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a few words"] * 3 + [" "]))
    command = prepare_command(tmp_path / "prepared", f"data.sources=[{{path: {tmp_path / 'a.jsonl'}}}]",
                              "data.filters=[{type: length, min_words: 1000}]", tasks=1, workers=1)
    with tree_guard():
        done = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]  # datatrove's task log printed one
    assert done.stderr.splitlines()[-1] == (
        "error: no documents are left (4 read, 1 empty, data.filters.0 (length) removed 3); the quality filters "
        "removed every document: loosen or remove the one that removed them (docs/data_filters.md)")
    assert not (tmp_path / "prepared").exists()


def test_a_hub_record_of_the_wrong_kind_is_a_data_error():
    from data_pipeline.config import DataSource
    from data_pipeline.scale import reader
    from training.base.errors import DataError
    hub = reader(DataSource(hub="HuggingFaceFW/fineweb-edu"), 0)
    with pytest.raises(DataError, match=r"hub, record 3: field 'text' is a JSON int \(5\), not a string"):
        hub.adapter({"text": 5}, "hub", 3)


def test_the_work_folder_follows_the_output_rules(tmp_path, tree_guard, capsys):
    """A folder no job started is not taken over; an input inside the job's folder is refused, as for the output."""
    base = ["prepare", "--recipe", "tiny_llama", "--engine", "datatrove"]
    users = tmp_path / "prepared.datatrove"
    users.mkdir()
    (users / "notes.txt").write_text("a user's notes\n")
    jobs = tmp_path / "other.datatrove"
    jobs.mkdir()
    (jobs / "job.json").write_text('{"fingerprint": "0", "tasks": 2}\n')
    corpus = small_corpus(jobs)
    with tree_guard():
        assert main([*base, "--output", str(tmp_path / "prepared"), f"data.sources=[{{path: {corpus}}}]"]) == 2
        assert f"{users} exists and holds no job.json, so no prepare job started it" in capsys.readouterr().err
        assert main([*base, "--output", str(tmp_path / "other"), f"data.sources=[{{path: {corpus}}}]"]) == 2
        assert f"the job's work folder {jobs} contains {corpus}, which the recipe reads" in capsys.readouterr().err
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "other").exists()


def test_a_local_job_that_ends_without_stats_is_a_failure(corpus, tmp_path, monkeypatch, capsys):
    import data_pipeline.scale
    output = tmp_path / "prepared"
    monkeypatch.setattr(data_pipeline.scale, "run_job", lambda *args: output.with_name("prepared.datatrove"))
    assert main(["prepare", "--recipe", "tiny_llama", "--output", str(output), "--engine", "datatrove",
                 corpus["sources"]]) == 1
    error = capsys.readouterr().err
    assert f"error: the datatrove job ended without writing {output}/stats.json" in error and "submitted" not in error


def small_corpus(folder: Path) -> Path:
    path = folder / "corpus.jsonl"
    path.write_text("".join((REPO / "recipes/tiny_llama/corpus.jsonl").read_text().splitlines(keepends=True)[:200]))
    return path


@pytest.mark.slow
def test_a_rerun_after_the_output_was_deleted_writes_it_again(tmp_path, tree_guard, capsys):
    """datatrove's completion markers say every task is done: the rerun clears assemble's marker (the job wrote it)
    and assembles the rows and evaluation documents the job kept again; with either of those gone too, it says what
    to delete."""
    output, work = tmp_path / "prepared", tmp_path / "prepared.datatrove"
    overrides = (f"data.sources=[{{path: {small_corpus(tmp_path)}}}]", "data.seq_len=64", "data.eval.fraction=0.1")
    run_job(output, *overrides, tasks=1, workers=1)
    first = {p.relative_to(output): p.read_bytes() for p in output.rglob("*") if p.is_file()}
    shutil.rmtree(output)
    with tree_guard(work / "logs" / "assemble"):
        run_job(output, *overrides, tasks=1, workers=1)
    assert {p.relative_to(output): p.read_bytes() for p in output.rglob("*") if p.is_file()} == first
    shutil.rmtree(output)
    args = ["prepare", "--recipe", "tiny_llama", "--output", str(output), "--engine", "datatrove", "--tasks", "1",
            *overrides]
    for kept in ("rows", "eval_documents"):
        shutil.move(work / kept, tmp_path / kept)
        with tree_guard():
            assert main(args) == 2
        error = " ".join(capsys.readouterr().err.split())
        assert f"{output} is not there and the job's files of finished tasks are gone too ({work}/{kept}" in error
        assert f"remove {work} to run the job again from the start" in error and not output.exists()
        shutil.move(tmp_path / kept, work / kept)
