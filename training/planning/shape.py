"""The numbers of a model's architecture that FLOPs and memory estimates need, read from a model built on the
meta device (no memory, no weights), so a 7B recipe is measured exactly on a laptop."""
from dataclasses import dataclass, replace

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, PretrainedConfig

from training.base.errors import ConfigError
from training.compat.deepspeed.zero import weight_shape
from training.config.sections import LoraSection


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    parameters: int  # every parameter once (a tied head is the embedding)
    embedding_parameters: int
    lookup_parameters: int  # every embedding table (token, and position where the model learns one)
    head_parameters: int  # the LM head's own weights: 0 when tied to the embedding
    layer_parameters: tuple[int, ...]  # per decoder layer
    layer_matrix_parameters: int  # the decoder layers' 2-D weights (what Muon updates)
    final_norm_parameters: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    lora_parameters: int | None = None  # a LoRA run's trained parameters (adapters, modules_to_save); None: all train
    num_experts: int = 0  # mixture of experts: experts per MoE layer (0: a dense model)
    experts_per_token: int = 0  # the router's top-k
    expert_intermediate_size: int = 0
    expert_parameters: int = 0  # every expert's weights, all layers
    trained_shapes: tuple[tuple[tuple[int, ...], ...], ...] = ()  # per weight_decay_groups group, what it trains

    @property
    def inactive_expert_parameters(self) -> int:
        """The experts' weights that one token does not multiply with: all but its top-k of each layer."""
        return self.expert_parameters * (self.num_experts - self.experts_per_token) // self.num_experts \
            if self.num_experts else 0

    @property
    def q_dim(self) -> int:
        """Width of the attention's queries (and, for these estimates, of its output)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def matmul_parameters(self) -> int:
        """Parameters a token multiplies with: all but the embedding tables (lookups) and, in a mixture of experts,
        the experts the router does not pick for it (the active parameters); a head tied to the token embedding
        multiplies with it."""
        return (self.parameters - self.lookup_parameters + (0 if self.head_parameters else self.embedding_parameters)
                - self.inactive_expert_parameters)

    @property
    def pipeline_layer_parameters(self) -> list[int]:
        """Parameters of each pipeline layer (training/parallel/pipeline.py): embedding, decoder layers, final norm and
        LM head (a tied head holds the embedding again, on the last stage)."""
        return [self.embedding_parameters, *self.layer_parameters, self.final_norm_parameters,
                self.head_parameters or self.embedding_parameters]


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay on matrices; none on biases, norm weights (1-D) and embeddings (tied ones included). Shapes are the
    weights' whole ones: a ZeRO-3 parameter itself is empty (1-D) once partitioned."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if len(weight_shape(param)) < 2 or id(param) in embeddings else decay).append(param)
    # named: DeepSpeed splits each named group into its expert and non-expert parameters under expert parallelism
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.base_model.layers if hasattr(model.base_model, "layers") else model.base_model.h  # GPT-2: h


def model_shape(config: PretrainedConfig, lora: LoraSection | None = None) -> ModelShape:
    """The shape of the model `config` builds; with lora (enabled), also the parameters its adapters train."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is embedding.weight
    layers = decoder_layers(model)
    final_norm = getattr(model.base_model, "norm", None) or getattr(model.base_model, "ln_f")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    shape = ModelShape(
        model_type=config.model_type, parameters=count(model), embedding_parameters=count(embedding),
        lookup_parameters=sum(count(m) for m in model.modules() if isinstance(m, torch.nn.Embedding)),
        head_parameters=0 if tied else count(head), layer_parameters=tuple(count(layer) for layer in layers),
        layer_matrix_parameters=sum(p.numel() for p in layers.parameters() if p.ndim >= 2),
        final_norm_parameters=count(final_norm), hidden_size=config.hidden_size,
        intermediate_size=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
        or 4 * config.hidden_size,
        num_layers=len(layers), num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim, vocab_size=config.vocab_size, **expert_shape(model, config))
    if lora and lora.enabled:  # last: peft adds the adapters to this very model
        shape = replace(shape, lora_parameters=adapted_parameters(model, lora))
    return replace(shape, trained_shapes=tuple(tuple(tuple(p.shape) for p in group["params"])
                                               for group in weight_decay_groups(model, 0.0)))


