"""The data stage as a datatrove job, for corpora that one machine cannot prepare.

The steps of prepare.py (drop empty documents, the quality filters, exact and MinHash near deduplication, the
evaluation split and decontamination, tokenization, the mixture and packing) run as datatrove pipeline stages,
each split into tasks that datatrove's local, Slurm or Ray executor runs. A task marks itself complete
when it ends, so running the same command again after a crash or a kill redoes only unfinished tasks
(work_folder.py: the job's folder and what a rerun continues from). The last stage writes the same
prepared layout as prepare.py (`data.prepared` trains on it).

Where the result can differ from the in-process path (docs/data_at_scale.md has the measurements):
- Of a group of duplicates, one is kept, not necessarily the first.
- Near duplicates are datatrove's LSH candidates (bands x rows chosen for the threshold; the signatures are the
  in-process path's) without its check that the two documents' shingle sets are at least `threshold` similar.
- `eval.fraction` holds out each document by a seeded hash of its text, not by a global permutation.
- Each task mixes and packs its own documents; under `concat` each task's last partial row is dropped.
"""
import importlib.util
import json
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import datasets
import numpy as np
import orjson  # datatrove's JSONL reader needs it too
import xxhash
from datatrove.data import Document
from datatrove.executor import LocalPipelineExecutor, SlurmPipelineExecutor
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup import MinhashDedupCluster, MinhashDedupFilter
from datatrove.pipeline.dedup.exact_dedup import ExactDedupConfig, ExactDedupFilter, ExactFindDedups
from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupBuckets
from datatrove.pipeline.filters import LambdaFilter
from datatrove.pipeline.readers import CSVReader, HuggingFaceDatasetReader, JsonlReader, ParquetReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.batching import batched
from datatrove.utils.hashing import HashConfig
from transformers import PreTrainedTokenizerBase

from data_pipeline import ray_job
from data_pipeline.config import DataConfig, DataSource, matching_files
from data_pipeline.dedup import lsh_bands, normalize, normalized_bytes
from data_pipeline.files import check_lines, field_problem, is_json_lines
from data_pipeline.filters import FilterChain, check_models, document_scores, merge, summarize
from data_pipeline.prepare import (
    EMPTY_SOURCES,
    FILTERED_ALL,
    LONG_DOCUMENT_STATS,
    decontaminate,
    drop_empty,
    fingerprint,
    mixture_rows,
    nothing_left,
    pack,
    pack_by_source,
    pack_rows,
    pad_token_id,
    rows_to_dataset,
    save_prepared,
)
from data_pipeline.sources import FEATURES, NO_SCORE, chat_document, load_documents, load_source, source_field
from data_pipeline.tokenize import tokenize_documents
from data_pipeline.work_folder import Layout, claim_work_folder, job_fingerprint, reopen_for_rerun, work_folder
from training.base.errors import DataError
from training.base.strict_json import dumps
from training.compat.datatrove import (
    BatchedMinhashSignature,
    ForwardingExactDedupSignature,
    end_if_a_worker_dies,
    errors_without_traceback,
    exact_duplicates_found,
    step_counts,
)

JSONL = partial(JsonlReader, add_file_path=False)  # no path in each document's metadata: nothing reads it
READERS = {".jsonl": JSONL, ".json": JSONL, ".parquet": ParquetReader, ".csv": CSVReader}
# Raised when the stages or the files they leave change: a job folder of another version is refused, not continued
# (2: one read signs for both dedups, whose duplicates the MinHash filter alone removes, numbered on every document).
STAGES_VERSION = 2


@dataclass(frozen=True)
class JobOptions:
    """How the job runs: which executor, how many tasks, and the executor's own settings."""
    executor: str = "local"  # local, slurm or ray
    tasks: int = 2  # per stage that splits its input (reading, signatures, tokenization)
    workers: int = -1  # tasks run at once (-1: all)
    slurm_partition: str | None = None
    slurm_time: str = "24:00:00"
    cpus_per_task: int = 1
    mem_per_cpu_gb: float = 2.0


