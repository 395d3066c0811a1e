import deepspeed
import torch

from training.checkpoint import load_checkpoint, save_checkpoint
from training.precision import FP16BlockGradScaler

RUN_STATE = {"step": 4, "tokens_seen": 64, "world_size": 1, "zero_stage": 0, "precision": "fp16"}


def engine_with_fp16_block_scaler() -> deepspeed.DeepSpeedEngine:
    """A ZeRO-0 engine carrying the fp16 scaler that train.py installs there (CPU computes in fp32, but the
    scaler's state and its way through the checkpoint are the same)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}},
              "fp16": {"initial_scale_power": 10, "hysteresis": 1, "loss_scale_window": 100}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.torch_autocast_z0_gradscaler = FP16BlockGradScaler(config, "cpu")
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
    save_checkpoint(engine, tmp_path, RUN_STATE, {"position": 3}, hf_files=(), keep_last=None)

    resumed = engine_with_fp16_block_scaler()
    assert resumed.torch_autocast_z0_gradscaler.get_scale() == 1024
    run_state, data_state = load_checkpoint(resumed, tmp_path, layout={
        **{key: value for key, value in RUN_STATE.items() if key not in ("step", "tokens_seen")},
        "pipeline_stages": 1, "tensor_parallel": 1, "sequence_parallel": 1, "optimizer": "adamw", "lora": False})
    assert run_state.items() >= RUN_STATE.items() and data_state == {"position": 3}
    assert resumed.torch_autocast_z0_gradscaler.state_dict() == saved
