"""Canaries of training/compat/torch.py: each fails when its workaround is no longer right (docs/compat.md)."""
import torch

from training.compat.torch import found_inf, replace_forward


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