def as_document(settings: tuple[int, str, bool, str | None], reader, data: dict, path: str, id_in_file) -> dict:
    """A reader adapter: a record of source `index` as a Document with the in-process path's fields
    (sources.to_documents): the text (a chat's turns joined), its messages, its source and its score (the score
    field's value, else NaN). check_sources has read every local file's lines before the job; a hub record of the
    wrong kind is met here."""
    index, field, chat, score_field = settings
    if problem := field_problem(data.get(field), field, chat):
        raise DataError(f"{path}, record {id_in_file}: {problem}")
    score = data.get(score_field) if score_field else NO_SCORE
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise DataError(f"{path}, record {id_in_file}: score_field '{score_field}' is {score!r}, not a number; every "
                        f"document needs a numeric score")
    messages, text = chat_document(data.get(field)) if chat else (None, data.get(field) or "")
    return {"text": text, "id": f"{path}/{id_in_file}",
            "metadata": {"source": index, "messages": messages, "score": float(score)}}


def document_score(doc: Document) -> float:
    """A document's score as the reader set it (JSON writes a NaN back as null)."""
    score = doc.metadata.get("score")
    return NO_SCORE if score is None else score


def reader(source: DataSource, index: int) -> PipelineStep:
    """A datatrove reader of one recipe source; a local path may be a glob of shards (tasks split the files)."""
    field = source.messages_field or source.text_field
    adapter = partial(as_document, (index, field, source.messages_field is not None, source.score_field))
    if source.hub:
        return HuggingFaceDatasetReader(source.hub, {"name": source.subset, "split": source.split}, streaming=True,
                                        adapter=adapter)
    path = Path(source.path)
    if path.suffix not in READERS:
        raise DataError(f"{source.path}: the datatrove engine reads {', '.join(READERS)} files; convert it to JSONL "
                        f"or prepare it with the in-process engine")
    return READERS[path.suffix](str(path.parent), glob_pattern=path.name, adapter=adapter)


def normalized_text(doc: Document) -> bytes:
    """What exact deduplication compares, as dedup.text_hashes does (xxhash of the encoded text)."""
    return normalize(doc.text).encode()


EXACT = ExactDedupConfig(content_getter=normalized_text)


def is_held_out(doc: Document, fraction: float, seed: int) -> bool:
    """The evaluation split: a seeded hash of the text, the same in every task and on every rerun."""
    return xxhash.xxh3_64_intdigest(f"{seed}:{normalize(doc.text)}".encode()) < fraction * 2**64


def recipe_signatures(config: DataConfig) -> Callable[[list[str]], np.ndarray]:
    """The in-process path's MinHash signatures (dedup.MinHasher over the recipe's shingles), for datatrove's buckets:
    both engines sign each document alike."""
    hasher = config.dedup.hasher()
    return lambda texts: hasher.normalized_signatures(normalized_bytes(texts))


def minhash_config(config: DataConfig) -> MinhashConfig:
    """Bands and rows as the in-process path chooses them for the threshold (dedup.lsh_bands)."""
    bands, rows = lsh_bands(config.dedup.threshold, config.dedup.num_perm)
    return MinhashConfig(n_grams=config.dedup.ngram, num_buckets=bands, hashes_per_bucket=rows,
                         hash_config=HashConfig(precision=32))


class QualityFilters(PipelineStep):
    """`data.filters` on a task's documents, in batches, by the chain the in-process path runs (filters.FilterChain), so
    both engines keep the same documents with the same edits. The task's counts and sample of removed documents go to
    datatrove/filters/RANK.json, which the last stage merges."""
    name = "🔍 quality filters"
    type = "🔻 - FILTER"

    def __init__(self, config: DataConfig, tokenizer: PreTrainedTokenizerBase, work: Layout):
        super().__init__()
        self.config, self.work = config, work
        self.chain = FilterChain([(f.type, f.parameters) for f in config.filters], tokenizer)

    def run(self, data, rank: int = 0, world_size: int = 1):
        kinds, seed, samples = [f.type for f in self.config.filters], self.config.seed, self.config.filter_samples
        summary = summarize(kinds, np.zeros(0, np.int64), np.zeros((0, len(kinds))), {}, seed, samples)
        for batch in batched(data, 256):
            with self.track_time("batch"):
                verdicts = self.chain([doc.text for doc in batch], [doc.metadata["messages"] is None for doc in batch])
            removed_by = np.asarray(verdicts["removed_by"], dtype=np.int64)
            gone = np.flatnonzero(removed_by >= 0)
            removed = {"reason": [verdicts["reason"][i] for i in gone], "text": [verdicts["text"][i] for i in gone],
                       "source": [batch[i].metadata["source"] for i in gone]}
            summary = merge([summary, summarize(kinds, removed_by, verdicts["tokens_removed"], removed, seed, samples)],
                            samples)
            scores = document_scores([document_score(doc) for doc in batch], verdicts["classifier_score"])
            for doc, text, by, score in zip(batch, verdicts["text"], removed_by, scores):
                self.stat_update("forwarded" if by < 0 else "dropped")
                if by < 0:
                    doc.text, doc.metadata["score"] = text, score
                    yield doc
        folder = Path(self.work("filters"))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{rank:05d}.json").write_text(dumps(summary) + "\n")


