"""Canaries of training/compat/datatrove.py (docs/compat.md)."""
import inspect
import io
import json

import numpy as np
import pytest

pytest.importorskip("datatrove")
from datatrove.executor import LocalPipelineExecutor  # noqa: E402
from datatrove.executor.base import PipelineExecutor  # noqa: E402
from datatrove.pipeline.dedup import MinhashDedupSignature  # noqa: E402
from datatrove.pipeline.dedup.minhash import MinhashConfig  # noqa: E402
from datatrove.pipeline.filters import LambdaFilter  # noqa: E402
from datatrove.utils.stats import PipelineStats  # noqa: E402

from training.compat.datatrove import ShinglesMinhashSignature, step_counts  # noqa: E402


def test_minhash_signatures_hash_what_get_shingles_returns(tmp_path):
    assert "self.get_shingles(" in inspect.getsource(MinhashDedupSignature.run)
    step = ShinglesMinhashSignature(str(tmp_path), MinhashConfig(), lambda text: np.array([[7]], dtype=np.uint64))
    assert step.get_shingles("any text").tolist() == [[7]]


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
    assert "pool.imap_unordered(" in inspect.getsource(LocalPipelineExecutor), \
        "datatrove's local executor runs its tasks otherwise now: check whether compat/datatrove.py " \
        "end_if_a_worker_dies can go"
