import json
from collections import Counter

import numpy as np
import pytest
from transformers import AutoTokenizer

from data_pipeline.config import DataConfig
from data_pipeline.pack import IGNORE_INDEX
from data_pipeline.prepare import mixture_rows, prepare_dataset
from training.base.errors import DataError
from training.config.recipe import RECIPES_DIR

TOKENIZER = AutoTokenizer.from_pretrained(RECIPES_DIR / "tiny_llama" / "tokenizer")
EOS = TOKENIZER.eos_token_id


def config(tmp_path, sources, seq_len=16, **data) -> DataConfig:
    sources = [s if isinstance(s, dict) else {"path": str(s)} for s in sources]
    return DataConfig(sources=sources, seq_len=seq_len, cache_dir=str(tmp_path / "cache"), **data)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def texts_file(path, texts, field="text"):
    return write_jsonl(path, [{field: t} for t in texts])


def documents_of(rows) -> list[tuple]:
    """The documents in packed rows (position 0 opens one), real tokens only."""
    found = []
    for ids, positions, length in zip(rows["input_ids"], rows["position_ids"], rows["length"]):
        for token, position in zip(ids[:length], positions[:length]):
            if position == 0:
                found.append([])
            found[-1].append(token)
    return [tuple(d) for d in found]


def test_concat_rows_hold_every_token_of_every_document(tmp_path):
    texts = [f"document number {i} " * (i % 7 + 1) for i in range(40)]
    prepared, stats = prepare_dataset(config(tmp_path, [texts_file(tmp_path / "a.jsonl", texts)]), TOKENIZER)
    expected = [ids + [EOS] for ids in TOKENIZER(texts).input_ids]
    assert expected[0][0] == TOKENIZER.bos_token_id
    rows = prepared["train"].with_format("numpy")[:]
    # documents are mixed in a seeded random order, then cut into rows: all tokens of all documents,
    # minus the tail that does not fill a row
    total = sum(map(len, expected))
    assert rows["input_ids"].size == total // 16 * 16
    assert Counter(rows["input_ids"].reshape(-1).tolist()) <= Counter(t for doc in expected for t in doc)
    assert stats["documents_in"] == stats["documents_out"] == 40
    assert (stats["tokens_in"], stats["tokens_out"], stats["rows"]) == (total, total // 16 * 16, total // 16)
    assert stats["tokens_dropped"] == total % 16 and stats["packing_efficiency"] == 1.0
    assert stats["sources"] == [{"name": str(tmp_path / "a.jsonl"), "weight": 1.0, "documents_in": 40,
                                 "documents_kept": 40, "documents_in_mixture": 40}]


def test_bfd_rows_hold_each_document_whole(tmp_path):
    texts = [f"text {i} " * (i % 9 + 1) for i in range(60)]
    prepared, stats = prepare_dataset(config(tmp_path, [texts_file(tmp_path / "a.jsonl", texts)], seq_len=32,
                                             packing="bfd"), TOKENIZER)
    rows = prepared["train"].with_format("numpy")[:]
    expected = sorted(tuple(ids + [EOS]) for ids in TOKENIZER(texts).input_ids)
    assert sorted(documents_of(rows)) == expected
    assert stats["packing_efficiency"] == stats["tokens_out"] / (stats["rows"] * 32) > 0.9


def test_long_documents_split_truncated_or_dropped_with_a_count(tmp_path):
    texts = ["short one", "a much longer document " * 20, "another short"]
    path = texts_file(tmp_path / "a.jsonl", texts)
    results = {}
    for policy in ("split", "truncate", "drop"):
        prepared, stats = prepare_dataset(config(tmp_path, [path], seq_len=16, packing="bfd", long_documents=policy),
                                          TOKENIZER)
        results[policy] = (stats, prepared["train"].with_format("numpy")[:])
    long_tokens = len(TOKENIZER(texts[1]).input_ids) + 1
    assert results["split"][0]["long_documents_split"] == 1
    assert results["split"][0]["tokens_out"] == results["split"][0]["tokens_in"]  # nothing lost
    assert results["truncate"][0]["long_documents_truncated"] == 1
    assert results["truncate"][0]["tokens_out"] == results["split"][0]["tokens_out"] - long_tokens + 16
    assert results["drop"][0]["long_documents_dropped"] == 1
    assert results["drop"][0]["tokens_out"] == results["split"][0]["tokens_out"] - long_tokens


def test_exact_and_near_duplicates_are_removed_and_counted(tmp_path):
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(3000)]
    originals = [" ".join(rng.choice(words, 120)) for _ in range(30)]
    near = [o.replace(o.split()[50], "changed", 1) for o in originals[:10]]
    exact = [o.upper().replace(" ", "  ") for o in originals[10:15]]
    path = texts_file(tmp_path / "a.jsonl", originals + near + exact)
    _, stats = prepare_dataset(config(tmp_path, [path], dedup={"near": True}), TOKENIZER)
    assert (stats["documents_in"], stats["exact_duplicates_removed"], stats["near_duplicates_removed"]) == (45, 5, 10)
    assert stats["documents_out"] == 30