class FilteredDocuments(JsonlReader):
    """What the filter stage kept, read back; when it kept nothing (no file written), a DataError with the counts of
    each filter, as the in-process engine gives, where datatrove's reader would stop on the missing files."""

    def __init__(self, config: DataConfig, work: Layout):
        super().__init__(work("filtered"), add_file_path=False)
        self.config, self.work = config, work

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        if not self.data_folder.list_files():
            stats = {**read_counts(self.config, step_counts(self.work.logs("filtered"))),
                     "filters": filter_summary(self.config, self.work)["filters"]}
            emptied = stats["documents_in"] == stats["empty_documents_removed"]
            raise nothing_left(stats, EMPTY_SOURCES if emptied else FILTERED_ALL)
        yield from super().run(data, rank, world_size)


def read_counts(config: DataConfig, read: list[dict]) -> dict:
    """documents_in and empty_documents_removed, from the step counters of the stage that read the sources (its
    readers, then the empty filter)."""
    readers = len(config.sources)
    return {"documents_in": sum(c.get("documents", 0) for c in read[:readers]),
            "empty_documents_removed": read[readers].get("dropped", 0)}


def filter_summary(config: DataConfig, work: Layout) -> dict:
    """The filter stage's tasks' summaries (QualityFilters) merged: stats.json's `filters` and the samples."""
    return merge([json.loads(p.read_text()) for p in sorted(Path(work("filters")).glob("*.json"))],
                 config.filter_samples)


def read_and_drop_empty(config: DataConfig) -> list[PipelineStep]:
    return [*(reader(s, i) for i, s in enumerate(config.sources)),
            LambdaFilter(lambda doc: bool(doc.text and doc.text.strip()))]


def deduplicated(config: DataConfig, work: Layout, signing: bool = False) -> list[PipelineStep]:
    """The steps every reading stage starts with: read and drop empty documents (or, with quality filters, read what
    the filter stage kept), then, unless the stage is `signing` for deduplication, the duplicates' removal. With near
    dedup that is MinhashDedupFilter alone: an exact duplicate has its original's normalized text, so its MinHash
    signature and every LSH band, and the signature stage signed both, so the cluster stage removed all but one."""
    steps = [FilteredDocuments(config, work)] if config.filters else read_and_drop_empty(config)
    if signing:
        return steps
    if config.dedup.near:
        return [*steps, MinhashDedupFilter(work("minhash_remove"))]
    if config.dedup.exact:
        return [*steps, ExactDedupFilter(work("exact_duplicates"), EXACT)]
    return steps


def evaluation_documents(config: DataConfig, work: Layout) -> datasets.Dataset:
    """The evaluation documents: `eval.sources`, or those the eval stage held out."""
    if config.eval.sources:
        return drop_empty(load_documents(config.eval.sources), {})
    files = sorted(Path(work("eval_documents")).glob("*.jsonl*"))
    held_out = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train") if files else []
    return datasets.Dataset.from_dict({"text": [d["text"] for d in held_out],
                                       "messages": [d["metadata"]["messages"] for d in held_out],
                                       "source": [d["metadata"]["source"] for d in held_out],
                                       "score": [NO_SCORE] * len(held_out)}, features=FEATURES)


