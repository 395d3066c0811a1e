"""train.py's output folder as a run writes it (training/state/output_dir.py): --overwrite and the pruning of old
checkpoints remove the run's own files and keep, and name, the user's (issue 50); a file of the user's where the new
run writes is refused before anything is removed."""
import json

import pytest

from tests.conftest import SMALL_MODEL, run_train
from training.base.output_guard import MARKER, files_under, listed_files

USERS = {"NOTES.md": "mine", "benchmarks/my_eval.py": "mine", "evals/results.json": "{}",
         "evals/.written-by.json": '{"command": "python -m training evaluate", "files": ["results.json"]}\n'}


@pytest.mark.slow
def test_overwrite_and_checkpoint_pruning_keep_the_files_the_run_did_not_write(tmp_path, data_cache):
    out = tmp_path / "run"
    args = ["--recipe", "tiny_llama", "--output-dir", str(out), SMALL_MODEL, data_cache, "logging.every_steps=1",
            "checkpointing.every_steps=1", "checkpointing.keep_last=1"]
    result = run_train([*args, "training.max_steps=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    run = listed_files(out)
    assert {"metrics.jsonl", "summary.json", "checkpoints/latest", "hf/config.json"} <= run == files_under(out)
    for name, text in {**USERS, "checkpoints/global_step2/mine.txt": "mine"}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)

    result = run_train([*args, "--resume", "training.max_steps=3"])  # keep_last=1 prunes global_step2
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kept 1 file that train.py did not write: checkpoints/global_step2/mine.txt" in result.stdout
    assert files_under(out / "checkpoints/global_step2") == {"mine.txt"}

    before = {name: (out / name).read_bytes() for name in files_under(out)}
    result = run_train([*args, "--overwrite", "training.max_steps=1"])
    assert result.returncode == 2
    assert "holds checkpoints/global_step2/mine.txt, which train.py did not write, where the run writes: nothing was " \
           "deleted" in " ".join(result.stderr.split())
    assert {name: (out / name).read_bytes() for name in files_under(out)} == before

    (out / "checkpoints/global_step2/mine.txt").unlink()
    result = run_train([*args, "--overwrite", "training.max_steps=1"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("kept 4 files that train.py did not write: NOTES.md, benchmarks/my_eval.py, evals/.written-by.json, "
            "evals/results.json") in result.stdout
    assert all((out / name).read_text() == text for name, text in USERS.items())
    assert files_under(out) - listed_files(out) == set(USERS)
    assert not (out / "checkpoints/global_step3").exists()
    assert (out / "checkpoints/latest").read_text() == "global_step1"
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert json.loads((out / MARKER).read_text())["command"] == "train.py"
