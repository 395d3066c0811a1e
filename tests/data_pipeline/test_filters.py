"""data.filters: each filter removes the junk planted for it and keeps the prose (tests/helpers/planted_corpus.py), the
counts and samples prepare writes, the cache key, the classifier, bad settings, and both engines keeping the same
documents."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from data_pipeline.__main__ import main
from data_pipeline.config import DataConfig
from data_pipeline.filters import SAMPLES_FILE, SCHEMAS, ClassifierFilter, FilterChain, check_parameters, sample_key
from data_pipeline.prepare import build_dataset, fingerprint
from tests.conftest import REPO
from tests.helpers.planted_corpus import CONTACT_PATTERN, KINDS, write_corpus
from training.base.errors import ConfigError
from training.config.recipe import RECIPES_DIR, load_recipe

TOKENIZER = AutoTokenizer.from_pretrained(RECIPES_DIR / "tiny_llama" / "tokenizer")
SETTINGS = {"language": {"languages": ["en"]}, "regex": {"pattern": CONTACT_PATTERN}}
# Gopher's quality rules want 80% of words alphabetic, and spaCy counts every comma and bracket as a word: a few
# comma-dense paragraphs of Python's documentation fall below it (docs/data_filters.md)
KEPT = {"gopher_quality": 0.93}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("planted") / "corpus.jsonl"
    texts, kinds = write_corpus(path)
    return {"path": path, "texts": texts, "kinds": np.array(kinds), "source": f"data.sources=[{{path: '{path}'}}]"}


def filters_override(*kinds: str, **settings) -> str:
    entries = [json.dumps({"type": kind, **SETTINGS.get(kind, {}), **settings.get(kind, {})}) for kind in kinds]
    return f"data.filters=[{', '.join(entries)}]"


def removed(kind: str, texts: list[str], **parameters) -> np.ndarray:
    chain = FilterChain([(kind, check_parameters(kind, {**SETTINGS.get(kind, {}), **parameters}))], TOKENIZER)
    return np.asarray(chain(texts, [True] * len(texts))["removed_by"]) >= 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS.values())
def test_each_filter_removes_its_planted_junk_and_keeps_the_prose(corpus, kind):
    gone = removed(kind, corpus["texts"])
    planted = corpus["kinds"] == next(junk for junk, meant in KINDS.items() if meant == kind)
    assert gone[planted].mean() == 1.0, "recall"
    assert 1 - gone[corpus["kinds"] == "prose"].mean() >= KEPT.get(kind, 0.99), "prose kept"


@pytest.mark.slow
def test_the_warm_tokenizers_change_no_verdict(corpus):
    """FineWeb's chain decides the same with spaCy kept warm (training/compat/datatrove.py) as datatrove alone does."""
    kinds = ["length", "gopher_repetition", "gopher_quality", "c4", "fineweb_quality"]
    texts = corpus["texts"] + [json.loads(line)["text"]
                               for line in (RECIPES_DIR / "tiny_llama/corpus.jsonl").open()][:20]
    verdicts = [FilterChain([(kind, check_parameters(kind, {})) for kind in kinds], TOKENIZER, warm)(
                    texts, [True] * len(texts))
                for warm in (True, False)]
    assert verdicts[0] == verdicts[1]
    # the first four removed something (C4 left the fifth none)
    assert set(verdicts[0]["removed_by"]) >= {-1, 0, 1, 2, 3}


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> dict:
    """The planted corpus prepared in-process through the command line, with five filters and no deduplication."""
    output = tmp_path_factory.mktemp("prepared") / "out"
    chain = ("gopher_repetition", "c4", "language", "length", "regex")
    assert main(["prepare", "--recipe", "tiny_llama", "--output", str(output), corpus["source"],
                 filters_override(*chain), "data.dedup.exact=false", "data.filter_samples=3"]) == 0
    stats = json.loads((output / "stats.json").read_text())
    samples = [json.loads(line) for line in (output / SAMPLES_FILE).read_text().splitlines()]
    return {"output": output, "chain": chain, "stats": stats, "samples": samples}


