"""data.phases (data_pipeline/curriculum.py): the rows each step reads, against counts computed here from the phases
alone; no repeat within a phase unless it upsamples; the same rows for every layout and a resumed loader; and rows
packed by source."""
import json
import re
from collections import Counter

import numpy as np
import pytest

from data_pipeline.config import DataConfig, PhaseConfig
from data_pipeline.curriculum import PhaseSchedule, allocate, phase_schedule, phase_steps, prepared_labels
from data_pipeline.loader import StepBatches
from data_pipeline.prepare import cached_path, prepare_dataset, rows_to_dataset
from tests.data_pipeline.test_prepare import TOKENIZER, documents_of
from training.base.errors import ConfigError, DataError
from training.config.recipe import RECIPES_DIR, load_recipe

SEQ = 4
SIZES = {"web": 300, "code": 60, "math": 20}  # rows per source


def labelled_rows(sizes: dict[str, int] = SIZES, lengths: np.ndarray | None = None, scores: np.ndarray | None = None):
    """Row i holds the token i everywhere; the first rows are the first source's, and so on."""
    n = sum(sizes.values())
    ids = np.repeat(np.arange(n, dtype=np.int32)[:, None], SEQ, axis=1)
    source = np.repeat(np.arange(len(sizes)), list(sizes.values())).astype(np.int64)
    return rows_to_dataset({"input_ids": ids, "labels": ids,
                            "position_ids": np.tile(np.arange(SEQ, dtype=np.int32), (n, 1)),
                            "length": np.full(n, SEQ, dtype=np.int32) if lengths is None else lengths,
                            "source": source, **({} if scores is None else {"score": scores.astype(np.float32)})},
                           f"labelled-{n}-{scores is not None}", list(sizes))


def phases(*specs: tuple) -> list[PhaseConfig]:
    return [PhaseConfig(name=name, steps=steps, weights=weights) for name, steps, weights in specs]


PHASES = phases(("main", 20, {"web": 3, "code": 1}), ("anneal", 10, {"web": 1, "code": 1, "math": 2}))
BATCH = 8


def schedule(rows=None, specs=PHASES, seed=5) -> PhaseSchedule:
    return phase_schedule(rows or labelled_rows(), specs, [phase.steps for phase in specs], BATCH, seed)


def rows_read(batches: list[StepBatches], position: int) -> list[int]:
    """The global batch's rows, read through every rank's micro-batches."""
    return sorted(int(r) for b in batches for micro in b.micro_batches(position) for r in micro["input_ids"][:, 0])


def source_of(row: int) -> str:
    bounds = np.cumsum(list(SIZES.values()))
    return list(SIZES)[int(np.searchsorted(bounds, row, side="right"))]


def test_each_phase_reads_the_rows_its_weights_ask_for_exactly():
    rows = labelled_rows()
    ranks = [StepBatches(rows, 2, 2, rank, 2, seed=5, phases=schedule(rows)) for rank in range(2)]
    read = {"main": [r for p in range(20) for r in rows_read(ranks, p)],
            "anneal": [r for p in range(20, 30) for r in rows_read(ranks, p)]}
    # computed here: 20 steps x 8 rows at 3:1, then 10 x 8 at 1:1:2
    assert Counter(map(source_of, read["main"])) == {"web": 120, "code": 40}
    assert Counter(map(source_of, read["anneal"])) == {"web": 20, "code": 20, "math": 40}
    # web and code hold the rows their phases ask for: no row twice, and a later phase goes on with rows the earlier
    # did not read (code: all 60, once); math is asked for 40 of its 20 rows: each twice (upsampled, 2 passes)
    for source, count in (("web", 140), ("code", 60)):
        mine = [r for r in read["main"] + read["anneal"] if source_of(r) == source]
        assert len(set(mine)) == len(mine) == count
    assert set(Counter(r for r in read["anneal"] if source_of(r) == "math").values()) == {2}


def test_a_phase_that_upsamples_a_source_reads_each_row_as_often_as_it_says():
    specs = phases(("anneal", 10, {"math": 1}))  # 80 rows of a source of 20: 4 passes
    found = schedule(specs=specs)
    read = Counter(int(r) for p in range(10) for r in found.global_rows(p))
    assert set(read.values()) == {4} and len(read) == 20
    assert "math 80 rows, 320 tokens, 4.00 passes" in found.table()[1]


