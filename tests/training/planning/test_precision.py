import pytest
import torch

from training.base.errors import ConfigError
from training.compat.deepspeed.engine_step import FP16BlockGradScaler
from training.planning.precision import device_type, fp16_block, resolve_precision

cpu_only = pytest.mark.skipif(device_type() != "cpu", reason="checks DeepSpeed's CPU accelerator")


@cpu_only
def test_auto_is_fp32_on_a_cpu():
    assert resolve_precision("auto", {"bf16": {"enabled": "auto"}}) == "fp32"


def test_auto_follows_a_config_that_enables_a_half_precision():
    assert resolve_precision("auto", {"bf16": {"enabled": True}}) == "bf16"


@cpu_only
def test_fp16_on_a_cpu_is_refused_with_the_alternatives():
    with pytest.raises(ConfigError, match="precision=fp16 needs an NVIDIA GPU.*Use precision=bf16 or precision=fp32"):
        resolve_precision("fp16", {})


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_explicit_precisions_are_kept(precision):
    assert resolve_precision(precision, {}) == precision


def fp16_block_scaler(**block) -> tuple[FP16BlockGradScaler, torch.nn.Linear, torch.optim.Optimizer]:
    """The ZeRO-0 fp16 scaler on CPU: torch's GradScaler mechanics work on fp32 gradients there too."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    return FP16BlockGradScaler(fp16_block({"fp16": block}), "cpu"), model, torch.optim.SGD(model.parameters(), lr=0.1)


def scaler_step(scaler: FP16BlockGradScaler, model: torch.nn.Linear, optimizer: torch.optim.Optimizer,
                overflow: bool) -> bool:
    """One optimizer step, with an inf gradient when `overflow`; returns whether the weights changed."""
    before = model.weight.detach().clone()
    optimizer.zero_grad()
    scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    if overflow:
        model.weight.grad[0, 0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    return not torch.equal(before, model.weight)


def test_the_scale_follows_the_fp16_blocks_hysteresis_window_and_minimum(one_rank):
    scaler, model, optimizer = fp16_block_scaler(initial_scale_power=4, hysteresis=2, loss_scale_window=2,
                                                 min_loss_scale=4)
    scales, stepped = [scaler.get_scale()], []
    for overflow in (True, True, False, False, False, True, True, True):
        stepped.append(scaler_step(scaler, model, optimizer, overflow))
        scales.append(scaler.get_scale())
    # 16; 1st overflow spends the hysteresis, 2nd halves; 2 clean steps refill it and double; then down to the min
    assert scales == [16, 16, 8, 8, 8, 16, 16, 8, 4]
    assert stepped == [False, False, True, True, True, False, False, False]  # overflowing steps are skipped
    with pytest.raises(Exception, match="loss scale already at minimum"):  # DeepSpeed's own end of such a run
        scaler_step(scaler, model, optimizer, overflow=True)


def test_a_static_loss_scale_never_moves(one_rank):
    scaler, model, optimizer = fp16_block_scaler(loss_scale=128)
    assert not scaler_step(scaler, model, optimizer, overflow=True)
    assert scaler_step(scaler, model, optimizer, overflow=False)
    assert scaler.get_scale() == 128


def scaler_trace(scaler, model, optimizer, overflows) -> list:
    return [(scaler_step(scaler, model, optimizer, o), scaler.get_scale(), scaler.policy.cur_hysteresis)
            for o in overflows]


def test_a_restored_scaler_continues_where_the_saved_one_was(one_rank):
    block = dict(initial_scale_power=6, hysteresis=3, loss_scale_window=3)
    scaler, model, optimizer = fp16_block_scaler(**block)
    scaler_trace(scaler, model, optimizer, [True, False, True, True])
    state = scaler.state_dict()
    assert state["scale"] == 32 and state["deepspeed_loss_scaler"]["cur_hysteresis"] == 1
    restored, fresh = fp16_block_scaler(**block), fp16_block_scaler(**block)
    restored[0].load_state_dict(state)
    later = [False, False, False, True, False]
    continued = scaler_trace(scaler, model, optimizer, later)
    assert scaler_trace(*restored, later) == continued
    assert scaler_trace(*fresh, later) != continued  # what a resume without the saved scale would do


def test_a_bad_fp16_block_names_the_key():
    with pytest.raises(ConfigError, match="fp16 block cannot run: fp16.hysteresis"):
        fp16_block({"fp16": {"hysteresis": "twice"}})
