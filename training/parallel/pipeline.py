"""Llama-family Hugging Face decoders as a DeepSpeed `PipelineModule`.

The layers are the model's own modules, in order: the token embedding, each decoder layer, the final
norm and the LM head (with `tie_word_embeddings`, the embedding again as a DeepSpeed tied layer, so its
gradients are summed across the first and last stages). Stages pass `(hidden_states, position_ids)`
to each other; each decoder layer computes its rotary embedding and its attention mask from the
position ids, so packed rows keep attention inside each document exactly as in the whole model.

Each rank builds only its own stage's layers and reads only their tensors from the checkpoint's
safetensors files. A model from `model.config` is built whole once per rank from the training seed,
so that it starts from the same weights as the same recipe without pipeline parallelism.
"""
import importlib
import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.engine import PipelineEngine
from huggingface_hub import snapshot_download
from safetensors import safe_open
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from training.base.errors import ConfigError
from training.compat.deepspeed.checkpoint_files import pipeline_layer_file
from training.compat.deepspeed.engine_step import measure_before_model_step, zero0_grad_norm
from training.compat.transformers import attention_implementation, set_attention_implementation
from training.config.families import FAMILIES, family_of

TIED_KEY = "embeddings"


def family_modules(config: PretrainedConfig) -> tuple[type, type, type]:
    """The family's decoder layer, RMSNorm and rotary embedding classes (its pipeline_prefix:
    training/config/families.py)."""
    prefix = family_of(config.model_type).pipeline_prefix
    if prefix is None:
        supported = [model_type for model_type, family in FAMILIES.items() if family.pipeline_prefix]
        raise ConfigError(f"parallelism.pipeline_stages: {config.model_type} models are not supported; pipeline "
                          f"parallelism supports {', '.join(supported)} (Llama-family decoders)")
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    return tuple(getattr(module, f"{prefix}{name}") for name in ("DecoderLayer", "RMSNorm", "RotaryEmbedding"))


def check_pipeline(config: PretrainedConfig, stages: int, zero_stage: int, world_size: int) -> None:
    family_modules(config)
    if world_size % stages:
        raise ConfigError(f"parallelism.pipeline_stages={stages} does not divide the {world_size} rank(s): the world "
                          f"size is data-parallel ranks x pipeline stages")
    if zero_stage > 1:
        raise ConfigError(f"parallelism.pipeline_stages={stages} with ZeRO-{zero_stage}: DeepSpeed's pipeline engine "
                          f"supports ZeRO 0 and 1 only; use deepspeed.config=zero1 (or zero0)")
    if stages > config.num_hidden_layers:
        raise ConfigError(f"parallelism.pipeline_stages={stages} is more than the model's {config.num_hidden_layers} "
                          f"decoder layers; every stage needs at least one")


class EmbeddingPipe(nn.Embedding):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config.vocab_size, config.hidden_size, config.pad_token_id)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, position_ids = inputs
        return super().forward(input_ids), position_ids


def tied_lm_head(embedding: EmbeddingPipe, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden_states, embedding.weight)


class LMHeadPipe(nn.Linear):
    def __init__(self, config: PretrainedConfig):
        super().__init__(config.hidden_size, config.vocab_size, bias=False)


def decoder_layer_pipe(config: PretrainedConfig) -> type:
    """The family's decoder layer, taking and returning (hidden_states, position_ids); its parameter
    names are the Hugging Face layer's own."""
    layer_class, _, rotary_class = family_modules(config)

    class DecoderLayerPipe(layer_class):
        def __init__(self, config: PretrainedConfig, layer_idx: int):
            super().__init__(config, layer_idx)
            self.pipe_config, self.rotary = config, rotary_class(config)  # the rotary embedding has no parameters
            layer_types = getattr(config, "layer_types", None)
            sliding = (layer_types[layer_idx] == "sliding_attention" if layer_types
                       else family_of(config.model_type).sliding_window and config.sliding_window is not None)
            self.make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask

        def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            hidden_states, position_ids = inputs
            mask = self.make_mask(config=self.pipe_config, inputs_embeds=hidden_states, attention_mask=None,
                                  past_key_values=None, position_ids=position_ids)
            hidden_states = super().forward(hidden_states, attention_mask=mask, position_ids=position_ids,
                                            position_embeddings=self.rotary(hidden_states, position_ids))
            return hidden_states, position_ids

    return DecoderLayerPipe


def final_norm_pipe(config: PretrainedConfig) -> type:
    _, norm_class, _ = family_modules(config)

    class FinalNormPipe(norm_class):
        def __init__(self, config: PretrainedConfig):
            super().__init__(config.hidden_size, eps=config.rms_norm_eps)

        def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return super().forward(inputs[0])

    return FinalNormPipe


class TokenMeanLoss:
    """Summed token loss over `targets_per_micro_batch`, which train.py sets before each step so that the
    step's loss is the mean over every target token of the global batch."""

    def __init__(self):
        self.targets_per_micro_batch = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        summed = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                 ignore_index=-100, reduction="sum")
        return summed / self.targets_per_micro_batch


