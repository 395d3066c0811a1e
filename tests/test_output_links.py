"""Symbolic links where a command writes (issue 68): every command refuses, before anything is removed or written, a
link of another's at a name it writes, at a folder it writes into, or as its output itself, naming the link, what it
points to and the way out; a link elsewhere is kept and never followed. Each command through its main(argv), in
process (tests/test_bad_input.py's run_command); the tree guard holds every file under the test's folder, the links'
targets included, to what it was."""
import os
import shutil
from pathlib import Path

import pytest

from tests.test_bad_input import assert_refused, fake_tag, run_command
from training.base.output_guard import files_under
from training.state.output_dir import check_output_dir

TARGETS = ("a folder outside", "a file outside", "nothing (dangling)")


@pytest.fixture(autouse=True)
def no_model_building(monkeypatch):
    """A train.py that got past its checks fails the test there, instead of training in the test's process."""
    import train

    def forbidden(*args, **kwargs):
        raise AssertionError("train.py went past validation")
    monkeypatch.setattr(train, "build_run_model", forbidden)
    monkeypatch.setattr(train.distributed, "init_distributed", forbidden)


def link(path: Path, target: str, outside: Path) -> None:
    """A link at `path` to a folder of the user's (holding a file), a file of theirs, or a path that does not exist."""
    (outside / "folder").mkdir(parents=True, exist_ok=True)
    (outside / "folder" / "config.json").write_text("the user's")
    (outside / "file.txt").write_text("the user's")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to({"a folder outside": outside / "folder", "a file outside": outside / "file.txt",
                     "nothing (dangling)": outside / "missing"}[target])


def finished_run(run: Path) -> Path:
    """earlier_run (tests/conftest.py) as a finished run leaves it: hf/ exported, the marker listing its files."""
    (run / "hf").mkdir()
    (run / "hf" / "config.json").write_text("{}")
    (run / "summary.json").write_text("{}")
    (run / ".written-by.json").write_text('{"command": "train.py", "files": %s}\n'
                                          % str(sorted(files_under(run))).replace("'", '"'))
    return run


RUN_WRITES = ["hf", "checkpoints", "tensorboard", "benchmarks", "adapter", "metrics.jsonl", "summary.json",
              "checkpoints/latest", "checkpoints/universal", "checkpoints/zero_to_torch.py", "hf/config.json",
              "checkpoints/global_step6"]


@pytest.mark.parametrize("flag", ["--overwrite", "--resume"])
@pytest.mark.parametrize("name", RUN_WRITES)
def test_train_py_refuses_a_link_where_the_run_writes(earlier_run, name, flag, tmp_path, tree_guard):
    """The case of the issue: a finished run whose hf is the user's link; --overwrite (and --resume, whose export and
    saves write there too) stops by name before anything is removed, the link and its target untouched. The run's
    own file or folder at the name, where there is one, is moved out first (the user's doing)."""
    run, outside = finished_run(earlier_run), tmp_path / "outside"
    if (run / name).exists():
        outside.mkdir(exist_ok=True)
        shutil.move(run / name, outside / "moved")
        (run / name).symlink_to(outside / "moved")
    else:
        link(run / name, "a folder outside", outside)
    with tree_guard():
        result = run_command("train.py", "--recipe", "tiny_llama", "--output-dir", str(run), flag)
    assert_refused(result, f"holds {name} (a symbolic link to {os.readlink(run / name)}), which train.py did not "
                           f"write, where the run writes: nothing was deleted; remove the link (rm {run / name}: what "
                           f"it points to stays), or choose another --output-dir")
    assert (run / name).is_symlink()


@pytest.mark.parametrize("target", TARGETS)
def test_train_py_keeps_a_link_where_the_run_does_not_write(earlier_run, target, tmp_path):
    """A link of the user's beside the run (or inside an earlier checkpoint, on resume) passes the checks; --overwrite
    then keeps it as it keeps their files."""
    run = finished_run(earlier_run)
    link(run / "my_data", target, tmp_path / "outside")
    check_output_dir(run, resume=False, overwrite=True, inputs=[])
    link(run / "checkpoints/global_step2/notes", target, tmp_path / "outside")
    check_output_dir(run, resume=True, overwrite=False, inputs=[])