class TokenizeAndPack(PipelineStep):
    """The last per-task stage: decontaminate, tokenize, mix and pack the task's documents as prepare.py
    does, into datatrove/rows/train-RANK (datasets.save_to_disk; assemble links those files into the output) and its
    counts into train-RANK.json."""
    name = "🧱 tokenize, mix and pack"
    type = "🔢 - TOKENIZER"

    def __init__(self, config: DataConfig, tokenizer: PreTrainedTokenizerBase, work: Layout):
        super().__init__()
        self.config, self.tokenizer, self.work = config, tokenizer, work

    def run(self, data, rank: int = 0, world_size: int = 1):
        documents = [(doc.text, doc.metadata["messages"], doc.metadata["source"], document_score(doc)) for doc in data]
        with self.track_time():
            packed, stats = self.pack(documents, rank, world_size) if documents else (None, {"rows": 0})
            folder = Path(self.work("rows"))
            folder.mkdir(parents=True, exist_ok=True)
            if packed is not None:
                labels = [source.key for source in self.config.sources] if self.config.phases else None
                rows = rows_to_dataset(packed, f"{job_fingerprint(self.work)}-task-{rank}", labels)
                rows.save_to_disk(str(folder / f"train-{rank:05d}"))
            (folder / f"train-{rank:05d}.json").write_text(dumps(stats) + "\n")
            self.stat_update("documents", value=len(documents))
            self.stat_update("rows", value=stats["rows"])

    def pack(self, documents: list[tuple], rank: int, world_size: int) -> tuple[dict | None, dict]:
        config, stats = self.config, {}
        texts, messages, sources, scores = zip(*documents)
        kept = datasets.Dataset.from_dict({"text": texts, "messages": messages, "source": sources, "score": scores},
                                          features=FEATURES)
        if (config.eval.sources or config.eval.fraction) and config.eval.decontaminate:
            kept = decontaminate(kept, evaluation_documents(config, self.work), config, stats)
        tokenized = tokenize_documents(kept, self.tokenizer)
        stats["no_assistant_reply_skipped"] = len(kept) - len(tokenized)
        sources = np.asarray(tokenized["source"], dtype=np.int64)
        task = rank if world_size > 1 else None  # one task mixes as the in-process path does
        rows = mixture_rows(sources, [s.weight for s in config.sources], config.seed, task)
        if config.phases:
            packed, pack_stats = pack_by_source(tokenized, config, pad_token_id(self.tokenizer), task)
        else:
            packed, pack_stats = pack_rows(tokenized, rows, config, pad_token_id(self.tokenizer))
        stats.update(pack_stats, documents_kept=np.bincount(sources, minlength=len(config.sources)).tolist(),
                     documents_in_mixture=np.bincount(sources[rows], minlength=len(config.sources)).tolist())
        return packed, stats


def job_stats(config: DataConfig, work: Layout) -> dict:
    """prepare.py's stats.json from the step counters of the stage that read the sources (the filter stage, or the
    last one), the last stage's, and each task's counts."""
    counts = step_counts(work.logs("rows"))  # the rows stage starts with deduplicated()'s steps, in order
    dropped = {type(step): count.get("dropped", 0) for step, count in zip(deduplicated(config, work), counts)}
    exact, near = dropped.get(ExactDedupFilter, 0), dropped.get(MinhashDedupFilter, 0)
    if config.dedup.exact and config.dedup.near:  # MinhashDedupFilter removed both kinds (deduplicated)
        exact = exact_duplicates_found(work("exact_duplicates"), EXACT.hash_config)
        near -= exact
    readers = len(config.sources)
    # the sources' readers, then the empty filter
    read = step_counts(work.logs("filtered")) if config.filters else counts
    stats = {**read_counts(config, read), "exact_duplicates_removed": exact, "near_duplicates_removed": near}
    tasks = [json.loads(p.read_text()) for p in sorted(Path(work("rows")).glob("train-*.json"))]
    for key in ("decontaminated_removed", "no_assistant_reply_skipped", "documents_out", "tokens_in", "tokens_out",
                "tokens_dropped", "rows"):
        stats[key] = sum(task.get(key, 0) for task in tasks)
    for key in LONG_DOCUMENT_STATS.values():
        if any(key in task for task in tasks):
            stats[key] = sum(task.get(key, 0) for task in tasks)
    stats["packing_efficiency"] = stats["tokens_out"] / max(1, stats["rows"] * config.seq_len)
    kept = np.sum([task.get("documents_kept", [0] * readers) for task in tasks], axis=0)
    mixed = np.sum([task.get("documents_in_mixture", [0] * readers) for task in tasks], axis=0)
    stats.update(seq_len=config.seq_len, packing=config.packing, engine="datatrove", tasks=len(tasks), sources=[
        {"name": s.name, "weight": s.weight, "documents_in": read[i].get("documents", 0),
         "documents_kept": int(kept[i]), "documents_in_mixture": int(mixed[i])} for i, s in enumerate(config.sources)])
    if config.phases:
        rows, tokens = (np.sum([task.get(f"source_{key}", [0] * readers) for task in tasks], axis=0)
                        for key in ("rows", "tokens"))
        for count, source, source_rows, source_tokens in zip(stats["sources"], config.sources, rows, tokens):
            count.update(label=source.key, rows=int(source_rows), tokens=int(source_tokens))
    return stats