def test_mixture_weights_sample_each_source(tmp_path):
    a = texts_file(tmp_path / "a.jsonl", [f"from a {i}" for i in range(40)])
    b = texts_file(tmp_path / "b.jsonl", [f"from b {i}" for i in range(40)])
    _, stats = prepare_dataset(config(tmp_path, [{"path": str(a), "weight": 0.5}, {"path": str(b), "weight": 2.0}]),
                               TOKENIZER)
    assert [s["documents_in_mixture"] for s in stats["sources"]] == [20, 80]
    assert stats["documents_out"] == 100


def test_mixture_rows_are_deterministic():
    sources = np.array([0] * 10 + [1] * 10)
    first = mixture_rows(sources, [0.3, 1.5], seed=1)
    assert np.array_equal(first, mixture_rows(sources, [0.3, 1.5], seed=1))
    assert Counter((sources[first] == 0).tolist()) == {True: 3, False: 15}
    assert not np.array_equal(first, mixture_rows(sources, [0.3, 1.5], seed=2))


def test_eval_fraction_is_held_out(tmp_path):
    path = texts_file(tmp_path / "a.jsonl", [f"document {i} " * 5 for i in range(100)])
    prepared, stats = prepare_dataset(config(tmp_path, [path], seq_len=32, packing="none", eval={"fraction": 0.1}),
                                      TOKENIZER)
    assert stats["eval_documents"] == 10 and stats["documents_out"] == 90
    train, evaluation = (set(documents_of(prepared[split].with_format("numpy")[:])) for split in ("train", "eval"))
    assert train and evaluation and not train & evaluation


def test_decontamination_drops_training_documents_that_copy_the_eval_set(tmp_path):
    rng = np.random.default_rng(1)
    words = [f"w{i}" for i in range(3000)]
    benchmark = [" ".join(rng.choice(words, 100)) for _ in range(5)]
    training = ([" ".join(rng.choice(words, 100)) for _ in range(40)]
                + [b.replace(b.split()[3], "x", 1) for b in benchmark[:3]])
    train_path, eval_path = (texts_file(tmp_path / "train.jsonl", training),
                             texts_file(tmp_path / "eval.jsonl", benchmark))
    prepared, stats = prepare_dataset(config(tmp_path, [train_path], eval={"sources": [{"path": str(eval_path)}]}),
                                      TOKENIZER)
    assert (stats["decontaminated_removed"], stats["eval_documents"], stats["documents_out"]) == (3, 5, 40)
    assert "eval" in prepared


def chat(*turns) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