@pytest.mark.parametrize("target", TARGETS)
def test_an_output_that_is_a_link_is_refused_by_every_command(target, tmp_path, tree_guard):
    """train.py, export, evaluate, prepare, dedup and compare: the output named is a link; nothing is written through
    it, with or without --overwrite."""
    output = tmp_path / "out"
    link(output, target, tmp_path / "outside")
    (tmp_path / "in.jsonl").write_text('{"text": "one"}\n')
    fake_tag(tmp_path / "checkpoints")
    commands = {
        "train.py": ["train.py", "--recipe", "tiny_llama", "--output-dir", str(output), "--overwrite"],
        "--output-dir": ["tools/compare_zero.py", "--recipe", "tiny_llama", "--output-dir", str(output), "--overwrite"],
        "OUT_DIR": ["-m", "training", "export", str(tmp_path / "checkpoints"), str(output), "--overwrite"],
        "--output": ["-m", "data_pipeline", "prepare", "--recipe", "tiny_llama", "--output", str(output)],
        "OUT": ["-m", "data_pipeline", "dedup", str(tmp_path / "in.jsonl"), str(output), "--overwrite"],
    }
    for option, argv in commands.items():
        with tree_guard():
            result = run_command(*argv)
        shown = "--output-dir" if option == "train.py" else option
        assert_refused(result, f"{shown} {output} is a symbolic link (to {os.readlink(output)}), which the command "
                               f"would write through; name the real")
    assert output.is_symlink() and not (tmp_path / "outside" / "missing").exists()


def test_the_default_output_steps_past_a_link(tmp_path, monkeypatch):
    from training.state import output_dir
    monkeypatch.setattr(output_dir, "OUTPUT_ROOT", tmp_path)
    link(tmp_path / "tiny_llama", "nothing (dangling)", tmp_path / "outside")
    assert output_dir.default_output_dir("tiny_llama", resume=False) == tmp_path / "tiny_llama-2"


@pytest.mark.parametrize("name", ["comparison.md", "deepspeed.config=zero0.log", "deepspeed.config=zero0",
                                  "deepspeed.config=zero0/hf"])
def test_compare_refuses_a_link_where_the_comparison_writes(name, tmp_path, tree_guard):
    """An earlier comparison (marked, its files listed), a link of the user's at a report, a cell's log, a cell's
    folder or inside one: --overwrite stops by name before anything is removed."""
    out = tmp_path / "out"
    (out / "deepspeed.config=zero1").mkdir(parents=True)
    (out / "comparison.csv").write_text("")
    (out / ".written-by.json").write_text('{"command": "tools/compare.py", "files": ["comparison.csv"]}\n')
    link(out / name, "a folder outside", tmp_path / "outside")
    with tree_guard():
        result = run_command("tools/compare_zero.py", "--recipe", "tiny_llama", "--stages", "0,1", "--output-dir",
                             str(out), "--overwrite")
    assert_refused(result, f"holds {name} (a symbolic link to {tmp_path / 'outside/folder'}), which tools/compare.py "
                           f"did not write, where the comparison writes: nothing was deleted; remove the link")


def test_convert_refuses_a_link_where_the_conversion_writes(tmp_path, tree_guard):
    checkpoints = tmp_path / "checkpoints"
    fake_tag(checkpoints)
    link(checkpoints / "universal", "a folder outside", tmp_path / "outside")
    with tree_guard():
        result = run_command("-m", "training", "convert", str(checkpoints))
    assert_refused(result, f"{checkpoints / 'universal'} is a symbolic link (to {tmp_path / 'outside/folder'}) where "
                           f"the universal conversion of global_step2 writes: nothing was written; remove the link")
    assert sorted(p.name for p in (tmp_path / "outside/folder").iterdir()) == ["config.json"]