@pytest.mark.slow
def test_prepare_counts_the_documents_and_tokens_each_filter_removed(corpus, prepared):
    stats, texts = prepared["stats"], corpus["texts"]
    assert [f["type"] for f in stats["filters"]] == list(prepared["chain"])
    assert stats["documents_out"] == stats["documents_in"] - sum(f["documents_removed"] for f in stats["filters"])
    assert all(f["documents_removed"] > 0 for f in stats["filters"])
    assert sum(f["reasons"] and sum(f["reasons"].values()) == f["documents_removed"] for f in stats["filters"]) == 5
    # every token of the input is either removed by a filter (whole documents, or the lines C4 cut) or trained on
    special = len(TOKENIZER("a")["input_ids"]) - len(TOKENIZER("a", add_special_tokens=False)["input_ids"]) + 1  # + EOS
    tokens = sum(len(ids) for ids in TOKENIZER(texts, add_special_tokens=False)["input_ids"])
    assert (sum(f["tokens_removed"] for f in stats["filters"]) + stats["tokens_in"]
            - special * stats["documents_out"] == tokens)
    assert stats["filters"][1]["documents_edited"] > 0  # C4 drops lines without terminal punctuation from kept ones


def test_each_filters_sample_is_its_removals_with_the_smallest_seeded_keys(corpus, prepared):
    samples, texts = prepared["samples"], corpus["texts"]
    by_filter = {index: [s for s in samples if s["filter"] == index] for index in range(len(prepared["chain"]))}
    assert [len(found) for found in by_filter.values()] == [min(3, f["documents_removed"])
                                                           for f in prepared["stats"]["filters"]]
    alive = texts
    for index, kind in enumerate(prepared["chain"]):
        gone = removed(kind, alive)  # the documents this filter removed: those that reached it
        keys = sorted(sample_key(text, 1234) for text, out in zip(alive, gone) if out)
        assert [sample_key(s["text"], 1234) for s in by_filter[index]] == keys[:3], kind
        assert all(s["type"] == kind and s["reason"] and s["source"] == 0 for s in by_filter[index])
        alive = [text for text, out in zip(alive, gone) if not out] if kind != "c4" else alive  # C4 edits: stop there
        if kind == "c4":
            break


def test_prepare_prints_what_each_filter_removed(corpus, tmp_path, capsys):
    output = tmp_path / "out"
    assert main(["prepare", "--recipe", "tiny_llama", "--output", str(output), corpus["source"],
                 filters_override("length", "language")]) == 0
    printed = capsys.readouterr().out
    assert "quality filters, in order" in printed and "0: length" in printed and "1: language" in printed
    assert f"{output / SAMPLES_FILE}" in printed.replace("\n", "")


def test_the_cache_key_holds_the_filters_and_what_they_decide_with(corpus, classifier):
    def key(*overrides: str) -> str:
        return fingerprint(load_recipe("tiny_llama", [corpus["source"], *overrides]).data, TOKENIZER)

    plain, filtered = key(), key(filters_override("c4"))
    assert len({plain, filtered, key(filters_override("c4", c4={"min_num_sentences": 3})),
                key(filters_override("length", "c4"))}) == 4
    assert key(filters_override("c4"), "data.filter_samples=9") == filtered  # samples do not change the data
    scored = filters_override("classifier", classifier={"model": str(classifier), "threshold": 0.0})
    before = key(scored)
    (classifier / "config.json").write_text((classifier / "config.json").read_text() + " ")  # a retrained model
    assert key(scored) != before


def save_classifier(path: Path, labels: int) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=labels,
                         pad_token_id=TOKENIZER.pad_token_id,
                         id2label={i: name for i, name in enumerate(["bad", "fair", "good"][:labels])}
                         if labels > 1 else None)
    LlamaForSequenceClassification(config).save_pretrained(path)
    TOKENIZER.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    """A tiny regression head (one output, as FineWeb-Edu's classifier), saved with save_pretrained."""
    return save_classifier(tmp_path_factory.mktemp("classifier") / "edu", 1)


def direct_scores(model_path: Path, texts: list[str], label: int | None = None) -> np.ndarray:
    """The model's score of each text alone, unpadded."""
    model = LlamaForSequenceClassification.from_pretrained(model_path).eval()
    with torch.inference_mode():
        logits = [model(**TOKENIZER(text, truncation=True, max_length=64, return_tensors="pt")).logits[0]
                  for text in texts]
    return np.array([float(logit[0]) if label is None else float(logit.softmax(-1)[label]) for logit in logits])


