"""Canaries of training/compat/datatrove.py (docs/compat.md)."""
import inspect
import io
import json
import subprocess
import sys

import numpy as np
import pytest
from datatrove.data import Document
from datatrove.executor import LocalPipelineExecutor
from datatrove.executor.base import PipelineExecutor
from datatrove.pipeline.dedup import MinhashDedupSignature
from datatrove.pipeline.dedup.exact_dedup import (
    ExactDedupConfig,
    ExactDedupFilter,
    ExactDedupSignature,
    ExactFindDedups,
)
from datatrove.pipeline.dedup.minhash import MinhashConfig
from datatrove.pipeline.filters import C4QualityFilter, GopherQualityFilter, LambdaFilter, LanguageFilter
from datatrove.utils import lid
from datatrove.utils.hashing import HashConfig
from datatrove.utils.stats import PipelineStats
from datatrove.utils.word_tokenizers import SpaCyTokenizer, load_word_tokenizer

from data_pipeline.filters import PACKAGED_LID, language_model_file
from tests.conftest import REPO
from tests.helpers.planted_corpus import FOREIGN, prose_documents
from training.base.errors import DataError
from training.compat.datatrove import (
    BatchedMinhashSignature,
    ForwardingExactDedupSignature,
    LocalFileLanguageFilter,
    errors_without_traceback,
    exact_duplicates_found,
    language_filter,
    step_counts,
    warm_word_tokenizers,
)


def test_batched_signatures_write_the_files_datatrove_writes_for_the_same_signatures(tmp_path):
    """datatrove's own signature step, handed the same signatures per document, writes the same bytes: the bucket files'
    names, record layout, order and the numbering of documents (one without words gets no record)."""
    texts = ["one doc", " \n ", "two", "three", "four", "five five", "six"]
    config = MinhashConfig(num_buckets=3, hashes_per_bucket=4, hash_config=HashConfig(precision=32))
    signatures = np.random.default_rng(0).integers(0, 2**32, (len(texts), 13), dtype=np.uint32)
    signatures[4, :4] = signatures[2, :4]  # a shared band: the records sort on the document index after the hashes
    signed = {text: row for text, row in zip(texts, signatures)}

    class GivenSignatures(MinhashDedupSignature):
        def get_shingles(self, text: str) -> np.ndarray:
            return np.array([[texts.index(text)]] if text.strip() else [], dtype=np.uint64)

        def get_signature(self, shingles: np.ndarray) -> list[list[int]]:
            return [part.tolist() for part in np.split(signatures[int(shingles[0, 0])][:12], 3)]

    documents = [Document(text, str(i)) for i, text in enumerate(texts)]
    GivenSignatures(str(tmp_path / "datatrove"), config).run(iter(documents), rank=3)
    ours = BatchedMinhashSignature(str(tmp_path / "ours"), config,
                                   lambda batch: np.stack([signed[text] for text in batch]), batch_bytes=8)
    ours.run(iter(documents), rank=3)
    for bucket in range(3):
        name = f"bucket_{bucket:03d}/00003.minhash.sig"
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "datatrove" / name).read_bytes(), name
    assert len((tmp_path / "ours" / "bucket_000/00003.minhash.sig").read_bytes()) == 6 * 5 * 4


EXACT_TEXTS = ["a", "b", "a", "c", "b", "a", "d"]  # three duplicates
EXACT = ExactDedupConfig(content_getter=lambda doc: doc.text.encode())  # xxhash 4 hashes bytes only (datatrove#508)


