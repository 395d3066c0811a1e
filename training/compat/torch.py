"""Workarounds of torch behaviour (verified for torch 2.13.0, requirements.txt)."""
import os
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from training.compat import NO_ISSUE, Patch

VERIFIED_FOR = "2.13.0"
PATCHES = (
    Patch("found_inf", "torch", VERIFIED_FOR,
          "GradScaler.step learns whether the unscaled gradients held inf/nan from its private "
          "_found_inf_per_device(optimizer) and says nothing to its caller; FP16BlockGradScaler reads it to feed "
          "DeepSpeed's loss-scale policy", NO_ISSUE,
          "tests/training/compat/test_torch.py::test_grad_scaler_reports_found_inf_only_through_a_private_method",
          proofs=("tests/training/planning/test_precision.py::"
                  "test_the_scale_follows_the_fp16_blocks_hysteresis_window_and_minimum",)),
    Patch("replace_forward", "torch", VERIFIED_FOR,
          "nn.Module.__call__ runs self.forward, looked up on the instance first: a bound function set on one "
          "module replaces its class's forward for that module alone, hooks included (long_context's tiling)",
          NO_ISSUE, "tests/training/compat/test_torch.py::test_an_instance_forward_replaces_the_class_forward",
          proofs=("tests/training/models/test_long_context.py::test_tiles_give_the_models_loss_and_gradients",)),
    Patch("is_fake", "torch", VERIFIED_FOR,
          "torch.compile leaves FakeTensors (shapes without memory) for the garbage collector, and the data pointer "
          "of a FakeTensor's storage reads as 0 with a warning that it will become an error: the census of held "
          "tensors passes them over by their private class, torch._subclasses.fake_tensor.FakeTensor", NO_ISSUE,
          "tests/training/compat/test_torch.py::test_a_fake_tensors_data_pointer_is_a_warned_zero",
          proofs=("tests/training/loop/test_metrics.py::test_the_census_passes_over_compiles_fake_tensors",)),
    Patch("plain_optimizer_states", "torch", VERIFIED_FOR,
          "torch.load with a callable map_location, which DeepSpeed's ZeRO-0 checkpoint reader passes "
          "(state_dict_factory), cannot rebuild a tensor subclass (torchao's 8-bit optimizer states): the "
          "shaped optimizer saves such states as the plain tensors they are made of", NO_ISSUE,
          "tests/training/compat/test_torch.py::test_a_callable_map_location_cannot_load_a_tensor_subclass",
          proofs=("tests/training/loop/test_shaped_optimizer.py::test_a_checkpoint_loads_back_at_every_zero_stage",)),
    Patch("extension_build_root", "torch", VERIFIED_FOR,
          "cpp_extension.load builds an op in <root>/<op>, where the root is TORCH_EXTENSIONS_DIR or "
          "get_default_build_root()/py<version>_<cpu|cu..|rocm..>, a naming only its private _get_build_directory "
          "knows; it waits while <root>/<op>/lock exists (FileBaton.wait, no time limit), and that file outlives "
          "a builder that is killed: op_builds.py names a lock no process holds instead of waiting without end",
          "https://github.com/pytorch/pytorch/issues/189245 (fixed on main by pytorch/pytorch#190543: an OS lock)",
          "tests/training/compat/test_torch.py::test_load_waits_without_limit_on_the_lock_in_the_build_root",
          proofs=("tests/training/parallel/test_op_builds.py::test_train_py_names_a_stale_build_lock_and_exits_2",)),
    Patch("uncompiled", "torch", VERIFIED_FOR,
          "nn.Module.compile keeps the compiled call in the private _compiled_call_impl, which __call__ runs in place "
          "of the module's own; GRPO's compiled decoding compiles the whole model and sets it to None on training's "
          "compiled layers for the duration, so that their graphs are never traced from the decoding graph", NO_ISSUE,
          "tests/training/compat/test_torch.py::test_a_modules_compiled_call_lives_in_a_private_attribute",
          proofs=("tests/training/objectives/grpo/test_sampling.py::"
                  "test_compiled_decoding_never_runs_trainings_compiled_layers",)),
    Patch("compile_cache_counts", "torch", VERIFIED_FOR,
          "torch.compile says how often its FX-graph cache (inductor's code) and AOT-autograd cache (the forward and "
          "backward graphs) were hit or missed only in dynamo's private counters (torch._dynamo.utils.counters, "
          "'inductor' fxgraph_cache_hit/miss/bypass, 'aot_autograd' autograd_cache_hit/miss/bypass): a run's summary "
          "reads them, to say what its compile reused", NO_ISSUE,
          "tests/training/compat/test_torch.py::test_the_compile_caches_count_their_hits_and_misses_in_dynamos_counters",
          proofs=("tests/test_train.py::test_compiled_model_trains_the_same_losses",)),
)


