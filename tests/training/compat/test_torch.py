"""Canaries of training/compat/torch.py: each fails when its workaround is no longer right (docs/compat.md)."""
import pytest
import torch

from training.compat.torch import found_inf, is_fake, plain_optimizer_states, rebuilt_optimizer_states, replace_forward


def test_grad_scaler_reports_found_inf_only_through_a_private_method():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")
    scaler.unscale_(optimizer)
    assert found_inf(scaler, optimizer)
    assert not any(hasattr(scaler, name) for name in ("found_inf", "found_inf_per_device")), \
        "torch's GradScaler has a public found-inf now: read it in compat/torch.py found_inf instead of the private one"


def test_an_instance_forward_replaces_the_class_forward():
    module, seen = torch.nn.Linear(2, 2), []
    module.register_forward_hook(lambda *_: seen.append("hook"))
    replace_forward(module, lambda self, x: x * 3)
    assert torch.equal(module(torch.ones(2)), torch.full((2,), 3.0)) and seen == ["hook"]


def test_a_callable_map_location_cannot_load_a_tensor_subclass(tmp_path):
    from torchao.optim.subclass_8bit import OptimState8bit
    path = tmp_path / "state.pt"
    torch.save({"exp_avg": OptimState8bit.zeros((4096,), signed=True)}, path)
    with pytest.raises(RuntimeError, match="Callable map_location not supported"):
        torch.load(path, map_location=lambda storage, location: storage, weights_only=False)
    saved = plain_optimizer_states({"state": {0: {"exp_avg": OptimState8bit.zeros((4096,), signed=True)}}})
    torch.save(saved, path)
    loaded = rebuilt_optimizer_states(torch.load(path, map_location=lambda storage, location: storage,
                                                 weights_only=False))
    assert type(loaded["state"][0]["exp_avg"]) is OptimState8bit


def test_a_fake_tensors_data_pointer_is_a_warned_zero():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = torch.empty(1000)
    assert is_fake(fake) and not is_fake(torch.empty(1000))
    with pytest.warns(UserWarning, match="Accessing the data pointer of FakeTensor is deprecated"):
        assert fake.untyped_storage().data_ptr() == 0, \
            "a FakeTensor's data pointer is no longer 0: check whether compat is_fake is still needed"
