"""Bad input to `python -m data_pipeline prepare` and `dedup`: exit code 2 and an `error: ...` naming the file (and
line) and the fix, before any work, and nothing outside what the command created is deleted or changed (tree
guard). Most cases run the command's main() in this process, which re-raises anything that is not a user
error (so a traceback fails the test); one case per class runs the real command line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_pipeline.__main__ import main
from tests.conftest import REPO, TRAIN_ENV, run_train
from training.base.output_guard import written_by

CORPUS = REPO / "recipes/tiny_llama/corpus.jsonl"
PREPARE = "python -m data_pipeline prepare"
DEDUP = "python -m data_pipeline dedup"


def refused(capsys, argv: list[str], *messages: str) -> None:
    """main(argv) exits 2 with each message in its `error: ...` line."""
    assert main(argv) == 2
    error = " ".join(capsys.readouterr().err.split())
    assert "error: " in error and "Traceback" not in error, error
    for message in messages:
        assert message in error, error


def run_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data_pipeline", *args], cwd=REPO, env=TRAIN_ENV, capture_output=True,
                          text=True, timeout=300)


def assert_refused(result: subprocess.CompletedProcess, *messages: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    for message in messages:
        assert message in " ".join(result.stderr.split()), result.stderr[-3000:]


def prepare_args(output: Path, *overrides: str) -> list[str]:
    return ["prepare", "--recipe", "tiny_llama", "--output", str(output), *overrides]


def small_corpus(folder: Path, lines: int = 60) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.jsonl"
    path.write_text("".join(CORPUS.read_text().splitlines(keepends=True)[:lines]))
    return path


# 1. prepare's --output follows training/base/output_guard.py, checked before any work

@pytest.mark.parametrize("output, message", [
    ("{tmp}/some_file.txt/out", "some_file.txt is a file, not a folder; choose another --output"),
    ("{tmp}/data", "contains {tmp}/data/corpus.jsonl, which this command reads"),
    ("{tmp}/data/corpus.jsonl/out", "lies inside {tmp}/data/corpus.jsonl, which this command reads"),
    ("{repo}/recipes/tiny_llama/tokenizer", "contains {repo}/recipes/tiny_llama/tokenizer, which this command reads"),
    ("{repo}/recipes/tiny_llama/tokenizer/prepared", "lies inside {repo}/recipes/tiny_llama/tokenizer"),
    ("{repo}/recipes/tiny_llama/config.json", "contains {repo}/recipes/tiny_llama/config.json"),
    ("{repo}/recipes/tiny_llama/recipe.yaml/out", "lies inside {repo}/recipes/tiny_llama/recipe.yaml"),
    ("{tmp}/mine", "{tmp}/mine already exists; choose another --output"),
], ids=["under a file", "holds a data file", "inside a data file", "the tokenizer folder", "inside the tokenizer",
        "the model config", "inside the recipe file", "an existing folder"])
def test_prepare_refuses_an_output_that_breaks_the_output_rules(output, message, tmp_path, tree_guard, capsys,
                                                                  monkeypatch):
    import training.models.model
    monkeypatch.setattr(training.models.model, "load_tokenizer", lambda *args, **kwargs: pytest.fail("work started"))
    small_corpus(tmp_path / "data")
    (tmp_path / "some_file.txt").write_text("a user's file\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's notes\n")
    fill = {"tmp": tmp_path, "repo": REPO}
    sources = f"data.sources=[{{path: {tmp_path}/data/corpus.jsonl}}]"
    with tree_guard():
        refused(capsys, prepare_args(Path(output.format(**fill)), sources), message.format(**fill))
    assert not (REPO / "recipes/tiny_llama/tokenizer/prepared").exists()


def test_prepare_refuses_an_output_in_a_folder_it_cannot_write(tmp_path, tree_guard, capsys, monkeypatch):
    """The check is os.access (this suite may run as root, to whom chmod does not deny writing)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and access(path, mode))
    with tree_guard():
        refused(capsys, prepare_args(locked / "prepared"),
                f"{locked} is not writable by this user; choose another --output")
    assert not (locked / "prepared").exists()


@pytest.mark.slow
def test_prepare_refuses_an_output_under_a_file_from_the_command_line(tmp_path, tree_guard):
    (tmp_path / "some_file.txt").write_text("a user's file\n")
    with tree_guard():
        result = run_command(*prepare_args(tmp_path / "some_file.txt" / "out"))
    assert_refused(result, f"{tmp_path / 'some_file.txt'} is a file, not a folder; choose another --output")


