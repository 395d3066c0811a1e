"""Property-based: random overrides, paths and numbers thrown at train.py's plan and at the command lines.

Whatever the input, a command exits 0 or 2 (argparse's usage errors included) or gets as far as its real
work (stopped here by a sentinel, so that no example trains), never ends in a traceback, and never deletes or
changes a file it did not create: a tree guard records every file under the test's folder (an earlier run, a
data file) and the repository's recipes and DeepSpeed configs before and after each example. Outputs are placed
inside, beside and above the commands' inputs. The examples are derandomized, so that CI explores the same ones
every time; run with HYPOTHESIS_EXAMPLES=2000 to search further.
"""
import json
import os
from pathlib import Path
from typing import get_args

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import data_pipeline.__main__ as data_cli
import data_pipeline.prepare
import train
from tests.conftest import REPO, assert_only_created, tree_state
from tools import compare, compare_zero
from training import __main__ as training_cli
from training.config.recipe import Recipe

EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class ReachedTheWork(Exception):
    """Raised where a command would start its real work: everything before it accepted the input."""


def stop_here(*args, **kwargs):
    raise ReachedTheWork


def key_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of the recipe schema, as an override names it."""
    paths = []
    for name, field in model.model_fields.items():
        nested = [a for a in (field.annotation, *get_args(field.annotation)) if isinstance(a, type)
                  and issubclass(a, BaseModel)]
        paths.append(prefix + name)
        if nested:
            paths += key_paths(nested[0], f"{prefix}{name}.")
    return paths


KEYS = key_paths(Recipe) + ["model.config_overrides.num_hidden_layers", "model.config_overrides.hidden_size",
                            "deepspeed.overrides.zero_optimization.stage", "deepspeed.overrides.fp16",
                            "deepspeed.overrides.optimizer.type", "data.sources", "no.such.key", "training..lr", ""]
TRICKY = ["[0.9,", "{a: 1", "'", "", "null", "~", ".nan", ".inf", "-.inf", "[]", "{}", "0", "-1", "1e400", "0x10",
          "true", "[{path: missing.jsonl}]", "../../etc", "/dev/null", "\x00", "ü", "- a\n- b",
          "!!python/object:os.system"]
VALUES = st.one_of(st.sampled_from(TRICKY), st.integers(-2**40, 2**40).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr), st.text(max_size=12),
                   st.lists(st.integers(-3, 3), max_size=3).map(json.dumps))
OVERRIDES = st.lists(st.builds(lambda key, value: f"{key}={value}", st.sampled_from(KEYS), VALUES), max_size=3)
NUMBERS = st.one_of(st.integers(-3, 2**33).map(str), st.sampled_from(["0", "-1", "nan", "inf", "1e3", "2.5", "", "x"]))


def exit_status(command, argv: list[str]) -> int | str:
    try:
        return command(argv)
    except SystemExit as stop:  # argparse's usage errors
        return stop.code
    except ReachedTheWork:
        return "reached the work"


def check(status, capsys) -> None:
    err = capsys.readouterr().err
    assert status in (0, 2, "reached the work"), err[-3000:]
    assert "Traceback" not in err, err[-3000:]


WATCHED = (REPO / "recipes", REPO / "ds_configs")


@pytest.fixture
def workplace(tmp_path, monkeypatch, earlier_run):
    """Commands run in a folder holding an earlier run and a data file, with hub downloads off. Returns the tree
    guard's check: nothing there (or in the repository's recipes and DeepSpeed configs) deleted or changed."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.jsonl").write_text('{"text": "a document"}\n{"text": "another one"}\n')

    def untouched(before: dict) -> None:
        assert_only_created(before, tree_state(tmp_path, *WATCHED))

    return lambda: tree_state(tmp_path, *WATCHED), untouched


@pytest.mark.slow
@SETTINGS
@given(overrides=OVERRIDES, options=st.lists(st.sampled_from(["--dry-run", "--resume", "--overwrite"]), unique=True),
       numbers=st.lists(st.tuples(st.sampled_from(["--num-gpus", "--num-nodes", "--gpu-mem"]), NUMBERS), max_size=2),
       into_earlier_run=st.booleans())
def test_train_py(workplace, monkeypatch, capsys, earlier_run, overrides, options, numbers, into_earlier_run):
    state, untouched = workplace
    before = state()
    monkeypatch.setattr(train.distributed, "run_in_process_group", stop_here)
    output_dir = str(earlier_run if into_earlier_run else Path("out"))
    argv = ["--recipe", "tiny_llama", "--output-dir", output_dir, *options, *[x for pair in numbers for x in pair],
            *overrides]
    check(exit_status(train.main, argv), capsys)
    untouched(before)


INPUTS = ["run/checkpoints", "run/checkpoints/global_step4", "data/in.jsonl",
          str(REPO / "recipes/tiny_llama/tokenizer")]
PATHS = st.one_of(  # outputs (and some inputs) inside, beside and above the inputs
    st.sampled_from(["in.jsonl", "missing.jsonl", ".", "..", "run", "run/metrics.jsonl", "/dev/null", "out.jsonl",
                     "new/out", "run/out", "run/checkpoints/out", "run/checkpoints/global_step4/hf", "data",
                     "data/out", "data/in.jsonl/out", str(REPO / "recipes"), str(REPO / "recipes/tiny_llama/out")]),
    st.sampled_from(INPUTS))
