"""W&B's offline run file, read back (verified for wandb 0.31.0, requirements.txt).

wandb 0.31 writes an offline run (WANDB_MODE=offline) as `run-<id>.wandb` from its Go core and ships no Python
reader of it: the tests read what a run logged from that file, so that they compare W&B's record, not our calls.
The file is LevelDB's log format (32 KiB blocks of records, each with a 7-byte header: CRC-32, length, type;
a record cut at a block end continues as FIRST/MIDDLE/LAST pieces) after a 7-byte file header (':W&B', magic,
version); each record is a `wandb_internal_pb2.Record` protobuf."""
import json
import struct
from pathlib import Path

from training.compat import NO_ISSUE, Patch

VERIFIED_FOR = "0.31.0"
PATCHES = (
    Patch("read_offline_run", "wandb", VERIFIED_FOR,
          "an offline run is a LevelDB-log file of protobuf records written by wandb-core (Go); wandb has no Python "
          "reader of it", NO_ISSUE, "tests/training/compat/test_wandb.py::test_an_offline_run_file_reads_back",
          proofs=("tests/training/loop/test_trackers.py::test_wandb_and_mlflow_get_what_metrics_jsonl_gets",)),
)

FILE_HEADER = struct.Struct("<4sHB")  # ':W&B', 0xBEE1, version 0
RECORD_HEADER = struct.Struct("<IHB")  # crc32, length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def record_payloads(data: bytes) -> list[bytes]:
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


def read_offline_run(path: Path) -> dict:
    """An offline run file's {'id', 'project', 'name', 'config', 'history': [{'_step': n, key: value, ...}],
    'summary'}: what W&B would show for the run."""
    from wandb.proto import wandb_internal_pb2

    run = {"config": {}, "history": [], "summary": {}}
    for payload in record_payloads(Path(path).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
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
