"""data.phases and data.seq_len_warmup through train.py: a WSD run that anneals on one source in its decay, its
first steps on shorter rows, logs each step's phase, sequence length and each source's tokens as the schedules have
them, and a run killed in the middle of its first phase and of the warmup, resumed on another world size (a universal
checkpoint), reads the same rows: its losses are the uninterrupted run's (fp32, 1e-5 relative, as
tests/test_resume_anywhere.py) and its logged data fields equal them exactly."""
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import SMALL_MODEL, run_train
from tests.test_resume_anywhere import metrics
from training.config.recipe import RECIPES_DIR

pytestmark = pytest.mark.slow

STEPS, KILLED_AT, RESUMED_FROM, SEQ_LEN, BATCH = 12, 9, 6, 256, 16
PHASES = ("data.phases=[{name: main, weights: {docstring: 9, pydoc: 1}}, "
          "{name: anneal, steps: decay, weights: {docstring: 1, pydoc: 3}}]")  # the decay: round(0.34 x 12) = 4 steps
WARMUP = "data.seq_len_warmup={start: 64, steps: 8}"  # the ramp 64 + 24 p: 64 at p 0-2, 128 at 3-7, then 256


def split_corpus(folder: Path) -> list[str]:
    """tiny_llama's corpus as two sources, by its documents' `source` field: the help topics (pydoc) and the
    docstrings."""
    parts = {"pydoc": [], "docstring": []}
    for line in (RECIPES_DIR / "tiny_llama" / "corpus.jsonl").read_text().splitlines():
        parts[json.loads(line)["source"].split(":")[0]].append(line + "\n")
    for name, lines in parts.items():
        (folder / f"{name}.jsonl").write_text("".join(lines))
    return [f"data.sources=[{{path: {folder / 'docstring.jsonl'}}}, {{path: {folder / 'pydoc.jsonl'}}}]"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    common = ["--recipe", "tiny_llama", SMALL_MODEL, data_cache, *split_corpus(tmp_path_factory.mktemp("corpus")),
              PHASES, WARMUP, f"training.max_steps={STEPS}", "training.schedule=wsd", "training.decay_ratio=0.34",
              "checkpointing.every_steps=3", "checkpointing.average_last=2", "logging.every_steps=1",
              "deepspeed.config=zero2", "precision=fp32"]
    whole, killed = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("killed")
    result = run_train(["--output-dir", str(whole), *common], ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    cut = run_train(["--kill-after-deepspeed-save", str(KILLED_AT), "--output-dir", str(killed), *common], ranks=1,
                    script="tests/helpers/train_with_probes.py")
    assert cut.returncode != 0 and (killed / "checkpoints" / "latest").read_text() == f"global_step{RESUMED_FROM}"
    resumed = run_train(["--output-dir", str(killed), "--resume", *common], ranks=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {"whole": whole, "resumed": killed, "console": result.stdout}


def test_each_step_logs_its_phase_and_the_sources_tokens_of_the_schedule(runs):
    records = [r for r in metrics(runs["whole"]) if "loss" in r]
    assert [r["phase"] for r in records] == ["main"] * 8 + ["anneal"] * 4
    assert [r["seq_len"] for r in records] == [64] * 3 + [128] * 5 + [256] * 4
    # concat packing fills every row: a phase's tokens per source are its rows (its weights' shares) x seq_len
    main, anneal = 8 * BATCH, 4 * BATCH
    assert records[7]["source_tokens"] == {"docstring": round(main * 0.9) * SEQ_LEN,
                                           "pydoc": round(main * 0.1) * SEQ_LEN}
    assert records[-1]["source_tokens"] == {"docstring": (round(main * 0.9) + anneal // 4) * SEQ_LEN,
                                            "pydoc": (round(main * 0.1) + anneal * 3 // 4) * SEQ_LEN}
    assert "  anneal: steps 9-12: docstring 16 rows" in runs["console"]  # the plan, printed once
    assert runs["console"].count("data phases (rows per source") == 1
    assert runs["console"].count("64 tokens x 32 rows/micro-batch from step 1, 128 tokens x 16 rows") == 1


def test_a_run_resumed_in_the_middle_of_a_phase_on_another_world_size_reads_the_same_rows(runs):
    whole, resumed = ({r["step"]: r for r in metrics(runs[name]) if "loss" in r} for name in ("whole", "resumed"))
    for step in range(RESUMED_FROM + 1, STEPS + 1):
        assert resumed[step]["phase"] == whole[step]["phase"]
        assert resumed[step]["source_tokens"] == whole[step]["source_tokens"]
        assert resumed[step]["seq_len"] == whole[step]["seq_len"]
        assert resumed[step]["loss"] == pytest.approx(whole[step]["loss"], rel=1e-5)


def test_the_run_averages_its_last_checkpoints_into_hf_average(runs, tmp_path):
    """checkpointing.average_last=2: hf_average/ is the exact mean (float64, rounded to fp32) of the exports of the
    last two checkpoints, and loads in transformers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from training.__main__ import main
    exports = []
    for step in (STEPS - 3, STEPS):
        tag = runs["whole"] / "checkpoints" / f"global_step{step}"
        assert main(["export", str(tag), str(tmp_path / str(step))]) == 0
        exports.append(load_file(tmp_path / str(step) / "model.safetensors"))
    averaged = load_file(runs["whole"] / "hf_average" / "model.safetensors")
    assert averaged.keys() == exports[0].keys()
    for name, tensor in averaged.items():
        assert torch.equal(tensor, ((exports[0][name].double() + exports[1][name].double()) / 2).float()), name
    assert not torch.equal(averaged[name], exports[1][name])
    assert f"hf_average/: the mean of the weights of global_step{STEPS - 3}, global_step{STEPS}" in runs["console"]
    AutoModelForCausalLM.from_pretrained(runs["whole"] / "hf_average")
