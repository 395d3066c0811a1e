"""Canaries of training/compat/torch.py: each fails when its workaround is no longer right (docs/compat.md)."""
import inspect
from pathlib import Path

import pytest
import torch

from training.compat.torch import (
    compile_cache_counts,
    extension_build_root,
    found_inf,
    is_fake,
    plain_optimizer_states,
    rebuilt_optimizer_states,
    replace_forward,
    uncompiled,
)


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


def test_a_modules_compiled_call_lives_in_a_private_attribute():
    """nn.Module.compile's call is _compiled_call_impl, run in place of the module's own while set: `uncompiled` sets
    it aside for its duration and puts it back."""
    class Sine(torch.nn.Module):  # dynamo traces a module of ours, not one of torch.nn's own files
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sin() + 1
    inner, calls = Sine(), []
    outer = torch.nn.Sequential(inner)

    def backend(graph, inputs):
        calls.append(graph)
        return graph.forward
    inner.compile(backend=backend)
    assert inner._compiled_call_impl is not None and outer._compiled_call_impl is None
    with uncompiled(outer):
        assert inner._compiled_call_impl is None
        outer(torch.ones(2))
    assert not calls and inner._compiled_call_impl is not None
    outer(torch.ones(2))
    assert len(calls) == 1


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


@pytest.mark.parametrize("extensions_dir", [None, "mine"])
def test_the_build_root_is_where_load_builds_an_op(extensions_dir, tmp_path, monkeypatch):
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path / "default"))
    if extensions_dir:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / extensions_dir))
    else:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert Path(cpp_extension._get_build_directory("some_op", False)) == extension_build_root() / "some_op"


def test_load_waits_without_limit_on_the_lock_in_the_build_root(tmp_path, monkeypatch):
    """The upstream behaviour op_builds.py is for: cpp_extension.load waits on `<root>/<op>/lock` with torch's
    FileBaton, which has no time limit. Fails once torch takes an OS lock (pytorch/pytorch#190543) or a limit."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "canary_op").mkdir()
    (tmp_path / "canary_op" / "lock").touch()
    source = tmp_path / "canary.cpp"
    source.write_text("not C++: a build would fail at once\n")
    waited = []

    def wait(baton):
        waited.append(baton)
        raise InterruptedError
    monkeypatch.setattr(FileBaton, "wait", wait)
    with pytest.raises(InterruptedError):
        cpp_extension.load("canary_op", [str(source)])
    assert Path(waited[0].lock_file_path) == extension_build_root() / "canary_op" / "lock"
    assert waited[0].warn_after_seconds is None
    assert set(inspect.signature(FileBaton.__init__).parameters) == \
        {"self", "lock_file_path", "wait_seconds", "warn_after_seconds"}, "FileBaton has a time limit now"


@pytest.mark.slow  # inductor's first compile in a process takes about 3 s, though a matmul needs no C++ of its own
def test_the_compile_caches_count_their_hits_and_misses_in_dynamos_counters(tmp_path, monkeypatch):
    """A matmul and its gradient compiled twice (dynamo reset between, as in a new process): the first compile misses
    both caches and fills them, the second finds both graphs there."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._dynamo.utils import counters
    a, b = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)
    seen = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        torch.compile(lambda x, y: x @ y)(a, b).sum().backward()
        seen.append(compile_cache_counts())
    torch._dynamo.reset()
    cold, warm = seen
    assert cold["fx_graph_misses"] > 0 and cold["aot_autograd_misses"] == 1 and cold["fx_graph_hits"] == 0, cold
    assert warm["fx_graph_misses"] == warm["aot_autograd_misses"] == 0 and warm["aot_autograd_hits"] == 1, warm
    assert warm["fx_graph_hits"] == cold["fx_graph_misses"], warm