def test_every_layout_and_a_fresh_loader_read_the_same_batches():
    rows = labelled_rows()
    one = [StepBatches(rows, 4, 2, 0, 1, seed=5, phases=schedule(rows))]
    four = [StepBatches(rows, 1, 2, rank, 4, seed=5, phases=schedule(rows)) for rank in range(4)]
    fresh = [StepBatches(rows, 2, 2, rank, 2, seed=5, phases=schedule(rows)) for rank in range(2)]
    for position in (29, 3, 20, 0, 31):  # out of order, as a resume reads; past the end: more of the last phase
        assert rows_read(one, position) == rows_read(four, position) == rows_read(fresh, position)
    assert rows_read(one, 0) != rows_read([StepBatches(rows, 4, 2, 0, 1, 6, schedule(rows, seed=6))], 0)


def test_source_tokens_count_the_batches_before_a_position_and_a_resume_counts_the_same():
    rows = labelled_rows()
    found = schedule(rows)
    logged = [found.metrics(position) for position in range(1, 31)]
    assert [record["phase"] for record in logged] == ["main"] * 20 + ["anneal"] * 10
    assert logged[19]["source_tokens"] == {"web": 120 * SEQ, "code": 40 * SEQ, "math": 0}
    assert logged[29]["source_tokens"] == {"web": 140 * SEQ, "code": 60 * SEQ, "math": 40 * SEQ}
    for position in (7, 25):
        expected = Counter(source_of(int(r)) for p in range(position) for r in found.global_rows(p))
        resumed = schedule(rows).metrics(position)["source_tokens"]
        assert resumed == {label: expected[label] * SEQ for label in SIZES}


def test_shortest_first_orders_a_phase_by_real_tokens():
    lengths = np.random.default_rng(0).integers(1, SEQ + 1, sum(SIZES.values())).astype(np.int32)
    rows = labelled_rows(lengths=lengths)
    specs = [PhaseConfig(name="main", steps=30, weights={"web": 1}, order="shortest_first")]
    found = schedule(rows, specs)
    read = np.concatenate([found.global_rows(p) for p in range(30)])
    assert (np.diff(lengths[read]) >= 0).all() and len(set(read)) == 240


def test_highest_score_first_orders_a_phase_by_its_rows_scores_and_buckets_cut_that_order():
    scores = np.random.default_rng(3).random(sum(SIZES.values()))
    rows = labelled_rows(scores=scores)
    ordered = PhaseConfig(name="main", steps=30, weights={"web": 1, "code": 1}, order="highest_score_first")
    plain, bucketed = (schedule(rows, [ordered.model_copy(update=update)]) for update in ({}, {"buckets": 4}))
    read = plain.phase_rows(plain.phase_at(0))
    assert np.all(np.diff(scores[read]) <= 0) and {source_of(r) for r in read} == {"web", "code"}
    in_buckets = bucketed.phase_rows(bucketed.phase_at(0))
    parts = np.array_split(in_buckets, 4)
    assert [set(part) for part in parts] == [set(part) for part in np.array_split(read, 4)]  # the same cut
    assert all(scores[a].min() >= scores[b].max() for a, b in zip(parts, parts[1:]))
    assert not all(np.all(np.diff(scores[part]) <= 0) for part in parts)  # each bucket in a seeded random order
    assert bucketed.state_dict()[0][-1] == 4 and plain.state_dict()[0][-1] == "highest_score_first"
    with pytest.raises(DataError, match="phase 'main' orders its rows by their documents' scores, and the prepared "
                                        "rows of web, code carry none"):
        schedule(labelled_rows(), [ordered])


def test_counts_split_by_largest_remainders_and_lengths_add_up():
    assert allocate(10, np.array([1.0, 1.0, 1.0])).tolist() == [4, 3, 3]
    assert allocate(7, np.array([0.5, 0.0, 0.25])).tolist() == [5, 0, 2]
    assert phase_steps([PhaseConfig(name="a", weights={"x": 1}), PhaseConfig(name="b", steps="decay", weights={"x": 1}),
                        ], 100, 20, 64) == [80, 20]
    assert phase_steps([PhaseConfig(name="a", tokens=1000, weights={"x": 1}), PhaseConfig(name="b", weights={"x": 1})],
                       100, 20, 64) == [16, 84]
    with pytest.raises(ValueError, match="data.phases take 30 steps .* and training.max_steps is 100"):
        phase_steps(phases(("a", 10, {"x": 1}), ("b", 20, {"x": 1})), 100, 20, 64)