def expert_shape(model: torch.nn.Module, config: PretrainedConfig) -> dict:
    """A mixture of experts' numbers (transformers 5 keeps each layer's experts as 3-D weights of one `...Experts`
    module, e.g. MixtralExperts, Qwen3MoeExperts); nothing for a dense model."""
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    if not experts:
        return {}
    return {"num_experts": expert_count(config),
            "experts_per_token": config.num_experts_per_tok,
            "expert_intermediate_size": getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
            "expert_parameters": sum(count(m) for m in experts)}


def head_counts(config: PretrainedConfig) -> tuple[int, int]:
    """Query heads and key/value heads (as many as the queries' without grouped-query attention)."""
    text = config.get_text_config()
    return text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads


def rank_groups_problem(world_size: int, size: int, kind: str) -> list[str]:
    """Why `world_size` ranks cannot form groups of `size` for `kind` parallelism, if they cannot."""
    if world_size % size == 0:
        return []
    return [f"{world_size} rank(s) do not form groups of {size}: launch a multiple of {size} ranks (world size = "
            f"data-parallel x {kind}-parallel)"]


def expert_count(config: PretrainedConfig) -> int:
    """Experts per MoE layer (Mixtral's num_local_experts, Qwen3-MoE's num_experts)."""
    return getattr(config, "num_local_experts", None) or config.num_experts


def lora_config(section: LoraSection) -> LoraConfig:
    return LoraConfig(r=section.rank, lora_alpha=section.alpha, lora_dropout=section.dropout,
                      target_modules=section.target_modules, modules_to_save=section.modules_to_save or None,
                      task_type="CAUSAL_LM")


def adapted_parameters(model: torch.nn.Module, section: LoraSection) -> int:
    """The same for a model already built on the meta device, which peft changes in place."""
    full_names = [name for name, _ in model.named_modules()]
    unmatched = [entry for entry in section.modules_to_save if not any(name.endswith(entry) for name in full_names)]
    if unmatched:  # peft would train nothing in full for them, silently
        raise ConfigError(f"lora.modules_to_save={section.modules_to_save}: no module of this model is named "
                          f"{', '.join(map(repr, unmatched))}. {module_names(full_names)}")
    with torch.device("meta"):
        try:
            model = get_peft_model(model, lora_config(section))
        except (ValueError, TypeError) as error:
            raise ConfigError(f"lora.target_modules={section.target_modules!r} / lora.modules_to_save="
                              f"{section.modules_to_save}: {str(error).rstrip('.')}. "
                              f"{module_names(full_names)}") from None
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def module_names(full_names: list[str]) -> str:
    """The model's module names without layer indices, for a message."""
    names = sorted({name.rsplit(".", 1)[-1] for name in full_names} - {""})
    return f"Module names of this model: {', '.join(name for name in names if not name.isdigit())}"


def tensor_parallel_shard(shape: ModelShape, size: int) -> ModelShape:
    """What one rank of a tensor-parallel group holds and computes: AutoTP splits the decoder layers' matrices
    (their norms, a small part, are counted split too) and so their heads and MLP width; the embedding, the
    head and the hidden-wide activations stay whole."""
    if size == 1:
        return shape
    layers = tuple(count // size for count in shape.layer_parameters)
    return replace(shape, parameters=shape.parameters - sum(shape.layer_parameters) + sum(layers),
                   layer_parameters=layers, num_heads=shape.num_heads // size,
                   num_kv_heads=shape.num_kv_heads // size, intermediate_size=shape.intermediate_size // size)
