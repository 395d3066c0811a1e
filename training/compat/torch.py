"""Workarounds of torch behaviour (verified for torch 2.13.0, requirements.txt)."""
import types
from collections.abc import Callable

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
)


def found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the scaler's last unscale of the optimizer's gradients found inf or nan."""
    return sum(found.item() for found in scaler._found_inf_per_device(optimizer).values()) > 0


def replace_forward(module: torch.nn.Module, forward: Callable) -> None:
    """Run `forward(module, ...)` as this module's forward pass, in place of its class's."""
    module.forward = types.MethodType(forward, module)
