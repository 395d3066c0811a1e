"""The data stage of a recipe: load, tokenize and pack, cached on disk and reused while nothing changed."""
import hashlib
import json
import os
import shutil
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from data_pipeline import DataError
from data_pipeline.config import DataConfig
from data_pipeline.pack import pack_concat
from data_pipeline.sources import load_documents
from data_pipeline.tokenize import token_stream, tokenize_documents

# Bump when the prepared layout or the meaning of a step changes, so old caches are not reused.
PIPELINE_VERSION = 1


def fingerprint(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """Changes when the data section, a source file (size or modification time) or the tokenizer changes."""
    files = [(s.path, os.stat(s.path).st_size, os.stat(s.path).st_mtime_ns) for s in config.sources]
    key = json.dumps({"version": PIPELINE_VERSION, "data": config.model_dump(exclude={"cache_dir", "num_proc"}),
                      "files": files, "tokenizer": Hasher.hash(tokenizer)}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def rows_to_dataset(rows: dict[str, np.ndarray], fingerprint: str) -> datasets.Dataset:
    """Fixed-length rows as an Arrow table, built from the arrays without a Python loop or a copy. The
    fingerprint is given because `datasets` would otherwise hash every row to make one."""
    seq_len = rows["input_ids"].shape[1]
    columns = {name: pa.FixedSizeListArray.from_arrays(pa.array(array.reshape(-1)), seq_len) if array.ndim == 2
               else pa.array(array) for name, array in rows.items()}
    return datasets.Dataset(pa.table(columns), fingerprint=fingerprint)


def build_dataset(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[datasets.Dataset, dict]:
    documents = load_documents(config.sources)
    tokenized = tokenize_documents(documents, tokenizer, config.num_proc)
    tokens, lengths = token_stream(tokenized)
    if len(tokens) < config.seq_len:
        raise DataError(f"the data holds {len(tokens)} tokens after tokenization, less than one row of "
                        f"data.seq_len={config.seq_len}; add data or lower data.seq_len")
    rows = pack_concat(tokens, lengths, config.seq_len)
    n_rows = len(rows["input_ids"])
    stats = {
        "documents_in": len(documents),
        "empty_documents_removed": len(documents) - len(tokenized),
        "documents_out": len(tokenized),
        "tokens_in": int(len(tokens)),
        "tokens_out": n_rows * config.seq_len,
        "tokens_dropped": int(len(tokens)) - n_rows * config.seq_len,
        "rows": n_rows,
        "seq_len": config.seq_len,
        "packing": config.packing,
        "packing_efficiency": 1.0,  # concat fills every slot with a real token
    }
    return rows_to_dataset(rows, fingerprint(config, tokenizer)), stats


def cached_path(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> Path:
    """Where prepare_dataset keeps this preparation (a `datasets.save_to_disk` folder plus stats.json)."""
    return Path(config.cache_dir) / fingerprint(config, tokenizer)


def prepare_dataset(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[datasets.Dataset, dict]:
    """The packed data set and its stats, from the cache when an identical preparation exists.

    The cache entry is written to a temporary folder and renamed into place, so a concurrent or
    interrupted preparation never leaves a half-written entry that a later run would trust."""
    path = cached_path(config, tokenizer)
    if not (path / "stats.json").exists():
        dataset, stats = build_dataset(config, tokenizer)
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        path.parent.mkdir(parents=True, exist_ok=True)
        dataset.save_to_disk(str(partial))
        (partial / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        try:
            partial.rename(path)
        except OSError:  # another process finished the same preparation first
            shutil.rmtree(partial)
    return datasets.load_from_disk(str(path)), json.loads((path / "stats.json").read_text())
