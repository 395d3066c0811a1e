"""benchmarks/hf_trainer.py, in process: its clock counts each logged interval's real tokens as the Trainer trains
them (with accumulation, and with the loader fetching ahead), logs the last step as train.py does, and the script
refuses recipe settings it cannot give the Trainer. The whole run is in test_gpu_validate.py's smoke."""
import sys

import pytest
from transformers import TrainerControl, TrainerState

import train
from tests.conftest import REPO
from training.base.errors import ConfigError

sys.path.insert(0, str(REPO / "benchmarks"))
import hf_trainer  # noqa: E402


def rows(*lengths: int) -> list[dict]:
    return [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, -100], "position_ids": [0, 1, 0, 1], "length": length}
            for length in lengths]


def test_each_logged_interval_holds_the_real_tokens_of_its_steps():
    collator = hf_trainer.CountingCollator()
    clock = hf_trainer.StepClock(collator)
    state, control = TrainerState(max_steps=4), TrainerControl()
    micro_batches = [rows(1, 2), rows(5), rows(10), rows(10), rows(20), rows(20), rows(40), rows(40), rows(99)]
    batch = collator(micro_batches[0])
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["position_ids"].shape == (2, 4)
    clock.on_train_begin(None, state, control)
    for index, ahead in enumerate(micro_batches[1:]):  # accumulation 2; the loader fetches one micro-batch ahead
        collator(ahead)
        if index % 2 == 0:
            clock.on_substep_end(None, state, control)
            continue
        state.global_step = step = index // 2 + 1
        control.should_log = step in (1, 3)  # the Trainer's logging_first_step and logging_steps=3
        clock.on_step_end(None, state, control)
        assert control.should_log == (step in (1, 3, 4))  # and the last step, as train.py logs it
        if control.should_log:
            clock.on_log(None, state, control, logs={"loss": float(step), "learning_rate": 0.1, "grad_norm": 1.0})
    clock.on_log(None, state, control, logs={"train_runtime": 1.0})  # the Trainer's closing summary: not a step
    assert [(r["step"], r["steps"], r["tokens"], r["loss"]) for r in clock.records] == [
        (1, 1, 3 + 5, 1.0), (3, 2, 10 + 10 + 20 + 20, 3.0), (4, 1, 40 + 40, 4.0)]  # never the 99 fetched ahead
    assert all(record["seconds"] > 0 for record in clock.records)


def test_settings_the_trainer_row_cannot_reproduce_are_refused_by_name():
    plan = train.make_plan(train.parse_args(["--recipe", "tiny_llama", "--dry-run", "optimizer.name=lion"]))
    with pytest.raises(ConfigError, match="cannot reproduce in the HF Trainer: optimizer.name=lion: DeepSpeed's AdamW"):
        hf_trainer.check_reproducible(plan)
    hf_trainer.check_reproducible(train.make_plan(train.parse_args(["--recipe", "tiny_llama", "--dry-run"])))