class Assemble(PipelineStep):
    """The job's end (one task): the evaluation split packed and saved with the tasks' rows as the `train` split (their
    Arrow files linked, not copied: compat.datasets), where `data.prepared` reads it, with stats.json last."""
    name = "📦 assemble the prepared data set"
    type = "💽 - WRITER"

    def __init__(self, config: DataConfig, tokenizer: PreTrainedTokenizerBase, work: Layout, output: Path):
        super().__init__()
        self.config, self.tokenizer, self.work, self.output = config, tokenizer, work, output

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        with self.track_time():
            stats, removed = job_stats(self.config, self.work), []
            if self.config.filters:
                summary = filter_summary(self.config, self.work)
                stats["filters"], removed = summary["filters"], summary["samples"]
            if stats["documents_in"] == stats["empty_documents_removed"]:
                raise nothing_left(stats, EMPTY_SOURCES)
            if stats["rows"] == 0:
                raise DataError(f"the data holds {stats['tokens_in']} tokens after tokenization, less than one row of "
                                f"data.seq_len={self.config.seq_len} in any task; add data, lower data.seq_len or "
                                f"use fewer --tasks ({json.dumps(stats)})")
            splits = {}
            if self.config.eval.sources or self.config.eval.fraction:
                evaluation = evaluation_documents(self.config, self.work)
                stats["eval_documents"] = len(evaluation)
                eval_rows, stats["eval"] = pack(tokenize_documents(evaluation, self.tokenizer), None, self.config,
                                                pad_token_id(self.tokenizer))
                splits["eval"] = rows_to_dataset(eval_rows, f"{job_fingerprint(self.work)}-eval")
            parts = sorted(path for path in Path(self.work("rows")).glob("train-*") if path.is_dir())
            save_prepared(datasets.DatasetDict(splits), stats, removed, self.output, train_parts=parts)


def stages(config: DataConfig, tokenizer: PreTrainedTokenizerBase, work: Layout, output: Path,
           tasks: int) -> list[tuple[str, list[PipelineStep], int]]:
    """(name, steps, tasks) of each stage, in the order they must run."""
    minhash = minhash_config(config)
    result = []
    if config.filters:
        result.append(("filtered", [*read_and_drop_empty(config), QualityFilters(config, tokenizer, work),
                                    JsonlWriter(work("filtered"))], tasks))
    signing = deduplicated(config, work, signing=True)
    if config.dedup.exact:  # hash ranges: one finder per task
        signing.append(ForwardingExactDedupSignature(work("exact_signatures"), EXACT, finder_workers=tasks))
    if config.dedup.near:
        signing.append(BatchedMinhashSignature(work("minhash_signatures"), minhash, recipe_signatures(config)))
    if config.dedup.exact or config.dedup.near:  # one read of the sources signs for both
        result.append(("signatures", signing, tasks))
    if config.dedup.exact:
        result.append(("exact_duplicates", [ExactFindDedups(work("exact_signatures"), work("exact_duplicates"), EXACT)],
                       tasks))
    if config.dedup.near:
        result += [("minhash_buckets", [MinhashDedupBuckets(work("minhash_signatures"), work("minhash_buckets"),
                                                            config=minhash)], minhash.num_buckets),
                   ("minhash_clusters", [MinhashDedupCluster(work("minhash_buckets"), work("minhash_remove"),
                                                             minhash)], 1)]
    held_out = partial(is_held_out, fraction=config.eval.fraction, seed=config.seed)
    if config.eval.fraction:
        result.append(("eval_documents", [*deduplicated(config, work), LambdaFilter(held_out),
                                          JsonlWriter(work("eval_documents"))], tasks))
    training = [LambdaFilter(lambda doc: not held_out(doc))] if config.eval.fraction else []
    result += [("rows", [*deduplicated(config, work), *training, TokenizeAndPack(config, tokenizer, work)], tasks),
               ("assemble", [Assemble(config, tokenizer, work, output)], 1)]
    return result


