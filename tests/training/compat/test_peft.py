"""Canary of training/compat/peft.py (docs/compat.md)."""
import inspect

import peft.peft_model
from transformers import PreTrainedModel


def test_peft_still_asks_the_deprecated_name():
    assert "is_gradient_checkpointing" in inspect.getsource(peft.peft_model), \
        "peft no longer reads is_gradient_checkpointing: compat/peft.py quiet_gradient_checkpointing_warning can go"
    assert "FutureWarning" in inspect.getsource(PreTrainedModel.is_gradient_checkpointing.fget)