def test_forwarded_exact_signatures_are_the_files_datatrove_writes(tmp_path):
    documents = [Document(text, str(i)) for i, text in enumerate(EXACT_TEXTS)]
    for rank in range(2):
        ExactDedupSignature(str(tmp_path / "datatrove"), EXACT, finder_workers=2).run(iter(documents), rank=rank)
        ours = ForwardingExactDedupSignature(str(tmp_path / "ours"), EXACT, finder_workers=2)
        passed = list(ours.run(iter(documents), rank))
        assert passed == documents
    written = sorted(p.relative_to(tmp_path / "datatrove") for p in (tmp_path / "datatrove").rglob("*") if p.is_file())
    assert len(written) == 4  # a file per task in each finder's folder
    for name in written:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "datatrove" / name).read_bytes(), name


def test_exact_duplicates_found_counts_what_the_exact_filter_drops(tmp_path):
    """Two tasks with the same documents, two finders: every copy after the first of its text is a duplicate."""
    documents = [Document(text, str(i)) for i, text in enumerate(EXACT_TEXTS)]
    for rank in range(2):
        ExactDedupSignature(str(tmp_path / "signatures"), EXACT, finder_workers=2).run(iter(documents), rank=rank)
    for rank in range(2):
        ExactFindDedups(str(tmp_path / "signatures"), str(tmp_path / "duplicates"), EXACT).run(rank=rank, world_size=2)
    dropped = 0
    for rank in range(2):
        step = ExactDedupFilter(str(tmp_path / "duplicates"), EXACT)
        kept = list(step.run(iter(documents), rank=rank, world_size=2))
        dropped += len(documents) - len(kept)
    assert dropped == 3 + len(set(EXACT_TEXTS)) + 3  # the second task's every document repeats the first's
    assert exact_duplicates_found(str(tmp_path / "duplicates"), EXACT.hash_config) == dropped


def test_task_stats_are_saved_where_step_counts_reads_them(tmp_path):
    assert 'f"stats/{rank:05d}.json"' in inspect.getsource(PipelineExecutor._run_for_rank)
    step = LambdaFilter(lambda doc: True)
    step.stat_update("dropped", value=3)
    saved = io.StringIO()
    PipelineStats([step]).save_to_disk(saved)
    (tmp_path / "stats").mkdir()
    for rank in range(2):
        (tmp_path / "stats" / f"{rank:05d}.json").write_text(saved.getvalue())
    assert step_counts(str(tmp_path))[0]["dropped"] == 6, json.loads(saved.getvalue())


def test_stages_mark_their_start_and_each_finished_task():
    source = inspect.getsource(PipelineExecutor)
    assert '"executor.json"' in source and 'f"completions/{rank:05d}"' in source


def test_the_local_executor_still_waits_on_a_pool():
    source = inspect.getsource(LocalPipelineExecutor)
    assert "pool.imap_unordered(" in source, \
        "datatrove's local executor runs its tasks otherwise now: check whether compat/datatrove.py " \
        "end_if_a_worker_dies can go"
    # a stage's direct children: a Manager process, then a pool of `workers` processes
    # (end_if_a_worker_dies counts them)
    assert "multiprocess.Manager()" in source and "ctx.Pool(self.workers)" in source


A_JOB_WHOSE_WORKER_DIES_UNSEEN = """
import os, sys, threading, time
from pathlib import Path
from training.compat.datatrove import end_if_a_worker_dies

logs = Path(sys.argv[1])
(logs / "rows").mkdir(parents=True)
(logs / "rows" / "executor.json").write_text("{}")  # the stage has started and no task has finished


def child() -> int:
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    return pid


threading.Thread(target=end_if_a_worker_dies, args=(lambda name: str(logs / name), [("rows", 2, 2)], 0.3),
                 daemon=True).start()
started = [child() for _ in range(3)]  # datatrove's manager and the pool's 2 workers
time.sleep(1)
print("the pool as started is left alone", flush=True)
replacement = child()  # all a worker that died between two of the watchdog's looks leaves to see: the pool's new one
time.sleep(5)
"""


