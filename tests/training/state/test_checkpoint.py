import sys

import deepspeed
import torch

from training.compat.deepspeed.engine_step import FP16BlockGradScaler
from training.compat.deepspeed.universal import provide_universal_info
from training.planning.layout import Layout
from training.planning.precision import fp16_block
from training.state.checkpoint import load_checkpoint, save_checkpoint
from training.state.run_state import RunState

RUN_STATE = {"step": 4, "tokens_seen": 64, "world_size": 1, "zero_stage": 0, "precision": "fp16"}


def linear_engine(zero_stage: int, model: torch.nn.Module | None = None, **config) -> deepspeed.DeepSpeedEngine:
    """A one-rank engine of a seeded 4x4 linear layer (or `model`) under AdamW, with `config` added."""
    torch.manual_seed(0)
    model = model or torch.nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": zero_stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}}, **config}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def engine_with_fp16_block_scaler() -> deepspeed.DeepSpeedEngine:
    """A ZeRO-0 engine carrying the fp16 scaler that train.py installs there (CPU computes in fp32, but the
    scaler's state and its way through the checkpoint are the same)."""
    fp16 = {"fp16": {"initial_scale_power": 10, "hysteresis": 1, "loss_scale_window": 100}}
    engine = linear_engine(0, **fp16)
    engine.torch_autocast_z0_gradscaler = FP16BlockGradScaler(fp16_block(fp16), "cpu")
    return engine


def test_the_zero0_fp16_loss_scale_survives_save_and_resume(one_rank, tmp_path):
    engine = engine_with_fp16_block_scaler()
    scaler = engine.torch_autocast_z0_gradscaler
    for overflow in (True, False, True):  # two overflows: 1024 -> 256, with the policy's counters moved
        engine.zero_grad()
        scaler.scale(engine.module(torch.ones(1, 4)).sum()).backward()
        if overflow:
            engine.module.weight.grad[0, 0] = float("inf")
        scaler.step(engine.optimizer)
        scaler.update()
    saved = scaler.state_dict()
    assert saved["scale"] == 256
    save_checkpoint(engine, tmp_path, RunState.written(**RUN_STATE), {"position": 3}, hf_files=(), keep_last=None)

    resumed = engine_with_fp16_block_scaler()
    assert resumed.torch_autocast_z0_gradscaler.get_scale() == 1024
    run_state, data_state = load_checkpoint(resumed, tmp_path, layout=Layout(
        **{key: value for key, value in RUN_STATE.items() if key not in ("step", "tokens_seen")}))
    assert run_state.model_dump().items() >= RUN_STATE.items() and data_state == {"position": 3}
    assert resumed.torch_autocast_z0_gradscaler.state_dict() == saved


def test_a_zero0_checkpoint_loads_as_it_is_in_another_zero0_layout(one_rank, tmp_path):
    """ZeRO-0 holds the whole weights and optimizer state: another world size or precision at ZeRO-0 loads them as
    they are (needs_universal), never through a universal conversion, which ZeRO-0 checkpoints do not have."""
    engine = engine_with_fp16_block_scaler()
    wrote = {**RUN_STATE, "world_size": 2}
    save_checkpoint(engine, tmp_path, RunState.written(**wrote), {"position": 3}, hf_files=(), keep_last=None)
    tag = tmp_path / "global_step4"
    (tag / "rank_state1.pt").write_bytes((tag / "rank_state0.pt").read_bytes())
    run_state, data_state = load_checkpoint(engine_with_fp16_block_scaler(), tmp_path, layout=Layout(
        world_size=1, zero_stage=0, precision="bf16"))
    assert run_state.world_size == 2 and data_state == {"position": 3}


def test_a_run_resumed_through_a_universal_conversion_loads_its_own_checkpoints(one_rank, tmp_path):
    """Such a run's DeepSpeed config has checkpoint.load_universal on (with_universal_load); a rewind to a checkpoint
    it saved since, in its own layout, loads that checkpoint as it is (compat loading_universal)."""
    engine = linear_engine(1, checkpoint={"load_universal": True})
    model = engine.module
    wrote = {**RUN_STATE, "zero_stage": 1, "precision": "fp32"}
    save_checkpoint(engine, tmp_path, RunState.written(**wrote), {"position": 3}, hf_files=(), keep_last=None)
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    run_state, data_state = load_checkpoint(engine, tmp_path, layout=Layout(world_size=1, zero_stage=1,
                                                                           precision="fp32"))
    assert run_state.step == 4 and data_state == {"position": 3}
    assert torch.equal(engine.module.weight, saved) and engine._config.load_universal_checkpoint


def test_a_checkpoint_of_a_model_with_universal_info_converts_without_injected_state(one_rank, tmp_path, monkeypatch):
    """DeepSpeed's converter, as a user runs it (no --inject_missing_state), needs the entry that compat
    provide_universal_info gives every model train.py builds."""
    from deepspeed.checkpoint import ds_to_universal
    model = torch.nn.Linear(4, 4)
    provide_universal_info(model)
    engine = linear_engine(1, model)
    engine.save_checkpoint(str(tmp_path), tag="global_step1")
    monkeypatch.setattr(sys, "argv", ["ds_to_universal", "--input_folder", str(tmp_path / "global_step1"),
                                      "--output_folder", str(tmp_path / "universal"), "--num_extract_workers", "1",
                                      "--num_merge_workers", "1"])
    ds_to_universal.main(ds_to_universal.parse_arguments())
    assert (tmp_path / "universal" / "zero" / "weight" / "fp32.pt").is_file()
