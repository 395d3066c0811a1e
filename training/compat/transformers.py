"""Workarounds of transformers behaviour (verified for transformers 5.23.0, requirements.txt)."""
from collections.abc import Callable

from transformers import CompileConfig, PretrainedConfig, PreTrainedModel

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
    Patch("compiled_decoding", "transformers", VERIFIED_FOR,
          "generate compiles its decoding passes on a static KV cache only on cuda, xpu, neuron and tpu devices, "
          "unless the CompileConfig's private _compile_all_devices is set (_valid_auto_compile_criteria): "
          "grpo.generation_engine=compiled sets it, so that the engine runs, and is proven, on a CPU too", NO_ISSUE,
          "tests/training/compat/test_transformers.py::test_generate_compiles_on_a_cpu_only_when_told_to",
          proofs=("tests/training/objectives/grpo/test_sampling.py::"
                  "test_each_in_process_engine_samples_generates_completions",)),
)


def attention_implementation(config: PretrainedConfig) -> str:
    return config._attn_implementation


def set_attention_implementation(config: PretrainedConfig, name: str) -> None:
    """What from_pretrained would set: the layers (and the causal masks) read it from the config."""
    config._attn_implementation = name


def set_checkpointing_function(model: PreTrainedModel, checkpoint: Callable) -> None:
    """Activation checkpointing on, every layer recomputed through `checkpoint(function, *args, **kwargs)`."""
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint)


def compiled_decoding(device_type: str) -> CompileConfig:
    """generate's compile settings for its decoding passes on this device: static shapes (a graph per batch and KV
    cache length), and CUDA graphs on a GPU (torch.compile's reduce-overhead mode), on any device."""
    mode = "reduce-overhead" if device_type == "cuda" else "default"
    config = CompileConfig(fullgraph=False, dynamic=False, mode=mode)
    config._compile_all_devices = True
    return config