@pytest.mark.slow
def test_a_worker_that_dies_unseen_is_found_by_its_replacement(tmp_path):
    """end_if_a_worker_dies polls every 0.2 s; a worker killed between two looks is found because the pool replaced
    it."""
    done = subprocess.run([sys.executable, "-c", A_JOB_WHOSE_WORKER_DIES_UNSEEN, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert "the pool as started is left alone" in done.stdout, done.stderr[-2000:]
    assert done.returncode == 1, done.stderr[-2000:]
    assert "pool replaced a worker process that died (3 workers started for a pool of 2)" in done.stderr
    assert "run the same command again" in done.stderr


ODD_TEXTS = ["", "   ", "Ünïcödé wörds — and “quotes”…", "a\n\n\nb c.  d!",
             "e-mail: someone@example.com, URL https://example.com/x?y=1 (see 3.14)."]


def test_filters_ask_load_word_tokenizer_and_the_warm_pipeline_answers_the_same():
    """Gopher's words and C4's sentences come from load_word_tokenizer(language); inside warm_word_tokenizers they are
    the same as datatrove's own, and outside it datatrove's methods are back."""
    english = load_word_tokenizer("eng")
    assert type(english) is SpaCyTokenizer and english.config is None
    texts = prose_documents()[:40] + ODD_TEXTS
    words, spans = [english.word_tokenize(t) for t in texts], [english.span_tokenize(t) for t in texts]
    asked = []
    with warm_word_tokenizers({"eng"}):
        warm = english.word_tokenize
        english.word_tokenize = lambda text: asked.append("words") or warm(text)
        GopherQualityFilter().filter(Document(text=texts[0], id="0"))
        english.word_tokenize = warm
        assert asked == ["words"]
        warm_spans = english.span_tokenize
        english.span_tokenize = lambda text: asked.append("spans") or warm_spans(text)
        C4QualityFilter().filter(Document(text=texts[0], id="0"))
        english.span_tokenize = warm_spans
        assert "spans" in asked
        assert [english.word_tokenize(t) for t in texts] == words
        assert [english.span_tokenize(t) for t in texts] == spans
    assert "word_tokenize" not in vars(english) and "span_tokenize" not in vars(english)


def test_the_language_filter_predicts_with_the_lid_in_its_model_attribute(monkeypatch):
    """LanguageFilter asks its `model` attribute (an FT176LID, which would download lid.176.bin and needs the
    fasttext-numpy2-wheel distribution); the packaged file answers in its place, with nothing downloaded."""
    with pytest.raises(ImportError, match="fasttext-numpy2-wheel"):
        LanguageFilter(["en"])  # when upstream accepts fasttext-predict, LocalFileLanguageFilter.__new__ can go
    assert isinstance(LocalFileLanguageFilter(["en"]).model, lid.FT176LID)
    monkeypatch.setattr(lid, "cached_asset_path_or_download", lambda *args, **kwargs: pytest.fail("a download"))
    keeps = language_filter(["en"], 0.65, language_model_file(PACKAGED_LID))
    assert keeps.filter(Document(text=prose_documents()[0], id="0"))
    document = Document(text=FOREIGN[0], id="1")
    assert not keeps.filter(document) and document.metadata["language"] == "fr"


def test_a_task_still_logs_its_exception_through_loguru():
    """A task's exception goes through loguru's logger.exception, traceback and all, unless errors_without_traceback
    names its type: then the message alone is logged."""
    from datatrove.utils.logging import logger
    assert "logger.exception(e)" in inspect.getsource(PipelineExecutor._run_for_rank)
    console = io.StringIO()
    sink = logger.add(console, format="{message}")
    try:
        errors_without_traceback(DataError)
        for error in (DataError("no documents are left"), ValueError("a bug")):
            try:
                raise error
            except Exception as raised:
                logger.exception(raised)
    finally:
        logger.remove(sink)
        logger.configure(patcher=lambda record: None)
    data_error, bug = console.getvalue().split("a bug\n", 1)
    assert data_error == "no documents are left\n" and "Traceback" in bug and "ValueError: a bug" in bug