def test_chat_labels_only_on_assistant_replies(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [
        chat(("user", "What is json?"), ("assistant", "A data format.")),
        chat(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."), ("user", "Bye"), ("assistant", "Bye.")),
        chat(("user", "Only a question, no reply")),
    ])
    prepared, stats = prepare_dataset(config(tmp_path, [{"path": str(path), "messages_field": "messages"}],
                                             seq_len=64, packing="none"), TOKENIZER)
    assert stats["no_assistant_reply_skipped"] == 1 and stats["documents_out"] == 2
    rows = prepared["train"].with_format("numpy")[:]
    learned = sorted(TOKENIZER.decode(ids[labels != IGNORE_INDEX])
                     for ids, labels in zip(rows["input_ids"], rows["labels"]))
    assert learned == ["A data format.</s>\n", "Hello.</s>\nBye.</s>\n"]


def test_text_files_and_renamed_fields(tmp_path):
    (tmp_path / "one.txt").write_text("a whole file is one document\nwith two lines")
    jsonl = texts_file(tmp_path / "b.jsonl", ["from the body field"] * 3, field="body")
    _, stats = prepare_dataset(config(tmp_path, [tmp_path / "one.txt", {"path": str(jsonl), "text_field": "body"}],
                                      seq_len=8), TOKENIZER)
    assert stats["documents_in"] == 4 and stats["exact_duplicates_removed"] == 2


def test_empty_documents_are_counted_and_dropped(tmp_path):
    path = texts_file(tmp_path / "a.jsonl", ["real text here, long enough", "", "   ", "more real text"])
    _, stats = prepare_dataset(config(tmp_path, [path], seq_len=4), TOKENIZER)
    assert (stats["documents_in"], stats["empty_documents_removed"], stats["documents_out"]) == (4, 2, 2)


def test_cache_is_reused_until_a_source_changes(tmp_path):
    path = texts_file(tmp_path / "a.jsonl", ["some text to pack " * 20])
    cfg = config(tmp_path, [path])
    prepare_dataset(cfg, TOKENIZER)
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    prepare_dataset(cfg, TOKENIZER)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == entries
    texts_file(path, ["other text to pack " * 20])
    prepare_dataset(cfg, TOKENIZER)
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_a_bad_jsonl_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "broken"\n{"text": "fine"}\n')
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON \(Expecting ',' delimiter at column 18\)"):
        prepare_dataset(config(tmp_path, [path]), TOKENIZER)


def test_a_missing_field_lists_the_fields_present(tmp_path):
    path = texts_file(tmp_path / "a.jsonl", ["x"], field="content")
    with pytest.raises(DataError, match=r"no field 'text' \(fields present: content\); set text_field"):
        prepare_dataset(config(tmp_path, [path]), TOKENIZER)
    with pytest.raises(DataError, match=r"no field 'messages' \(fields present: content\); set messages_field"):
        prepare_dataset(config(tmp_path, [{"path": str(path), "messages_field": "messages"}]), TOKENIZER)


def test_nothing_left_after_filtering(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(("user", "no reply"))] * 2)
    with pytest.raises(DataError, match="no documents are left after filtering"):
        prepare_dataset(config(tmp_path, [{"path": str(path), "messages_field": "messages"}]), TOKENIZER)


@pytest.mark.parametrize("filters, counts", [
    ([{"type": "length", "min_words": 1000}], "(4 read, 1 empty, data.filters.0 (length) removed 3)"),
    ([{"type": "regex", "pattern": "words", "action": "drop"}, {"type": "length", "min_words": 1}],
     "(4 read, 1 empty, data.filters.0 (regex) removed 3, data.filters.1 (length) removed 0)"),
])
def test_filters_that_keep_nothing_name_what_each_removed(tmp_path, filters, counts):
    path = texts_file(tmp_path / "a.jsonl", ["a few words here"] * 3 + [" "])
    with pytest.raises(DataError, match="no documents are left") as refused:
        prepare_dataset(config(tmp_path, [path], filters=filters), TOKENIZER)
    assert counts in str(refused.value) and "the quality filters removed every document" in str(refused.value)


def test_sources_of_empty_documents_are_named_before_any_stage(tmp_path):
    """Before: KeyError 'Field "text_hash" does not exist in schema' from deduplication of nothing."""
    path = texts_file(tmp_path / "a.jsonl", ["", " ", "\n"])
    with pytest.raises(DataError, match=r"no documents are left \(3 read, 3 empty\); every document of the sources "
                                        r"is empty"):
        prepare_dataset(config(tmp_path, [path]), TOKENIZER)


def test_too_little_data_for_one_row(tmp_path):
    path = texts_file(tmp_path / "a.jsonl", ["tiny"])
    with pytest.raises(DataError, match="less than one row of data.seq_len=16"):
        prepare_dataset(config(tmp_path, [path]), TOKENIZER)
