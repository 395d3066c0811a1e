"""Canary of training/compat/wandb.py: the offline run file still reads back as what the run logged."""
import wandb

from training.compat.wandb import read_offline_run


def test_an_offline_run_file_reads_back(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="canary", name="one", id="canary1", dir=str(tmp_path), config={"recipe": {"a": 1}})
    for step in range(1, 4):
        run.log({"loss": 1.0 / step, "train/lr": step * 1e-3}, step=step)
    run.summary.update({"final_loss": 0.25})
    run.finish()
    file, = tmp_path.glob("wandb/offline-run-*-canary1/run-canary1.wandb")
    read = read_offline_run(file)
    assert (read["id"], read["project"], read["name"]) == ("canary1", "canary", "one")
    assert read["config"]["recipe"] == {"a": 1}
    assert [(h["_step"], h["loss"], h["train/lr"]) for h in read["history"]] == \
        [(1, 1.0, 1e-3), (2, 0.5, 2e-3), (3, 1 / 3, 3e-3)]
    assert read["summary"]["final_loss"] == 0.25