def executor(options: JobOptions, name: str, steps: list[PipelineStep], tasks: int, logs: str, depends,
             job_name: str):
    """datatrove's executor of one stage, started after `depends`. The local pool forks its workers on Linux, so that
    they start with the job's modules imported: under datatrove's default (forkserver) each worker of every stage
    imported torch, transformers and datasets again, 3 s or more each (benchmarks/data_engines.py). macOS keeps
    forkserver, where fork is unsafe."""
    workers = min(options.workers, tasks) if options.workers > 0 else -1
    if options.executor == "local":
        return LocalPipelineExecutor(steps, tasks=tasks, workers=workers, logging_dir=logs, depends=depends,
                                     start_method="fork" if sys.platform == "linux" else "forkserver")
    if options.executor == "slurm":
        return SlurmPipelineExecutor(steps, tasks=tasks, workers=workers, logging_dir=logs, depends=depends,
                                     time=options.slurm_time, partition=options.slurm_partition,
                                     cpus_per_task=options.cpus_per_task, mem_per_cpu_gb=options.mem_per_cpu_gb,
                                     job_name=f"{job_name}-{name}", venv_path=f"{sys.prefix}/bin/activate")
    from datatrove.executor import RayPipelineExecutor
    return RayPipelineExecutor(steps, tasks=tasks, workers=workers, logging_dir=logs,  # ray_job runs them in order
                               cpus_per_task=options.cpus_per_task, mem_per_cpu_gb=options.mem_per_cpu_gb)


def check_options(options: JobOptions) -> None:
    if options.executor == "slurm" and not options.slurm_partition:
        raise DataError("--executor slurm needs --slurm-partition (the partition the jobs run on)")
    if options.executor == "ray" and importlib.util.find_spec("ray") is None:
        raise DataError("--executor ray needs Ray on this machine and the cluster (pip install -r requirements.txt "
                        "installs it); start or join a cluster (ray start --head) before running")


def check_sources(config: DataConfig) -> None:
    """Before any stage starts: each local source has a reader, every line of its files reads (UTF-8, JSON
    objects whose field is text or a conversation: datatrove's reader would skip a bad line with a warning,
    or the rest of a file at a byte that is not UTF-8), and its first record has the recipe's field (a task
    would otherwise read a missing field as an empty document and drop it). Reading every line costs one
    pass over the local files in this process (docs/data_at_scale.md has the rate); a bad line found by a
    task instead would surface only in its log, after the stages before it had run."""
    for index, source in enumerate(config.sources + config.eval.sources):
        if source.path:
            reader(source, index)
            for path in matching_files(source.path):
                if path.endswith(".json") and not is_json_lines(path):
                    raise DataError(f"{path} is one JSON array; the datatrove engine reads .json files as JSON lines "
                                    f"(one object per line): convert it (jq -c '.[]'), or use the in-process engine")
                check_lines(path, *source_field(source), loads=orjson.loads)
            next(iter(load_source(source, index, streaming=True)), None)


def run_job(config: DataConfig, tokenizer: PreTrainedTokenizerBase, output: Path, options: JobOptions,
            job_name: str) -> Path:
    """Run (local) or submit (Slurm, Ray) the job; its working files go to OUTPUT.datatrove next to OUTPUT."""
    check_options(options)
    check_sources(config)
    check_models([(f.type, f.parameters) for f in config.filters])
    work = Layout(work_folder(output))
    if options.executor == "ray":
        ray_job.connect(work.root / "tmp")
    claim_work_folder(work, {"fingerprint": fingerprint(config, tokenizer), "tasks": options.tasks,
                             "stages": STAGES_VERSION})
    reopen_for_rerun(work, output, held_out=bool(config.eval.fraction))
    previous, plan, executors = None, [], []
    for name, steps, tasks in stages(config, tokenizer, work, output, options.tasks):
        previous = executor(options, name, steps, tasks, work.logs(name), previous, job_name)
        executors.append((name, previous))
        forked_pool = options.executor == "local" and previous.workers > 1 and previous.start_method == "fork"
        plan.append((name, tasks, previous.workers if forked_pool else 0))  # forkserver adds processes of its own
    if options.executor == "ray":
        (work.root / "tmp").mkdir(exist_ok=True)
        ray_job.run_stages(executors, work.logs)
        return Path(work.root)
    if options.executor == "local" and options.workers != 1:
        # datatrove's local pool waits forever for the task of a worker that died (training/compat/datatrove.py)
        threading.Thread(target=end_if_a_worker_dies, args=(work.logs, plan), daemon=True).start()
    errors_without_traceback(DataError)  # the command prints it in one line
    previous.run()
    return Path(work.root)
