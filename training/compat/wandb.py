"""W&B's offline run file, read back (verified for wandb 0.31.0, requirements.txt).

wandb 0.31 writes an offline run (WANDB_MODE=offline) as `run-<id>.wandb` from its Go core and ships no Python
reader of it: the tests read what a run logged from that file, so that they compare W&B's record, not our calls.
The file is LevelDB's log format (32 KiB blocks of records, each with a 7-byte header: CRC-32, length, type;
a record cut at a block end continues as FIRST/MIDDLE/LAST pieces) after a 7-byte file header (':W&B', magic,
version); each record is a `wandb_internal_pb2.Record` protobuf.

`run.finish()` returns before that file is written: it waits for the service to handle the run's exit record, not
to write it. wandb-core keeps the records in a 32 KiB block in memory (written when it fills, and every
`x_transaction_log_flush_interval`, 15 s) and writes the rest when it closes the run's stream, on the
`inform_finish` message that finish() sends without waiting for an answer. Until then the file holds its header
alone or the records up to the last flush (measured on a loaded 2-core machine: the header alone as finish
returned, the whole file 12 ms later). The run's exit record is the last one written: a file that ends with it is
whole."""
import json
import struct
import time
from pathlib import Path

from training.compat import NO_ISSUE, Patch

VERIFIED_FOR = "0.31.0"
PATCHES = (
    Patch("read_offline_run", "wandb", VERIFIED_FOR,
          "an offline run is a LevelDB-log file of protobuf records written by wandb-core (Go); wandb has no Python "
          "reader of it", NO_ISSUE, "tests/training/compat/test_wandb.py::test_an_offline_run_file_reads_back",
          proofs=("tests/training/loop/test_trackers.py::test_wandb_and_mlflow_get_what_metrics_jsonl_gets",)),
    Patch("finished_run_records", "wandb", VERIFIED_FOR,
          "run.finish() returns before wandb-core has written the run's file: the service writes the records it "
          "keeps in memory when it closes the run's stream, on a message finish() sends without waiting; the exit "
          "record is written last", NO_ISSUE,
          "tests/training/compat/test_wandb.py::test_a_finished_run_file_ends_with_its_exit_record",
          proofs=("tests/training/compat/test_wandb.py::test_a_half_written_run_file_is_waited_for",
                  "tests/training/compat/test_wandb.py::test_an_offline_run_file_reads_back")),
)

FILE_HEADER = struct.Struct("<4sHB")  # ':W&B', 0xBEE1, version 0
RECORD_HEADER = struct.Struct("<IHB")  # crc32, length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


FINISH_TIMEOUT_S = 120.0  # how long a finished run's file may take to be written (milliseconds, when all is well)


def record_payloads(data: bytes) -> list[bytes]:
    """The whole records of a run file, as far as it is written (a record cut at the file's end is left out)."""
    if len(data) < FILE_HEADER.size:
        return []
    ident, magic, _ = FILE_HEADER.unpack_from(data)
    if (ident, magic) != (b":W&B", 0xBEE1):
        raise ValueError("not a W&B run file (no ':W&B' header)")
    payloads, pieces, position = [], b"", FILE_HEADER.size
    while position + RECORD_HEADER.size <= len(data):
        left = BLOCK - position % BLOCK
        if left < RECORD_HEADER.size:
            position += left  # a block's tail too short for a header is padding
            continue
        _, length, kind = RECORD_HEADER.unpack_from(data, position)
        if kind == 0:
            position += left
            continue
        start = position + RECORD_HEADER.size
        if start + length > len(data):
            break  # not written yet
        payload, position = data[start:start + length], start + length
        if kind == FULL:
            payloads.append(payload)
        elif kind == FIRST:
            pieces = payload
        elif kind == MIDDLE:
            pieces += payload
        elif kind == LAST:
            payloads.append(pieces + payload)
    return payloads


def finished_run_records(path: Path, timeout: float = FINISH_TIMEOUT_S) -> list:
    """A finished run's records (`wandb_internal_pb2.Record`), once W&B's service has written its file whole (it
    ends with the exit record; module docstring). TimeoutError, naming the file, when it does not within
    `timeout` seconds: the run has not finished, or the service died before writing it."""
    from wandb.proto import wandb_internal_pb2

    path, deadline = Path(path), time.monotonic() + timeout
    while True:
        records = [wandb_internal_pb2.Record.FromString(payload)
                   for payload in (record_payloads(path.read_bytes()) if path.is_file() else [])]
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{path}: W&B's run file has no exit record after {timeout:.0f} s ({len(records)} "
                               f"records written): the run has not finished, or W&B's service (wandb-core) stopped "
                               f"before writing the rest; see the run's logs/debug-core.log")
        time.sleep(0.01)


def read_offline_run(path: Path, timeout: float = FINISH_TIMEOUT_S) -> dict:
    """A finished offline run file's {'id', 'project', 'name', 'config', 'history': [{'_step': n, key: value,
    ...}], 'summary'}: what W&B would show for the run (read once the service has written it whole)."""
    run = {"config": {}, "history": [], "summary": {}}
    for record in finished_run_records(path, timeout):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, project=record.run.project, name=record.run.display_name)
            run["config"].update(items(record.run.config.update))
        elif kind == "config":
            run["config"].update(items(record.config.update))
        elif kind == "history":
            run["history"].append({"_step": record.history.step.num, **items(record.history.item)})
        elif kind == "summary":
            run["summary"].update(items(record.summary.update))
    return run


def items(entries) -> dict:
    return {entry.key or "/".join(entry.nested_key): json.loads(entry.value_json) for entry in entries}
