import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from data_pipeline import DataError
from data_pipeline.config import DataConfig
from data_pipeline.prepare import prepare_dataset
from training.recipe import RECIPES_DIR

TOKENIZER = AutoTokenizer.from_pretrained(RECIPES_DIR / "tiny_llama" / "tokenizer")


def config(tmp_path, *paths, seq_len=16, **source) -> DataConfig:
    return DataConfig(sources=[{"path": str(p), **source} for p in paths], seq_len=seq_len,
                      cache_dir=str(tmp_path / "cache"))


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def test_rows_hold_every_token_of_every_document(tmp_path):
    texts = [f"document number {i} " * (i % 7 + 1) for i in range(40)]
    rows, stats = prepare_dataset(config(tmp_path, write_jsonl(tmp_path / "a.jsonl", texts)), TOKENIZER)
    expected = [t + [TOKENIZER.eos_token_id] for t in TOKENIZER(texts).input_ids]
    stream = np.concatenate(expected)
    n_rows = len(stream) // 16
    np.testing.assert_array_equal(np.array(rows["input_ids"]).reshape(-1), stream[:n_rows * 16])
    assert expected[0][0] == TOKENIZER.bos_token_id and expected[0][-1] == TOKENIZER.eos_token_id
    assert stats == {"documents_in": 40, "empty_documents_removed": 0, "documents_out": 40, "tokens_in": len(stream),
                     "tokens_out": n_rows * 16, "tokens_dropped": len(stream) - n_rows * 16, "rows": n_rows,
                     "seq_len": 16, "packing": "concat", "packing_efficiency": 1.0}


def test_text_files_and_renamed_fields(tmp_path):
    (tmp_path / "one.txt").write_text("a whole file is one document\nwith two lines")
    jsonl = write_jsonl(tmp_path / "b.jsonl", ["from the body field"] * 3, field="body")
    rows, stats = prepare_dataset(DataConfig(sources=[{"path": str(tmp_path / "one.txt")},
                                                      {"path": str(jsonl), "text_field": "body"}],
                                             seq_len=8, cache_dir=str(tmp_path / "cache")), TOKENIZER)
    assert stats["documents_in"] == 4


def test_empty_documents_are_counted_and_dropped(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["real text here, long enough", "", "   ", "more real text"])
    _, stats = prepare_dataset(config(tmp_path, path, seq_len=4), TOKENIZER)
    assert (stats["documents_in"], stats["empty_documents_removed"], stats["documents_out"]) == (4, 2, 2)


def test_cache_is_reused_until_a_source_changes(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["some text to pack " * 20])
    cfg = config(tmp_path, path)
    prepare_dataset(cfg, TOKENIZER)
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    prepare_dataset(cfg, TOKENIZER)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == entries
    write_jsonl(path, ["other text to pack " * 20])
    _, stats = prepare_dataset(cfg, TOKENIZER)
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_a_bad_jsonl_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "broken"\n{"text": "fine"}\n')
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON \(Expecting ',' delimiter at column 18\)"):
        prepare_dataset(config(tmp_path, path), TOKENIZER)


def test_a_missing_text_field_lists_the_fields_present(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["x"], field="content")
    with pytest.raises(DataError, match=r"no field 'text' \(fields present: content\)"):
        prepare_dataset(config(tmp_path, path), TOKENIZER)


def test_too_little_data_for_one_row(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["tiny"])
    with pytest.raises(DataError, match="less than one row of data.seq_len=16"):
        prepare_dataset(config(tmp_path, path), TOKENIZER)
