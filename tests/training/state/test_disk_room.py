"""Room on disk (training/state/disk_room.py): a run whose first checkpoint cannot fit is refused before anything
starts; a save or the export that cannot fit stops the run by name, with the latest checkpoint whole and resumable."""
import json
import os
from types import SimpleNamespace

import pytest

import train
from tests.conftest import SMALL_MODEL, main_in_process, train_in_process
from training import __main__ as training_cli
from training.base.errors import ConfigError
from training.state import disk_room
from training.state.checkpoint import is_complete

MiB = 2**20


def said(result, text: str) -> bool:
    return text in " ".join(result.stderr.split())


def test_a_disk_without_room_for_the_first_checkpoint_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_room, "free_bytes", lambda folder: MiB)
    result = main_in_process(train.main, ["--recipe", "tiny_llama", "--output-dir", str(tmp_path / "run")])
    assert result.returncode == 2, result.stderr[-3000:]
    assert said(result, f"error: the run's first checkpoint needs about 76.3 MiB in {tmp_path / 'run'} and its file "
                        f"system has 1.0 MiB free: free space, or choose an --output-dir on another disk; nothing "
                        f"was started")
    assert not (tmp_path / "run").exists()


def test_a_resume_without_room_names_its_next_checkpoint(earlier_run, monkeypatch):
    monkeypatch.setattr(disk_room, "free_bytes", lambda folder: MiB)
    with pytest.raises(ConfigError, match="the resumed run's next checkpoint needs about"):
        train.make_plan(train.parse_args(["--recipe", "tiny_llama", "--output-dir", str(earlier_run), "--resume"]))


def test_a_file_system_that_reports_no_size_is_not_judged(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_room.shutil, "disk_usage", lambda folder: SimpleNamespace(total=0, free=0))
    disk_room.check_room(tmp_path, 10 * MiB, "a save", "")
    monkeypatch.setattr(disk_room.shutil, "disk_usage", lambda folder: SimpleNamespace(total=100 * MiB, free=MiB))
    with pytest.raises(ConfigError, match="a save needs about 10.0 MiB"):
        disk_room.check_room(tmp_path, 10 * MiB, "a save", "")


def test_overwrite_counts_the_earlier_runs_files_as_room(earlier_run, monkeypatch):
    monkeypatch.setattr(disk_room, "free_bytes", lambda folder: 10 * MiB)
    args = ["--recipe", "tiny_llama", "--output-dir", str(earlier_run)]
    with pytest.raises(ConfigError, match="has 10.0 MiB free once the earlier run is removed"):
        train.make_plan(train.parse_args([*args, "--overwrite"]))
    os.truncate(earlier_run / "checkpoints/global_step2/mp_rank_00_model_states.pt", 100 * MiB)  # sparse: no disk used
    train.make_plan(train.parse_args([*args, "--overwrite"]))
    mine = earlier_run / "notes.bin"  # the user's file stays: it frees nothing
    os.rename(earlier_run / "checkpoints/global_step2/mp_rank_00_model_states.pt", mine)
    with pytest.raises(ConfigError, match="the run's first checkpoint needs about"):
        train.make_plan(train.parse_args([*args, "--overwrite"]))


@pytest.mark.slow
def test_a_save_or_an_export_without_room_stops_the_run_by_name_and_the_run_resumes(tmp_path, data_cache,
                                                                                      monkeypatch):
    out = tmp_path / "run"
    args = ["--recipe", "tiny_llama", "--output-dir", str(out), SMALL_MODEL, data_cache, "training.max_steps=4",
            "checkpointing.every_steps=2", "logging.every_steps=1"]
    # room for the start and the first save; the disk is full once a checkpoint is saved
    monkeypatch.setattr(disk_room, "free_bytes", lambda folder: 0 if (out / "checkpoints/latest").exists() else 2**40)
    result = train_in_process(args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert said(result, "error: checkpoint global_step4 needs about") and \
        said(result, f"in {out / 'checkpoints'} and its file system has 0.0 MiB free: the run stops here without "
                     f"saving it (`latest` names global_step2); free space, or keep fewer checkpoints "
                     f"(checkpointing.keep_last), then continue with --resume --output-dir {out}")
    assert (out / "checkpoints/latest").read_text() == "global_step2" and is_complete(out / "checkpoints/global_step2")
    assert not (out / "checkpoints/global_step4").exists()

    # room for the start and the save, none for the export
    monkeypatch.setattr(disk_room, "free_bytes",
                        lambda folder: 0 if (out / "checkpoints/global_step4").exists() else 2**40)
    result = train_in_process([*args, "--resume"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert said(result, "error: the export of the finished run needs about") and said(
        result, f"its last checkpoint, global_step4, is saved: free space, then export it with python -m training "
                f"export {out / 'checkpoints'} <folder>")
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4] and not (out / "hf").exists()

    export = ["export", str(out / "checkpoints"), str(tmp_path / "export")]
    refused = main_in_process(training_cli.main, export)  # the command, with no more room than the run had
    assert refused.returncode == 2 and said(refused, "error: the export of global_step4 needs about") and \
        said(refused, "free space, or export to another disk; nothing was written")
    assert not (tmp_path / "export").exists()
    monkeypatch.undo()
    exported = main_in_process(training_cli.main, export)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (tmp_path / "export/config.json").is_file()
