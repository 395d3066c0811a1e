"""run_state.json is written as the RunState it is read as: a key the writer misspells is an error at the writer (a
reader ignores keys it does not know), and the trainer writes the keys it wrote when it built a plain dict."""
import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from training.planning.layout import Layout
from training.state.run_state import RunState
from training.trainer import Loop

LAYOUT = Layout(world_size=2, zero_stage=1, precision="bf16")
WHERE = {"step": 4, "tokens_seen": 64}
KEYS = {"step", "tokens_seen", "data_position", "recipe", "trackers", "micro_batch_size", "objective",
        *Layout.model_fields}  # what the trainer's dict held, a fine-tune's base_model aside


def test_a_misspelt_field_at_the_writer_is_an_error():
    with pytest.raises(ValidationError, match="trackrs\n  Extra inputs are not permitted"):
        RunState.written(**WHERE, **LAYOUT.model_dump(), trackrs={"wandb": "run-1"})
    assert RunState.model_validate({**WHERE, **LAYOUT.model_dump(), "trackrs": {}}).trackers == {}  # what a reader does


def loop_at(step: int, base: str | None) -> SimpleNamespace:
    """What Loop.run_state reads of a loop: its plan, where it is, its trackers and its objective."""
    recipe = SimpleNamespace(name="tiny_llama", model=SimpleNamespace(name_or_path=base),
                             training=SimpleNamespace(micro_batch_size=2))
    plan = SimpleNamespace(recipe=recipe, layout=lambda: LAYOUT, base_digest="0123abcd" if base else None)
    state = RunState(step=step, tokens_seen=64, data_position=step + 3, **LAYOUT.model_dump())
    objective = SimpleNamespace(state_dict=lambda: {"entropy_coef": 0.1, "last_world_entropy": None})
    trackers = SimpleNamespace(ids={"wandb": "run-1"})
    return SimpleNamespace(plan=plan, state=state, trackers=trackers, objective=objective)


@pytest.mark.parametrize("base, keys", [(None, KEYS), ("models/base", KEYS | {"base_model"})],
                         ids=["pretraining", "fine-tune"])
def test_the_trainer_writes_the_keys_a_resume_reads(base, keys):
    written = Loop.run_state(loop_at(4, base))
    found = json.loads(written.file_text())
    assert found.keys() == keys
    assert (found["step"], found["data_position"], found["trackers"]) == (4, 7, {"wandb": "run-1"})
    assert found.get("base_model", {"digest": None})["digest"] == ("0123abcd" if base else None)
    assert RunState.model_validate(found) == written
