"""The warm ranks (tests/warm_ranks.py) give what fresh processes give: a run in the pool after runs that patched
DeepSpeed and transformers (Ulysses' attention wrapper and ZeRO-3's summing reduce-scatter under sequence
parallelism, the probes' patches of train.py and DeepSpeedEngine) computes bit for bit what a launch computes, and
what the pool puts back after a run is the state its imports left."""
import json
import logging
import os
import signal
import warnings

import pytest

from tests.conftest import SMALL_MODEL, run_train


def records(out) -> list[tuple]:
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, (out / "metrics.jsonl").open()) if "loss" in r]


@pytest.mark.slow
def test_a_run_after_other_runs_in_the_pool_computes_what_a_fresh_launch_computes(tmp_path, data_cache):
    common = ["--recipe", "tiny_llama", SMALL_MODEL, data_cache, "training.max_steps=3", "logging.every_steps=1",
              "deepspeed.config=zero3", "precision=fp32"]
    probed = ["--insert-poisoned-batches", "spike:1", "--record-logits"]
    runs = {"probed warm": (probed, common, False), "sp warm": ([], [*common, "parallelism.sequence_parallel=2"], False),
            "plain warm": ([], common, False), "probed launched": (probed, common, True),
            "plain launched": ([], common, True)}
    for name, (probes, args, launch) in runs.items():
        out = tmp_path / name.replace(" ", "_")
        result = run_train([*probes, *args, "--output-dir", str(out)], ranks=2, launch=launch,
                           script="tests/helpers/train_with_probes.py" if probes else "train.py")
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        assert result.stdout.count("peak memory per rank") == 1  # rank 0's summary, once, as the launcher shows it
    for kind in ("probed", "plain"):
        warm, launched = records(tmp_path / f"{kind}_warm"), records(tmp_path / f"{kind}_launched")
        assert len(warm) == 3 and warm == launched
    flat = [[value for record in records(tmp_path / f"{kind}_warm") for value in record] for kind in ("sp", "plain")]
    assert flat[0] == pytest.approx(flat[1], rel=1e-5)  # tests/test_parallelism.py's tolerance for SP
    assert (tmp_path / "probed_warm" / "engine_logits.pt").exists()
    assert not (tmp_path / "plain_warm" / "engine_logits.pt").exists()


def test_the_baseline_puts_back_what_a_run_changed(monkeypatch):
    """Module and class attributes, registries, the environment, signal handlers, warning filters, loggers and random
    generators: changed by a "run", back as the imports left them after restore()."""
    import deepspeed.runtime.zero.stage3 as stage3
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import train
    from tests.helpers.warm_rank import Baseline
    baseline = Baseline()
    reduce_scatter, save, sdpa = stage3.reduce_scatter_coalesced, DeepSpeedEngine.save_checkpoint, \
        ALL_ATTENTION_FUNCTIONS["sdpa"]
    handler, filters, level = signal.getsignal(signal.SIGTERM), list(warnings.filters), logging.getLogger("DeepSpeed").level
    generator = torch.get_rng_state()
    try:
        stage3.reduce_scatter_coalesced = DeepSpeedEngine.save_checkpoint = train.train = print
        ALL_ATTENTION_FUNCTIONS["sdpa"] = print
        ALL_ATTENTION_FUNCTIONS.register("warm_rank_test", print)
        train.brand_new = print
        os.environ["WARM_RANK_TEST"] = "1"
        signal.signal(signal.SIGTERM, lambda *_: None)
        warnings.filterwarnings("ignore", message="warm rank test")
        logging.getLogger("DeepSpeed").setLevel(logging.CRITICAL)
        train.stop_requested.set()
        torch.manual_seed(123)
    finally:
        baseline.restore()
    assert (stage3.reduce_scatter_coalesced, DeepSpeedEngine.save_checkpoint, ALL_ATTENTION_FUNCTIONS["sdpa"]) == \
        (reduce_scatter, save, sdpa)
    assert train.train is not print and not hasattr(train, "brand_new")
    assert "warm_rank_test" not in ALL_ATTENTION_FUNCTIONS and "WARM_RANK_TEST" not in os.environ
    assert signal.getsignal(signal.SIGTERM) is handler and warnings.filters == filters
    assert logging.getLogger("DeepSpeed").level == level and not train.stop_requested.is_set()
    assert torch.equal(torch.get_rng_state(), generator)
