"""Which resumes go through a universal checkpoint, and which cannot be made (the conversions themselves run
in tests/test_resume_anywhere.py)."""
import json

import pytest

from training.base.errors import ConfigError
from training.planning.layout import Layout
from training.state.run_state import RunState
from training.state.universal import needs_universal

WROTE = {"step": 6, "tokens_seen": 100, "world_size": 2, "zero_stage": 2, "precision": "fp32", "pipeline_stages": 1}
HINT = "python -m training export X DIR"


def layout(**changes) -> Layout:
    return Layout(**{"world_size": 2, "zero_stage": 2, "precision": "fp32", "pipeline_stages": 1, "tensor_parallel": 1,
                     "sequence_parallel": 1, "optimizer": "adamw", "lora": False, **changes})


def written(run_state: dict) -> Layout:
    """The layout a checkpoint's run_state.json records, as a resume reads it."""
    return RunState.model_validate(run_state).layout()


@pytest.mark.parametrize("changes, universal", [
    ({}, False),
    ({"sequence_parallel": 2}, True),
    ({"world_size": 1}, True),
    ({"zero_stage": 3}, True),
    ({"zero_stage": 1, "world_size": 4}, True),
    ({"precision": "bf16"}, True),
])
def test_another_layout_resumes_through_a_universal_checkpoint(changes, universal):
    assert needs_universal(written(WROTE), layout(**changes), streaming=False, export_hint=HINT) is universal


def test_zero_0_resumes_as_it_is_on_any_ranks_and_precision():
    wrote = {**WROTE, "zero_stage": 0}
    assert needs_universal(written(wrote), layout(zero_stage=0, world_size=4, precision="bf16"), False, HINT) is False


@pytest.mark.parametrize("key", ["pipeline_stages", "tensor_parallel", "sequence_parallel", "optimizer", "lora"])
def test_run_states_older_than_a_key_count_as_its_default(key):
    wrote = {name: value for name, value in WROTE.items() if name != key}
    assert needs_universal(written(wrote), layout(), False, HINT) is False


@pytest.mark.parametrize("wrote, changes, message", [
    ({"zero_stage": 0}, {"zero_stage": 3}, "zero_stage 0 -> 3.*universal checkpoints connect ZeRO stages 1, 2 and 3"),
    ({}, {"zero_stage": 0}, "zero_stage 2 -> 0.*Resume at ZeRO-0 \\(on any number of ranks\\)"),
    ({"pipeline_stages": 2}, {"world_size": 4, "pipeline_stages": 2}, "a pipeline checkpoint keeps each layer"),
    ({"tensor_parallel": 2}, {"world_size": 4, "tensor_parallel": 2}, "a tensor-parallel checkpoint holds each rank's"),
    ({}, {"tensor_parallel": 2}, "tensor_parallel 1 -> 2.*resume in the layout that wrote it"),
    ({}, {"pipeline_stages": 2}, "pipeline_stages 1 -> 2.*Megatron's layer layout"),
    ({}, {"optimizer": "lion"},
     "optimizer adamw -> lion.*holds adamw's optimizer states; resume with optimizer.name=adamw"),
    ({"optimizer": "muon"}, {"optimizer": "muon", "world_size": 1}, "proven here with AdamW's moments, not muon's"),
    ({"optimizer": "adafactor"}, {"optimizer": "adafactor", "zero_stage": 3}, "adafactor keeps its states for the "
     "part of each weight a rank holds, as a row and a column per matrix.*resume in the layout that wrote"),
    ({"optimizer": "adamw8bit"}, {"optimizer": "adamw8bit", "world_size": 4}, "in 8-bit blocks"),
    ({"sequence_parallel": 2}, {"tensor_parallel": 2}, "sequence_parallel 2 -> 1.*a tensor-parallel checkpoint"),
])
def test_what_cannot_be_converted_is_refused_with_the_way_out(wrote, changes, message):
    with pytest.raises(ConfigError, match=message) as error:
        needs_universal(written({**WROTE, **wrote}), layout(**changes), streaming=False, export_hint=HINT)
    assert HINT in str(error.value)


def test_a_stream_cannot_move_to_another_number_of_ranks():
    with pytest.raises(ConfigError, match="world_size 2 -> 1.*data.streaming.*resume with 2 rank"):
        needs_universal(written(WROTE), layout(world_size=1), streaming=True, export_hint=HINT)
    assert needs_universal(written(WROTE), layout(zero_stage=3), streaming=True, export_hint=HINT) is True


def test_the_converter_is_not_started_on_a_memory_lean_optimizers_checkpoint(tmp_path, capsys):
    from training.__main__ import main
    tag = tmp_path / "checkpoints" / "global_step4"
    tag.mkdir(parents=True)
    (tag / "run_state.json").write_text(json.dumps({**WROTE, "optimizer": "adafactor"}))
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert main(["convert", str(tag)]) == 2
    assert f"{tag}: adafactor keeps its states" in capsys.readouterr().err
    assert not (tmp_path / "checkpoints" / "universal").exists()


@pytest.mark.slow
def test_a_checkpoint_the_converter_cannot_read_exits_2_and_leaves_nothing(tmp_path, capsys):
    from training.__main__ import main
    tag = tmp_path / "checkpoints" / "global_step4"
    tag.mkdir(parents=True)
    (tag / "run_state.json").write_text('{"step": 4}')
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"truncated by a full disk")
    assert main(["convert", str(tag)]) == 2
    error = capsys.readouterr().err
    assert f"DeepSpeed's universal converter could not convert {tag}" in error
    assert f"python -m training export {tag} DIR" in error
    assert not list((tmp_path / "checkpoints").rglob("*partial*"))


def test_pipeline_and_zero_0_checkpoints_are_refused_by_name(tmp_path, capsys):
    from training.__main__ import main
    for name, problem in (("layer_00-model_states.pt", "is a pipeline checkpoint"),
                          ("mp_rank_00_model_states.pt", "holds no ZeRO optimizer partitions")):
        tag = tmp_path / name / "global_step4"
        tag.mkdir(parents=True)
        (tag / "run_state.json").write_text('{"step": 4}')
        (tag / name).write_bytes(b"weights")
        assert main(["convert", str(tag)]) == 2
        assert problem in capsys.readouterr().err
