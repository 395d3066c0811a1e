import gc

import pytest
import torch

from training.loop.metrics import FlopsMeter, MetricsLogger, held_tensor_bytes, record_model_states


@pytest.mark.slow
def test_model_states_are_measured_when_the_second_step_starts():
    gc.collect()
    before = held_tensor_bytes(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]))["cpu"]  # other tests' tensors
    model = torch.nn.Linear(1000, 1000, bias=False)  # 4 MB of fp32 weights
    optimizer = torch.optim.AdamW(model.parameters())
    measured, steps_done = {}, [0]
    record_model_states(optimizer, lambda: steps_done[0], 1, measured)
    for step in range(3):
        model(torch.randn(4, 1000)).sum().backward()
        optimizer.step()
        steps_done[0] += 1
        if step == 0:
            assert not measured  # AdamW makes its states at the first step
        optimizer.zero_grad()
    weights = 4_000_000
    # weights + gradients + two AdamW moments (+ the step counter and the batch), within 1 MB: the census collects
    # garbage first, and in a pytest worker other threads free or make tensors between the two counts (CI at
    # 4350896: 155 KB fewer), as in test_held_tensors_count_shared_storage_once; a census one state short is 4 MB off
    assert measured["cpu"] - before == pytest.approx(4 * weights, abs=1_000_000)


def test_held_tensors_count_shared_storage_once():
    """An 8 MB storage and three views of it add 8 MB, not 16 or 32. The census counts every tensor of the process,
    and beside other tests other threads free or make tensors between the two counts (CI at 9dfcec1: 100 KB fewer,
    after gc.collect), so the sum is checked to within 1 MB: a view counted twice would add 8 MB more."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])
    gc.collect()
    before = held_tensor_bytes(optimizer)["cpu"]
    big = torch.zeros(2_000_000)
    views = [big[:10], big[5:], big.view(1000, 2000)]  # noqa: F841 (held)
    assert held_tensor_bytes(optimizer)["cpu"] - before == pytest.approx(8_000_000, abs=1_000_000)


def test_the_census_passes_over_compiles_fake_tensors():
    """torch.compile's FakeTensors hold no memory, and all read their storage's data pointer as 0 (which would count
    one of them as a real storage); none is counted, and no warning is raised."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])
    before = held_tensor_bytes(optimizer)["cpu"]
    with FakeTensorMode():
        fakes = [torch.empty(1_000_000), torch.empty(2_000_000)]  # noqa: F841 (held)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert held_tensor_bytes(optimizer)["cpu"] == before


def test_flops_meter():
    meter = FlopsMeter(model_flops_per_step=3e12, hardware_flops_per_step=4e12, peak_tflops=100.0)
    assert meter.metrics(steps=10, seconds=2.0) == {"tflops": 15.0, "hardware_tflops": 20.0, "mfu": 0.15}
    assert "mfu" not in FlopsMeter(3e12, 3e12, None).metrics(1, 1.0)


def test_expert_counts_are_logged_to_metrics_jsonl_and_tensorboard(tmp_path):
    """metrics.jsonl keeps the counts by layer as a list; TensorBoard gets one scalar per layer and expert."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    logger = MetricsLogger(tmp_path, total_steps=1, start_step=0, tensorboard=True, enabled=True)
    logger.log({"step": 1, "loss": 2.0, "expert_tokens": [[3, 5], [8, 0]], "expert_load_max": 2.0, "lr": 1e-3,
                "grad_norm": 1.0, "tokens_per_s": 10.0, "peak_mem_bytes": 0})
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["expert_tokens"] == [[3, 5], [8, 0]]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert ({"experts/layer00/expert01", "experts/layer01/expert00", "train/expert_load_max"}
            <= set(events.Tags()["scalars"]))
    assert events.Scalars("experts/layer01/expert00")[0].value == 8
