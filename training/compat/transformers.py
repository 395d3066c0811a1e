"""Workarounds of transformers behaviour (verified for transformers 5.23.0, requirements.txt)."""
from collections.abc import Callable

from transformers import PretrainedConfig, PreTrainedModel

from training.compat import NO_ISSUE, Patch

VERIFIED_FOR = "5.23.0"
PATCHES = (
    Patch("attention_implementation", "transformers", VERIFIED_FOR,
          "the attention a model runs is the config's private _attn_implementation, set by from_pretrained and "
          "from_config; a config built by hand (the pipeline's stages) gets it set here, and sequence parallelism "
          "reads it to wrap that attention", NO_ISSUE,
          "tests/training/compat/test_transformers.py::test_the_attention_implementation_lives_on_the_config",
          proofs=("tests/test_parallelism.py::"
                  "test_a_packed_row_keeps_its_documents_apart",
                  "tests/test_train_pipeline.py::"
                  "test_each_family_as_a_pipeline_gives_the_models_loss")),
    Patch("set_checkpointing_function", "transformers", VERIFIED_FOR,
          "activation checkpointing with a caller's checkpoint function goes through the private "
          "PreTrainedModel._set_gradient_checkpointing; the public activation_checkpointing_enable(offload=True) "
          "asks for pinned memory, which torch refuses on CPU-only machines", NO_ISSUE,
          "tests/training/compat/test_transformers.py::test_the_checkpoint_function_reaches_every_layer",
          proofs=("tests/training/models/test_long_context.py::"
                  "test_offloaded_checkpoints_hold_each_layers_input_in_host_memory",)),
)


def attention_implementation(config: PretrainedConfig) -> str:
    return config._attn_implementation


def set_attention_implementation(config: PretrainedConfig, name: str) -> None:
    """What from_pretrained would set: the layers (and the causal masks) read it from the config."""
    config._attn_implementation = name


def set_checkpointing_function(model: PreTrainedModel, checkpoint: Callable) -> None:
    """Activation checkpointing on, every layer recomputed through `checkpoint(function, *args, **kwargs)`."""
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint)