def test_a_resume_under_other_phases_is_refused_by_name():
    rows = labelled_rows()
    saved = StepBatches(rows, 2, 2, 0, 2, 5, schedule(rows)).state_dict()
    other = phases(("main", 20, {"web": 3, "code": 1}), ("anneal", 10, {"web": 1, "math": 1}))
    with pytest.raises(ConfigError, match=r"data.phases \(each phase's name, steps, weights and order\) is"):
        StepBatches(rows, 2, 2, 0, 2, 5, schedule(rows, other)).load_state_dict(saved)
    StepBatches(rows, 4, 2, 0, 1, 5, schedule(rows)).load_state_dict(saved)  # another layout: the same positions


def test_rows_without_sources_and_unknown_labels_are_refused():
    mixed = labelled_rows().remove_columns("source")
    with pytest.raises(DataError, match="the prepared rows mix them .* prepare the data with data.phases set"):
        schedule(mixed)
    with pytest.raises(DataError, match="phase 'main' weights wiki, and the prepared data's sources are labelled web"):
        schedule(specs=phases(("main", 30, {"wiki": 1})))
    with pytest.raises(DataError, match="phase 'main' draws from math, whose prepared rows are none"):
        schedule(labelled_rows({"web": 300, "math": 0}), phases(("main", 30, {"math": 1})))


def test_prepared_rows_are_packed_by_source_and_labelled(tmp_path):
    files = {}
    for name, count in (("web", 40), ("math", 12)):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps({"text": f"{name} number {i} " * (i % 4 + 1)}) + "\n"
                                       for i in range(count)))
    config = DataConfig(sources=[{"path": str(files["web"])}, {"path": str(files["math"])}], seq_len=64,
                        packing="bfd", cache_dir=str(tmp_path / "cache"),
                        phases=[{"name": "main", "weights": {"web": 1, "math": 1}}])
    prepared, stats = prepare_dataset(config, TOKENIZER)
    train = prepared["train"]
    assert train.features["source"].names == ["web", "math"]
    rows = train.with_format("numpy")[:]
    for index, name in enumerate(("web", "math")):
        texts = [json.loads(line)["text"] for line in files[name].read_text().splitlines()]
        expected = sorted(tuple(ids + [TOKENIZER.eos_token_id]) for ids in TOKENIZER(texts).input_ids)
        mine = {key: value[rows["source"] == index] for key, value in rows.items()}
        assert sorted(documents_of(mine)) == expected  # every document of the source, once, in its own rows
        assert stats["sources"][index]["label"] == name and stats["sources"][index]["rows"] == len(mine["length"])
    # the phases' weights change no row: the same preparation serves another mixture
    again = config.model_copy(update={"phases": [PhaseConfig(name="x", weights={"math": 1})]})
    assert prepare_dataset(again, TOKENIZER)[0]["train"]._fingerprint == train._fingerprint
    assert prepared_labels(cached_path(config, TOKENIZER)) == ["web", "math"]  # --dry-run's, from the folder's info
    mixed = prepare_dataset(config.model_copy(update={"phases": []}), TOKENIZER)
    assert "source" not in mixed[0]["train"].features
    with pytest.raises(DataError, match="the prepared rows mix them"):
        prepared_labels(cached_path(config.model_copy(update={"phases": []}), TOKENIZER))


def scored_sources(tmp_path) -> tuple[dict[str, list[tuple[str, float]]], list[dict]]:
    """Two sources whose records have a `quality` field, and one without; each document's text and score."""
    rng, documents, sources = np.random.default_rng(7), {}, []
    for name, count in (("web", 40), ("math", 12), ("wiki", 10)):
        documents[name] = [(f"{name} number {i} " * (i % 5 + 1), round(float(rng.random()), 4)) for i in range(count)]
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": text, "quality": score}) + "\n" for text, score in documents[name]))
        sources.append({"path": str(path), **({"score_field": "quality"} if name != "wiki" else {})})
    return documents, sources


