"""Canary of training/compat/wandb.py: the offline run file still reads back as what the run logged, once W&B's
service has written it whole (its exit record last), and a file the service is still writing is waited for."""
import threading

import pytest
import wandb

from training.compat.wandb import FILE_HEADER, finished_run_records, read_offline_run, record_payloads


@pytest.fixture(scope="module")
def run_file(tmp_path_factory):
    """A finished offline run: three logged steps, a config and a summary."""
    folder = tmp_path_factory.mktemp("wandb")
    patch = pytest.MonkeyPatch()
    patch.setenv("WANDB_MODE", "offline")
    patch.setenv("WANDB_SILENT", "true")
    try:
        run = wandb.init(project="canary", name="one", id="canary1", dir=str(folder), config={"recipe": {"a": 1}})
        for step in range(1, 4):
            run.log({"loss": 1.0 / step, "train/lr": step * 1e-3}, step=step)
        run.summary.update({"final_loss": 0.25})
        run.finish()
    finally:
        patch.undo()
    file, = folder.glob("wandb/offline-run-*-canary1/run-canary1.wandb")
    finished_run_records(file, timeout=60)  # right after finish() the service may still be writing it: the fast test
    return file  # below cuts the finished file's bytes (seen empty of records on a loaded machine)


@pytest.mark.slow
def test_an_offline_run_file_reads_back(run_file):
    read = read_offline_run(run_file)
    assert (read["id"], read["project"], read["name"]) == ("canary1", "canary", "one")
    assert read["config"]["recipe"] == {"a": 1}
    assert [(h["_step"], h["loss"], h["train/lr"]) for h in read["history"]] == \
        [(1, 1.0, 1e-3), (2, 0.5, 2e-3), (3, 1 / 3, 3e-3)]
    assert read["summary"]["final_loss"] == 0.25


@pytest.mark.slow
def test_a_finished_run_file_ends_with_its_exit_record(run_file):
    """What finished_run_records waits for: the exit record, written last and once (wandb-core 0.31)."""
    kinds = [record.WhichOneof("record_type") for record in finished_run_records(run_file)]
    assert kinds[-1] == "exit" and kinds.count("exit") == 1 and kinds.index("run") < kinds.index("history")


def test_a_half_written_run_file_is_waited_for(run_file, tmp_path):
    """The file as the service leaves it before it closes the run (the header alone, or the records up to a flush,
    one cut in two) is refused after the timeout, naming the file, instead of read as a run with no history; a file
    completed while the reader waits is read whole."""
    data = run_file.read_bytes()
    last = record_payloads(data)[-1]
    for cut in (FILE_HEADER.size, len(data) - len(last) // 2, len(data) - len(last) - 7):
        partial = tmp_path / f"cut{cut}.wandb"
        partial.write_bytes(data[:cut])
        with pytest.raises(TimeoutError, match=f"{partial}: W&B's run file has no exit record"):
            finished_run_records(partial, timeout=0.05)
    growing = tmp_path / "growing.wandb"
    growing.write_bytes(data[:FILE_HEADER.size])
    writer = threading.Timer(0.3, growing.write_bytes, [data])
    writer.start()
    try:
        assert read_offline_run(growing, timeout=30) == read_offline_run(run_file)
    finally:
        writer.join()