def test_the_classifier_keeps_what_its_scores_pass_scored_in_batches(corpus, classifier):
    texts = corpus["texts"][:40]
    expected = direct_scores(classifier, texts)
    threshold = float(np.median(expected))
    step = ClassifierFilter(str(classifier), threshold, None, batch_size=16, max_length=64)
    chain = FilterChain([], TOKENIZER)
    chain.specs, chain.filters = [("classifier", {})], [step]
    verdicts = chain(texts, [True] * len(texts))
    np.testing.assert_array_equal(np.asarray(verdicts["removed_by"]) < 0, expected >= threshold)
    np.testing.assert_allclose(verdicts["classifier_score"], expected, atol=1e-5)  # what data.phases may order by
    from datatrove.data import Document
    documents = [Document(text=text, id=str(i)) for i, text in enumerate(texts)]
    step.filter_batch(documents)
    np.testing.assert_allclose([d.metadata["classifier_score"] for d in documents], expected, atol=1e-5)


def test_a_labelled_classifier_scores_that_labels_probability(corpus, tmp_path):
    path = save_classifier(tmp_path / "three", 3)
    texts = corpus["texts"][:12]
    step = ClassifierFilter(str(path), 0.3, "good", batch_size=5, max_length=64)
    np.testing.assert_allclose(step.scores(texts), direct_scores(path, texts, label=2), atol=1e-5)


@pytest.mark.parametrize("entry, message", [
    ({"type": "gopher"}, "Input should be 'gopher_repetition'"),
    ({"type": "gopher_quality", "min_doc_word": 30}, "min_doc_word: Extra inputs are not permitted (the gopher_quality "
                                                     "filter takes min_doc_words, max_doc_words"),
    ({"type": "c4", "min_num_sentences": "many"}, "min_num_sentences: Input should be a valid integer"),
    ({"type": "regex", "pattern": "(unclosed"}, "'(unclosed' is not a valid regular expression"),
    ({"type": "language", "model": "missing/lid.bin"}, "language model file not found"),
    ({"type": "classifier", "model": "CLASSIFIER", "threshold": 1, "label": "great"},
     "has no label 'great' (its labels: bad, fair, good)"),
    ({"type": "classifier", "model": "CLASSIFIER", "threshold": 1}, "has 3 labels: set label"),
    ({"type": "classifier", "threshold": 1}, "model: Field required"),
    ({"type": "classifier", "model": "/no/such/classifier", "threshold": 1},
     "model: no folder /no/such/classifier on this machine (and not a hub id"),
    ({"type": "length", "min_words": 500, "max_words": 100}, "min_words 500 is above max_words 100: no document "
                                                              "could pass"),
])
def test_bad_filters_are_named_before_any_work(entry, message, tmp_path):
    if entry.get("model") == "CLASSIFIER":
        entry = {**entry, "model": str(save_classifier(tmp_path / "three", 3))}
    with pytest.raises(ConfigError) as error:
        load_recipe("tiny_llama", [f"data.filters=[{json.dumps(entry)}]"])
    assert "data.filters.0" in str(error.value) and message in str(error.value)


def test_an_output_inside_the_classifier_folder_is_refused(corpus, classifier, capsys):
    scored = filters_override("classifier", classifier={"model": str(classifier), "threshold": 0.0})
    assert main(["prepare", "--recipe", "tiny_llama", "--output", str(classifier / "prepared"), corpus["source"],
                 scored]) == 2
    assert str(classifier) in capsys.readouterr().err and not (classifier / "prepared").exists()