def test_prepared_rows_carry_the_score_of_their_documents_weighted_by_their_targets(tmp_path):
    """A row's score, computed here from its documents: the mean of their scores over their target tokens (a
    document's first token is none); a source without score_field gives NaN. The eval split, read in no phase,
    has no score."""
    documents, sources = scored_sources(tmp_path)
    config = DataConfig(sources=sources, seq_len=64, packing="bfd", cache_dir=str(tmp_path / "cache"),
                        eval={"fraction": 0.1},
                        phases=[{"name": "main", "weights": {"web": 1, "math": 1}, "order": "highest_score_first"}])
    prepared, _ = prepare_dataset(config, TOKENIZER)
    assert "score" not in prepared["eval"].features
    rows = prepared["train"].with_format("numpy")[:]
    score_of = {tuple(ids + [TOKENIZER.eos_token_id]): score for name in documents
                for ids, (_, score) in zip(TOKENIZER([t for t, _ in documents[name]]).input_ids, documents[name])}
    for index in range(len(rows["length"])):
        row = {key: value[index:index + 1] for key, value in rows.items()}
        placed = documents_of(row)
        if rows["source"][index] == 2:
            assert np.isnan(rows["score"][index])
            continue
        expected = sum(score_of[d] * (len(d) - 1) for d in placed) / sum(len(d) - 1 for d in placed)
        assert rows["score"][index] == pytest.approx(expected, rel=1e-6)
    ordered = phase_schedule(prepared["train"], config.phases, [10], BATCH, seed=5)
    read = ordered.phase_rows(ordered.phase_at(0))
    assert np.all(np.diff(rows["score"][read]) <= 0)


@pytest.mark.parametrize("record, message", [
    ({"text": "a document"}, "no field 'quality' (fields present: text); set score_field"),
    ({"text": "a document", "quality": "high"}, "score_field 'quality' holds string values, not numbers"),
])
def test_a_score_field_that_is_not_a_number_of_every_record_is_named(tmp_path, record, message):
    path = tmp_path / "web.jsonl"
    path.write_text(json.dumps(record) + "\n")
    config = DataConfig(sources=[{"path": str(path), "score_field": "quality"}], seq_len=8,
                        cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=re.escape(message)):
        prepare_dataset(config, TOKENIZER)
    path.write_text(json.dumps({"text": "a", "quality": 1}) + "\n" + json.dumps({"text": "b", "quality": None}) + "\n")
    with pytest.raises(DataError, match="score_field 'quality' is missing in 1 of 2 records"):
        prepare_dataset(config, TOKENIZER)


CORPUS = RECIPES_DIR / "tiny_llama" / "corpus.jsonl"
RECIPE = [f"data.sources=[{{path: {CORPUS}, label: web}}, {{path: {CORPUS}, label: math}}]", "training.schedule=wsd"]


@pytest.mark.parametrize("overrides, message", [
    (["data.phases=[{name: a, weights: {wiki: 1}}]"], r"data.phases.0 \(a\) weights wiki, not a source label; the "
                                                      "labels are web, math"),
    (["data.phases=[{name: a, steps: decay, weights: {web: 1}}, {name: b, weights: {web: 1}}]"],
     r"data.phases.0 \(a\) lasts the WSD schedule's decay: it must be the last phase"),
    (["data.phases=[{name: a, steps: 50, weights: {web: 1}}]"], "data.phases take 50 steps"),
    (["data.phases=[{name: a, weights: {web: 1}}]", "data.sources.0.weight=2"],
     "data.sources.0.weight is 2, and data.phases sets the weights"),
    (["data.phases=[{name: a, weights: {web: 1}, order: shortest_first}]"],
     "under data.packing=concat every row is full"),
    (["data.phases=[{name: a, weights: {web: 1}}]", "training.objective=dpo"], "data.phases mixes packed documents"),
    (["data.phases=[{name: a, weights: {web: 0}}]"], "its weights are all 0"),
    (["data.phases=[{name: a, weights: {web: 1}, order: highest_score_first}]"],
     r"data.phases.0 \(a\) orders its rows by their documents' scores, and web has none: set its data.sources "
     "score_field"),
    (["data.phases=[{name: a, weights: {web: 1}, buckets: 4}]"], "buckets split an ordered phase"),
])
def test_recipe_phases_are_checked_before_any_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe("tiny_llama", [*RECIPE, *overrides])


def test_a_decay_phase_lasts_the_wsd_decay():
    recipe = load_recipe("tiny_llama", [*RECIPE, "training.decay_ratio=0.25", "data.phases=[{name: a, weights: "
                                        "{web: 1}}, {name: anneal, steps: decay, weights: {web: 1, math: 1}}]"])
    training = recipe.training
    assert phase_steps(recipe.data.phases, training.max_steps, training.decay_steps(training.max_steps), 1) == [150, 50]
