"""Workarounds of peft behaviour (verified for peft 0.21.2, requirements.txt)."""
import warnings

from training.compat import NO_ISSUE, Patch

VERIFIED_FOR = "0.21.2"
PATCHES = (
    Patch("quiet_gradient_checkpointing_warning", "peft", VERIFIED_FOR,
          "get_peft_model reads model.is_gradient_checkpointing, which transformers 5 deprecated: a FutureWarning "
          "on every rank, for nothing", NO_ISSUE,
          "tests/training/compat/test_peft.py::test_peft_still_asks_the_deprecated_name",
          proofs=("tests/training/models/test_lora.py::"
                  "test_adapters_on_a_checkpointed_model_warn_nothing_on_every_rank",)),
)


def quiet_gradient_checkpointing_warning() -> None:
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