LINES = st.lists(st.one_of(st.builds(lambda t: json.dumps({"text": t}), st.text(max_size=30)),
                           st.binary(max_size=20).map(lambda b: b.decode("latin1")),
                           st.sampled_from(['{"text": 1}', '{"body": "x"}', "[1]", '"s"', "", "{"])), max_size=6)


@pytest.mark.slow
@SETTINGS
@given(paths=st.tuples(st.one_of(st.just("in.jsonl"), PATHS), PATHS), lines=LINES,
       options=st.lists(st.tuples(st.sampled_from(["--num-perm", "--ngram", "--num-proc", "--threshold"]), NUMBERS),
                        max_size=2), flags=st.lists(st.sampled_from(["--no-near", "--shingle=char"]), unique=True))
def test_dedup(workplace, capsys, paths, lines, options, flags):
    state, untouched = workplace
    Path("in.jsonl").write_text("\n".join(lines), encoding="latin1")
    before = state()
    argv = ["dedup", *paths, *flags, *[x for pair in options for x in pair]]
    check(exit_status(data_cli.main, argv), capsys)
    untouched(before)


SOURCES = st.sampled_from([[], ["data.sources=[{path: data/in.jsonl}]"], ["data.eval.sources=[{path: data/in.jsonl}]"],
                            [f"tokenizer.name_or_path={REPO / 'recipes/tiny_llama/tokenizer'}"]])


@pytest.mark.slow
@SETTINGS
@given(overrides=OVERRIDES, sources=SOURCES, output=PATHS,
       engine=st.sampled_from([[], ["--engine", "datatrove"]]))
def test_prepare(workplace, monkeypatch, capsys, overrides, sources, output, engine):
    state, untouched = workplace
    before = state()
    monkeypatch.setattr(data_pipeline.prepare, "build_dataset", stop_here)  # prepare() imports it when it runs
    if engine:
        from data_pipeline import scale
        monkeypatch.setattr(scale, "run_job", stop_here)
    argv = ["prepare", "--recipe", "tiny_llama", "--output", output, *engine, *sources, *overrides]
    check(exit_status(data_cli.main, argv), capsys)
    untouched(before)


@pytest.mark.slow
@SETTINGS
@given(checkpoint=PATHS, output=PATHS, options=st.lists(st.sampled_from(["--overwrite", "--dtype=bf16"]), unique=True))
def test_export(workplace, capsys, checkpoint, output, options):
    state, untouched = workplace
    before = state()
    check(exit_status(training_cli.main, ["export", checkpoint, output, *options]), capsys)
    untouched(before)


@pytest.mark.slow
@SETTINGS
@given(checkpoint=PATHS)
def test_convert(workplace, capsys, checkpoint):
    state, untouched = workplace
    before = state()
    check(exit_status(training_cli.main, ["convert", checkpoint]), capsys)
    untouched(before)


VARIED = st.lists(st.builds(lambda key, values: f"{key}={','.join(values)}",
                            st.sampled_from(["training.lr", "optimizer.name", "deepspeed.config", "training.max_steps",
                                             "logging.every_steps", "precision", "no.such.key", ""]),
                            st.lists(st.sampled_from(["0.001", "0.002", "adamw", "lion", "zero1", "zero3", "fp32", "x",
                                                      "", "[1,2]"]), max_size=3)), min_size=1, max_size=3)


@pytest.mark.slow
@SETTINGS
@given(overrides=OVERRIDES, varied=VARIED, output=st.one_of(st.none(), PATHS),
       flags=st.lists(st.sampled_from(["--overwrite"]), max_size=1),
       numbers=st.lists(st.tuples(st.sampled_from(["--num-gpus", "--steps"]), NUMBERS), max_size=2))
def test_compare(workplace, monkeypatch, capsys, overrides, varied, output, flags, numbers):
    state, untouched = workplace
    before = state()
    monkeypatch.setattr(compare, "run_cell", stop_here)
    # the default output folder: in the test's folder
    monkeypatch.setattr(compare, "OUTPUT_ROOT", Path.cwd() / "outputs")
    argv = ["--recipe", "tiny_llama", *[x for v in varied for x in ("--vary", v)], *flags,
            *(["--output-dir", output] if output else []), *[x for pair in numbers for x in pair], *overrides]
    check(exit_status(compare.main, argv), capsys)
    untouched(before)


@pytest.mark.slow
@SETTINGS
@given(overrides=OVERRIDES,
       numbers=st.lists(st.tuples(st.sampled_from(["--num-gpus", "--steps"]), NUMBERS), max_size=2),
       stages=st.sampled_from([[], ["--stages", "0,1"], ["--stages", "4"], ["--stages", ""]]), output=PATHS)
def test_compare_zero(workplace, monkeypatch, capsys, overrides, numbers, stages, output):
    state, untouched = workplace
    before = state()
    monkeypatch.setattr(compare_zero.compare, "run_cell", stop_here)
    argv = ["--recipe", "tiny_llama", "--output-dir", output, *stages, *[x for pair in numbers for x in pair],
            *overrides]
    check(exit_status(compare_zero.main, argv), capsys)
    untouched(before)