@pytest.mark.slow
def test_both_engines_keep_the_same_documents_with_the_same_counts_and_samples(corpus, classifier, tmp_path):
    """Every kind of filter, in-process and as a 2-task datatrove job."""
    threshold = float(np.median(direct_scores(classifier, corpus["texts"][:60])))
    overrides = [corpus["source"], "data.filter_samples=4", filters_override(
        "length", "regex", "language", "gopher_repetition", "c4", "fineweb_quality", "gopher_quality", "classifier",
        length={"min_words": 5}, classifier={"model": str(classifier), "threshold": threshold, "max_length": 64})]
    output = tmp_path / "job"
    command = [sys.executable, "-m", "data_pipeline", "prepare", "--recipe", "tiny_llama", "--output", str(output),
               "--engine", "datatrove", "--tasks", "2", "--workers", "2", *overrides]
    done = subprocess.run(command, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    _, expected, samples = build_dataset(load_recipe("tiny_llama", overrides).data, TOKENIZER)
    got = json.loads((output / "stats.json").read_text())
    assert got["filters"] == expected["filters"]
    assert sum(f["documents_removed"] > 0 for f in got["filters"]) >= 7  # C4 leaves FineWeb's filter nothing to remove
    for key in ("documents_in", "exact_duplicates_removed", "documents_out", "tokens_in"):
        assert got[key] == expected[key], key
    written = [json.loads(line) for line in (output / SAMPLES_FILE).read_text().splitlines()]
    assert written == [{k: v for k, v in s.items() if k != "key"} for s in samples]


def test_the_documented_filter_chains_are_valid_recipes():
    blocks = re.findall(r"```yaml\n(.*?)```", (REPO / "docs/data_filters.md").read_text(), re.S)
    assert len(blocks) == 2
    for block in blocks:
        data = yaml.safe_load(block)["data"]
        config = DataConfig(seq_len=8, sources=[{"path": str(RECIPES_DIR / "tiny_llama/corpus.jsonl")}], **data)
        assert [f.type for f in config.filters] == [entry["type"] for entry in data["filters"]]


def test_an_unreachable_model_is_named_before_any_document_is_read(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 at start-up
    scored = filters_override("classifier", classifier={"model": "nobody/no-such-classifier", "threshold": 1})
    assert main(["prepare", "--recipe", "tiny_llama", "--output", str(tmp_path / "out"), corpus["source"], scored]) == 2
    error = capsys.readouterr().err
    assert "data.filters.0 (classifier): cannot load nobody/no-such-classifier" in error and "Traceback" not in error


def test_filters_are_refused_on_prepared_data(prepared):
    with pytest.raises(ConfigError, match="data.filters apply while preparing"):
        load_recipe("tiny_llama", ["data.sources=[]", f"data.prepared={prepared['output']}", filters_override("c4")])


def documented(value) -> str:
    return {None: "null", True: "true", False: "false"}.get(value, value) if not isinstance(value, (tuple, list)) \
        else json.dumps(value)


def test_the_docs_give_each_filters_parameters_with_the_librarys_defaults():
    rows = {line.split("|")[1].strip(" `"): line for line in (REPO / "docs/data_filters.md").read_text().splitlines()
            if line.startswith("| `")}
    for kind, schema in SCHEMAS.items():
        for name, field in schema.model_fields.items():
            expected = f"`{name}`" if field.is_required() else f"`{name}: {documented(field.default)}`"
            assert expected in rows[kind], (kind, expected)


def test_a_language_the_model_does_not_know_is_named(corpus, tmp_path, capsys):
    """ISO 639-3 `eng` (datatrove's Languages.english) is not a label of lid.176: it would remove every document."""
    assert main(["prepare", "--recipe", "tiny_llama", "--output", str(tmp_path / "out"), corpus["source"],
                 "data.filters=[{type: language, languages: [eng]}]"]) == 2
    assert "data.filters.0 (language): eng not among the labels of lid.176.ftz (af, als, am" in capsys.readouterr().err


def test_the_classifier_scores_the_rows_a_phase_orders_by(corpus, classifier, tmp_path):
    """A classifier filter scores every document it keeps: with data.phases the prepared rows carry the mean of their
    documents' scores over their target tokens, which order: highest_score_first sorts by."""
    from data_pipeline.curriculum import phase_schedule
    from data_pipeline.prepare import prepare_dataset
    from tests.data_pipeline.test_prepare import documents_of
    texts = corpus["texts"][:60]
    path = tmp_path / "web.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    config = DataConfig(sources=[{"path": str(path)}], seq_len=256, packing="bfd", long_documents="drop",
                        cache_dir=str(tmp_path / "cache"), dedup={"exact": False},
                        filters=[{"type": "classifier", "model": str(classifier), "threshold": -1e9, "max_length": 64}],
                        phases=[{"name": "main", "weights": {"web": 1}, "order": "highest_score_first"}])
    prepared, _ = prepare_dataset(config, TOKENIZER)
    rows = prepared["train"].with_format("numpy")[:]
    score_of = {tuple(ids + [TOKENIZER.eos_token_id]): score
                for ids, score in zip(TOKENIZER(texts).input_ids, direct_scores(classifier, texts))}
    for index in range(len(rows["length"])):
        placed = documents_of({key: value[index:index + 1] for key, value in rows.items()})
        expected = sum(score_of[d] * (len(d) - 1) for d in placed) / sum(len(d) - 1 for d in placed)
        assert rows["score"][index] == pytest.approx(expected, abs=1e-4)
    ordered = phase_schedule(prepared["train"], config.phases, [1], len(rows["length"]), seed=5)
    assert np.all(np.diff(rows["score"][ordered.phase_rows(ordered.phase_at(0))]) <= 0)