def pipeline_batches(micro_batches: list[dict]) -> Iterator[tuple]:
    """Micro-batches as the pipeline engine takes them: (first stage's inputs, last stage's labels)."""
    return iter([((batch["input_ids"], batch["position_ids"]), batch["labels"]) for batch in micro_batches])


def layer_specs(config: PretrainedConfig) -> list[LayerSpec]:
    decoder, norm = decoder_layer_pipe(config), final_norm_pipe(config)
    if config.tie_word_embeddings:
        first = TiedLayerSpec(TIED_KEY, EmbeddingPipe, config, tied_weight_attr="weight")
        last = TiedLayerSpec(TIED_KEY, EmbeddingPipe, config, forward_fn=tied_lm_head, tied_weight_attr="weight")
    else:
        first, last = LayerSpec(EmbeddingPipe, config), LayerSpec(LMHeadPipe, config)
    return [first, *(LayerSpec(decoder, config, i) for i in range(config.num_hidden_layers)), LayerSpec(norm, config),
            last]


def layer_files(config: PretrainedConfig) -> list[str]:
    """The files DeepSpeed's PipelineModule writes into a checkpoint (compat/deepspeed/checkpoint_files.py): one per
    layer of layer_specs, in order (the embedding, the decoder layers, the final norm, the LM head), but none for a
    head tied to the embedding (its weight is the embedding's file)."""
    layers = len(layer_specs(config)) - (1 if config.tie_word_embeddings else 0)
    return [pipeline_layer_file(index) for index in range(layers)]


def hf_name(layer: int, name: str, config: PretrainedConfig) -> str:
    """The Hugging Face name of parameter `name` of pipeline layer `layer`."""
    if layer == 0:
        return f"model.embed_tokens.{name}"
    if layer <= config.num_hidden_layers:
        return f"model.layers.{layer - 1}.{name}"
    if layer == config.num_hidden_layers + 1:
        return f"model.norm.{name}"
    return f"model.embed_tokens.{name}" if config.tie_word_embeddings else f"lm_head.{name}"


def pipeline_to_hf_name(name: str, config: PretrainedConfig) -> str:
    """`PipelineModule` names its layers by their index ("3.self_attn.q_proj.weight") and its tied
    modules by key ("tied_modules.embeddings.weight")."""
    if name.startswith(f"tied_modules.{TIED_KEY}."):
        return f"model.embed_tokens.{name.removeprefix(f'tied_modules.{TIED_KEY}.')}"
    layer, _, rest = name.partition(".")
    return hf_name(int(layer), rest, config)


def build_pipeline(config: PretrainedConfig, stages: int, partition_method: str, activation_checkpointing: bool,
                   loss: TokenMeanLoss, name_or_path: str | None, seed: int,
                   attn_implementation: str = "sdpa") -> PipelineModule:
    """fp32 layers of this rank's stage, with the checkpoint's weights (or the seeded model's); DeepSpeed
    casts them to bf16/fp16 where the precision asks for it."""
    set_attention_implementation(config, attn_implementation)
    module = PipelineModule(layer_specs(config), num_stages=stages, loss_fn=loss, partition_method=partition_method,
                            activation_checkpoint_interval=1 if activation_checkpointing else 0,
                            activation_checkpoint_func=partial(checkpoint, use_reentrant=False),
                            checkpointable_layers=["DecoderLayerPipe"])
    weights = CheckpointTensors(name_or_path) if name_or_path else from_config_weights(config, seed)
    with torch.no_grad():
        for name, tensor in module.state_dict(keep_vars=True).items():
            tensor.copy_(weights[pipeline_to_hf_name(name, config)])
    return module


def from_config_weights(config: PretrainedConfig, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                            attn_implementation=attention_implementation(config)).state_dict()


class CheckpointTensors:
    """Tensors of a safetensors checkpoint (single file or sharded) by name, each read on demand."""

    def __init__(self, name_or_path: str):
        folder = Path(name_or_path) if Path(name_or_path).is_dir() else Path(
            snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.json"]))
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            self.files = {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        elif (folder / "model.safetensors").is_file():
            with safe_open(folder / "model.safetensors", "pt") as f:
                self.files = dict.fromkeys(f.keys(), folder / "model.safetensors")
        else:
            raise ConfigError(f"{folder}: pipeline parallelism loads safetensors checkpoints; found none")

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(self.files[name], "pt") as f:
            return f.get_tensor(name)


def report_grad_norm(engine: PipelineEngine, withhold_nonfinite: bool) -> None:
    """Without ZeRO, DeepSpeed's pipeline engine reports no gradient norm: its clipping computes one and drops
    it. So it is computed where the engine steps: after the gradients are reduced over the data-parallel
    ranks, before any clipping or unscaling, over each stage's own parameters (a tied embedding once), summed
    over the stages of a replica. With `withhold_nonfinite` (the stability guard, training/loop/stability.py), a
    norm that is not finite withholds the step on every rank, as DeepSpeed's ZeRO optimizers do on their own."""
    group = engine.mpu.get_model_parallel_group()  # the stages of this replica
    measure_before_model_step(engine, lambda: zero0_grad_norm(engine, group), withhold_nonfinite)