@dataclass(frozen=True)
class FlattenedTensor:
    """A tensor subclass as its plain inner tensors and what rebuilds it (torch's __tensor_flatten__ protocol)."""
    kind: type
    inner: dict[str, torch.Tensor]
    context: object
    size: tuple[int, ...]
    stride: tuple[int, ...]


def plain_optimizer_states(state_dict: dict) -> dict:
    """An optimizer's state_dict with each tensor-subclass state as a FlattenedTensor (a shallow copy)."""
    def plain(value: object) -> object:
        if not (torch.is_tensor(value) and hasattr(value, "__tensor_flatten__")):
            return value
        names, context = value.__tensor_flatten__()
        return FlattenedTensor(type(value), {name: getattr(value, name) for name in names}, context,
                               tuple(value.size()), tuple(value.stride()))
    return {**state_dict, "state": {index: {key: plain(value) for key, value in state.items()}
                                    for index, state in state_dict["state"].items()}}


def rebuilt_optimizer_states(state_dict: dict) -> dict:
    """plain_optimizer_states undone."""
    def rebuilt(value: object) -> object:
        if not isinstance(value, FlattenedTensor):
            return value
        return value.kind.__tensor_unflatten__(value.inner, value.context, value.size, value.stride)
    return {**state_dict, "state": {index: {key: rebuilt(value) for key, value in state.items()}
                                    for index, state in state_dict["state"].items()}}


def is_fake(tensor: torch.Tensor) -> bool:
    """A FakeTensor of torch.compile's tracing: a shape and dtype with no memory behind it."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the scaler's last unscale of the optimizer's gradients found inf or nan."""
    return sum(found.item() for found in scaler._found_inf_per_device(optimizer).values()) > 0


def replace_forward(module: torch.nn.Module, forward: Callable) -> None:
    """Run `forward(module, ...)` as this module's forward pass, in place of its class's."""
    module.forward = types.MethodType(forward, module)


def extension_build_root() -> Path:
    """The folder under which torch's cpp_extension.load builds and caches each JIT-built op, in a folder per op."""
    if root := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root  # 0.16 s to import: only when asked

    version = torch.version
    accelerator = f"rocm{version.hip.replace('.', '')}" if version.hip else \
        f"cu{version.cuda.replace('.', '')}" if version.cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


@contextmanager
def uncompiled(model: torch.nn.Module) -> Iterator[None]:
    """Every module of the model that nn.Module.compile compiled runs its own forward for the duration."""
    compiled = {module: module._compiled_call_impl for module in model.modules()
                if module._compiled_call_impl is not None}
    for module in compiled:
        module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, call in compiled.items():
            module._compiled_call_impl = call


def compile_cache_counts() -> dict[str, int]:
    """This process's hits, misses and bypasses of torch.compile's FX-graph and AOT-autograd caches so far."""
    from torch._dynamo.utils import counters
    outcomes = {"hits": "hit", "misses": "miss", "bypasses": "bypass"}
    return {f"{cache}_{outcome}": counters[group][f"{key}_{name}"]
            for cache, group, key in (("fx_graph", "inductor", "fxgraph_cache"),
                                      ("aot_autograd", "aot_autograd", "autograd_cache"))
            for outcome, name in outcomes.items()}