def test_prepare_marks_its_output(tmp_path, tree_guard):
    output = tmp_path / "prepared"
    with tree_guard():
        assert main(prepare_args(output, f"data.sources=[{{path: {small_corpus(tmp_path / 'data')}}}]",
                                 "data.seq_len=64")) == 0
    assert written_by(output) == PREPARE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "prepared"]  # no staging folder left behind


# 3. a damaged prepared folder

@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A real prepared folder (the in-process engine) of a slice of tiny_llama's corpus."""
    folder = tmp_path_factory.mktemp("prepared")
    output = folder / "prepared"
    assert main(prepare_args(output, f"data.sources=[{{path: {small_corpus(folder / 'data', 200)}}}]",
                             "data.seq_len=64")) == 0
    return output


def damaged_copy(prepared: Path, folder: Path, damage: str) -> tuple[Path, Path]:
    """A copy of the prepared folder with one file damaged; the damaged file."""
    import shutil
    copy = folder / "damaged"
    shutil.copytree(prepared, copy)
    arrow = next(copy.glob("train/*.arrow"))
    if damage == "truncated":
        arrow.write_bytes(arrow.read_bytes()[:arrow.stat().st_size // 2])
        return copy, arrow
    if damage == "empty":
        arrow.write_bytes(b"")
        return copy, arrow
    if damage == "garbage":
        arrow.write_bytes(b"garbage " * (arrow.stat().st_size // 8))
        return copy, arrow
    if damage == "no state.json":
        (copy / "train/state.json").unlink()
        return copy, copy / "train/state.json"
    (copy / "stats.json").write_text('{"documents_in": 1')  # "truncated stats.json"
    return copy, copy / "stats.json"


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "no state.json", "truncated stats.json"])
def test_a_damaged_prepared_folder_is_named_with_its_file_before_any_work(damage, prepared, tmp_path, tree_guard):
    from pydantic import ValidationError

    from data_pipeline.config import DataConfig
    folder, damaged = damaged_copy(prepared, tmp_path, damage)
    with tree_guard(), pytest.raises(ValidationError) as refusal:
        DataConfig(prepared=str(folder), seq_len=64)
    message = str(refusal.value)
    assert f"{folder} is a damaged prepared data set: {damaged}: " in message
    assert "prepare it again (`python -m data_pipeline prepare --recipe R --output NEW_DIR`)" in message


@pytest.mark.slow
def test_train_py_refuses_a_truncated_arrow_file_with_exit_2(prepared, tmp_path, tree_guard):
    folder, damaged = damaged_copy(prepared, tmp_path, "truncated")
    with tree_guard():
        result = run_train(["--recipe", "tiny_llama", "--output-dir", str(tmp_path / "run"), "data.sources=[]",
                            f"data.prepared={folder}", "data.seq_len=64", "training.max_steps=1"])
    assert_refused(result, f"{folder} is a damaged prepared data set: {damaged}: Expected to be able to read",
                   "prepare it again")
    assert not (tmp_path / "run").exists()


def test_a_damaged_cache_entry_names_itself_and_the_fix(tmp_path, tree_guard):
    from transformers import AutoTokenizer

    from data_pipeline.config import DataConfig
    from data_pipeline.prepare import cached_path, prepare_dataset
    from training.base.errors import DataError
    tokenizer = AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer")
    config = DataConfig(sources=[{"path": str(small_corpus(tmp_path / "data"))}], seq_len=64,
                        cache_dir=str(tmp_path / "cache"))
    prepare_dataset(config, tokenizer)
    entry = cached_path(config, tokenizer)
    arrow = next(entry.glob("train/*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:100])
    with tree_guard(), pytest.raises(DataError, match=rf"{entry} is a damaged prepared data set: {arrow}: .*it is a "
                                                      rf"cache entry: delete it \(rm -r {entry}\)"):
        prepare_dataset(config, tokenizer)


# 4 and 5. a data file that cannot be read: the file, the line and the fix

BAD_FILES = [
    ("a.jsonl", b'{"text": "fine"}\n{"text": 5}\n', "a.jsonl:2: field 'text' is a JSON int (5), not a string"),
    ("a.jsonl", b'{"text": ["a", "b"]}\n', "a.jsonl:1: field 'text' is a JSON list ([\"a\", \"b\"]), not a string"),
    ("a.jsonl", b'{"text": "fine"}\n{"text": {"nested": 1}}\n', "a.jsonl:2: field 'text' is a JSON dict"),
    ("a.jsonl", b'{"text": "fine"}\n{"text": "broken"\n',
     "a.jsonl:2: not valid JSON (Expecting ',' delimiter at column 18)"),
    ("a.jsonl", b'{"text": "fine"}\n[1, 2]\n', "a.jsonl:2: a JSON list, not an object"),
    ("a.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', "a.jsonl:2: not UTF-8"),
    ("a.jsonl", b'{"text": "fine", "title": "caf\xe9"}\n{"text": "caf\xe9"}\n', "a.jsonl:1: not UTF-8"),
    ("a.json", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', "a.json:2: not UTF-8"),
    ("a.json", b'[{"text": "fine"},\n {"text": "caf\xe9"}]\n', "a.json:2: not UTF-8"),
    ("a.csv", b'text\nfine\ncaf\xe9\n', "a.csv:3: not UTF-8"),
    ("a.txt", b'fine\ncaf\xe9\n', "a.txt:2: not UTF-8"),
    ("a.jsonl", b"", "a.jsonl is empty (0 bytes): it holds no documents"),
    ("a.jsonl", b"  \n\n \t\n", "a.jsonl is empty (only whitespace): it holds no documents"),
    ("a.csv", b"", "a.csv is empty (0 bytes)"),
]
BAD_FILE_IDS = ["int text", "list text", "object text", "bad JSON", "not an object", "latin-1 jsonl",
                "latin-1 in another field", "latin-1 json lines", "latin-1 json array", "latin-1 csv", "latin-1 txt",
                "empty jsonl", "whitespace jsonl", "empty csv"]


@pytest.mark.parametrize("name, content, message", BAD_FILES, ids=BAD_FILE_IDS)
def test_prepare_names_the_file_and_line_of_bad_data(name, content, message, tmp_path, tree_guard, capsys):
    (tmp_path / name).write_bytes(content)
    with tree_guard():
        refused(capsys, prepare_args(tmp_path / "prepared", f"data.sources=[{{path: {tmp_path / name}}}]"),
                f"{tmp_path}/{message}")
    assert not (tmp_path / "prepared").exists()


def test_a_chat_source_whose_messages_are_not_turns_is_named(tmp_path, tree_guard, capsys):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" +
                    json.dumps({"messages": "hello"}) + "\n")
    sources = f"data.sources=[{{path: {chat}, messages_field: messages}}]"
    with tree_guard():
        refused(capsys, prepare_args(tmp_path / "prepared", sources),
                f"{chat}:2: field 'messages' is a JSON str (\"hello\"), not a list of", "set messages_field")


def test_a_parquet_column_of_numbers_is_named(tmp_path, tree_guard, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "a.parquet")
    with tree_guard():
        refused(capsys, prepare_args(tmp_path / "prepared", f"data.sources=[{{path: {tmp_path / 'a.parquet'}}}]"),
                f"{tmp_path / 'a.parquet'}: column 'text' holds int64 values, not strings")


@pytest.mark.slow
def test_non_string_text_is_refused_from_the_command_line(tmp_path, tree_guard):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"text": 5}\n')
    with tree_guard():
        result = run_command(*prepare_args(tmp_path / "prepared", f"data.sources=[{{path: {tmp_path / 'a.jsonl'}}}]"))
    assert_refused(result, f"{tmp_path / 'a.jsonl'}:2: field 'text' is a JSON int (5), not a string",
                   "set text_field to the field that holds the text")


# 6. dedup: --overwrite replaces only an earlier dedup's output, written atomically

def dedup_input(folder: Path) -> Path:
    source = folder / "in.jsonl"
    source.write_text('{"text": "one"}\n{"text": "One"}\n{"text": "two"}\n')
    return source


def test_dedup_overwrite_replaces_an_earlier_dedup_and_marks_its_output(tmp_path, tree_guard, capsys):
    source, output = dedup_input(tmp_path), tmp_path / "out.jsonl"
    with tree_guard():
        assert main(["dedup", str(source), str(output), "--no-near"]) == 0
    assert output.read_text() == '{"text": "one"}\n{"text": "two"}\n' and written_by(output, folder=False) == DEDUP
    source.write_text('{"text": "three"}\n')
    with tree_guard(output, output.with_name(".out.jsonl.written-by.json")):
        assert main(["dedup", str(source), str(output), "--no-near", "--overwrite"]) == 0
    assert output.read_text() == '{"text": "three"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.jsonl.written-by.json", "in.jsonl", "out.jsonl"]


@pytest.mark.parametrize("output, args, message", [
    ("mine.jsonl", ["--overwrite"], "--overwrite replaces only an earlier output of python -m data_pipeline dedup, and "
                                    "{tmp}/mine.jsonl is not one"),
    ("mine.jsonl", [], "OUT {tmp}/mine.jsonl already exists; choose another OUT, or pass --overwrite"),
    ("mine.jsonl/out.jsonl", [], "{tmp}/mine.jsonl is a file, not a folder; choose another OUT"),
    ("in.jsonl/out.jsonl", [], "lies inside {tmp}/in.jsonl, which this command reads"),
    (".", ["--overwrite"], "contains {tmp}/in.jsonl, which this command reads"),
], ids=["unmarked file with --overwrite", "existing file", "under a file", "under the input", "the input's folder"])
def test_dedup_refuses_an_output_it_may_not_write(output, args, message, tmp_path, tree_guard, capsys):
    source = dedup_input(tmp_path)
    (tmp_path / "mine.jsonl").write_text("a user's file\n")
    with tree_guard():
        refused(capsys, ["dedup", str(source), str(tmp_path / output), *args], message.format(tmp=tmp_path))
    assert (tmp_path / "mine.jsonl").read_text() == "a user's file\n"


def test_dedup_refuses_an_output_in_a_folder_it_cannot_write(tmp_path, tree_guard, capsys, monkeypatch):
    source, locked = dedup_input(tmp_path), tmp_path / "locked"
    locked.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and access(path, mode))
    with tree_guard():
        refused(capsys, ["dedup", str(source), str(locked / "out.jsonl")], f"{locked} is not writable by this user")
    assert not list(locked.iterdir())


def test_dedup_leaves_an_earlier_output_whole_when_it_fails(tmp_path, tree_guard, capsys, monkeypatch):
    """The new output is written beside the old one and renamed over it: a failure before the rename leaves the
    earlier output as it was, and no partial file."""
    from training.base import output_guard
    source, output = dedup_input(tmp_path), tmp_path / "out.jsonl"
    assert main(["dedup", str(source), str(output), "--no-near"]) == 0
    before = output.read_bytes()

    def fail(*args):
        raise OSError(28, "No space left on device", str(args[0]))

    monkeypatch.setattr(output_guard.os, "replace", fail)  # output_guard.write_atomically's rename
    with tree_guard():
        refused(capsys, ["dedup", str(source), str(output), "--no-near", "--overwrite"], "No space left on device")
    assert output.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.jsonl.written-by.json", "in.jsonl", "out.jsonl"]


@pytest.mark.parametrize("content, message", [
    (b'{"text": "one"}\n{"text": 5}\n', "in.jsonl:2: field 'text' is a JSON int (5), not a string"),
    (b"", "in.jsonl is empty (0 bytes); pass a .jsonl file"),
    (b"\n  \n", "in.jsonl is empty (only whitespace)"),
], ids=["int text", "empty", "whitespace"])
def test_dedup_names_bad_input(content, message, tmp_path, tree_guard, capsys):
    (tmp_path / "in.jsonl").write_bytes(content)
    with tree_guard():
        refused(capsys, ["dedup", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")], message)
    assert not (tmp_path / "out.jsonl").exists()


def test_dedup_refuses_an_unmarked_output_from_the_command_line(tmp_path, tree_guard):
    source = dedup_input(tmp_path)
    (tmp_path / "mine.jsonl").write_text("a user's file\n")
    with tree_guard():
        result = run_command("dedup", str(source), str(tmp_path / "mine.jsonl"), "--overwrite")
    assert_refused(result, f"{tmp_path / 'mine.jsonl'} is not one (no .mine.jsonl.written-by.json naming it)")


def test_an_empty_shard_among_others_is_read_and_an_all_empty_glob_refused(tmp_path):
    from pydantic import ValidationError

    from data_pipeline.config import DataSource
    from data_pipeline.sources import load_documents
    (tmp_path / "part-0.jsonl").write_text("")
    (tmp_path / "part-1.jsonl").write_text('{"text": "a document"}\n')
    assert load_documents([DataSource(path=str(tmp_path / "part-*.jsonl"))])["text"] == ["a document"]
    (tmp_path / "part-1.jsonl").write_text(" \n")
    with pytest.raises(ValidationError, match="every file .*part-\\*.jsonl matches is empty: the source holds no"):
        DataSource(path=str(tmp_path / "part-*.jsonl"))
