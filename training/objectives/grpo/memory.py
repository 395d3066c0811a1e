"""GRPO's memory beside the trained model's states, estimated before a run (its spec's `memory`, grpo_memory): a
generation's own (its KV cache, prefill and decoding passes, the weights ZeRO-3 gathers for it, a reward model's
scoring; with grpo.generation_engine=vllm, on the ranks only what a weight push gathers, and the server's own memory
and the push's traffic beside them: vllm_engine), its reward models (their shapes read from their configs:
reward_model_shape, which rewards.py's check reads too) and its frozen reference (training/objectives/
reference_memory.py). Plan-time code, at the planning layer (tests/test_import_order.py): planning reaches it through
the spec (training/planning/objective_memory.py, objective_memory)."""
import functools
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from training.base.errors import ConfigError
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.objectives.grpo.spec import prompt_width
from training.objectives.reference_memory import reference_bytes
from training.planning.objective_memory import ObjectiveMemory
from training.planning.precision import DTYPES, weights_dtype
from training.planning.shape import ModelShape, model_shape


@functools.cache
def reward_model_shape(name_or_path: str, trust_remote_code: bool) -> ModelShape:
    """A GRPO reward model's shape (grpo.rewards' model): its checkpoint's architecture, as a causal LM's (its
    parameters are those without the LM head, plus the one-label score head: reward_model_parameters)."""
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ConfigError(f"grpo.rewards: cannot read the reward model's config from {name_or_path}: {error}; point "
                          f"model at a sequence classifier's folder (save_pretrained) or hub id") from None
    return model_shape(config)


def reward_model_parameters(shape: ModelShape) -> int:
    """A reward model's parameters: the causal LM's without its head, and a score head of one output per hidden
    unit (AutoModelForSequenceClassification with num_labels=1, TRL's)."""
    return shape.parameters - shape.head_parameters + shape.hidden_size


def reward_models(recipe: Recipe) -> list[ModelShape]:
    """The shapes of GRPO's reward models (grpo.rewards' model entries)."""
    return [reward_model_shape(spec.model, recipe.model.trust_remote_code) for spec in recipe.grpo.rewards
            if spec.model]


def reward_model_bytes(recipe: Recipe, precision: Precision) -> float:
    """GRPO's reward models per rank (training/objectives/grpo/rewards.py, RewardModel): each a whole frozen copy on
    every rank, in the run's dtype."""
    return sum(reward_model_parameters(shape) for shape in reward_models(recipe)) * DTYPES[precision].itemsize


@dataclass(frozen=True)
class Generation:
    """What a GRPO generation holds per rank beside the model states (generation)."""
    kv_cache: float  # at its longest: prompts and completions of seq_len tokens
    prefill: float  # the prompts' pass: their KV cache and one layer's working set
    decoding: float  # the last decoding pass: the whole KV cache, its growth and the sampling's buffers
    gathered_weights: float  # ZeRO-3 with grpo.ds3_gather_for_generation: the whole weights, gathered
    scoring: float = 0.0  # a reward model's pass over one group, after the generation's memory is freed

    @property
    def total(self) -> float:
        return max(max(self.prefill, self.decoding) + self.gathered_weights, self.scoring)


def kv_cache_bytes(shape: ModelShape, itemsize: int, rows: int, tokens: int) -> float:
    """The KV cache of `rows` rows of `tokens` tokens: keys and values of every layer, in the weights' dtype."""
    return 2 * shape.num_layers * shape.kv_dim * itemsize * rows * tokens


def decoding_reads(shape: ModelShape, itemsize: int, rows: int, prompt: int, passes: int) -> float:
    """What `passes` decoding passes of `rows` rows after a prompt of `prompt` tokens read: the weights (W) every
    pass, and the KV cache of the prompt and of the completion tokens before it (pass t reads p + t tokens' worth):
      reads = C*W + KV*(C*p + C*(C-1)/2)   over C passes, KV per token (kv_cache_bytes), all in `itemsize` bytes"""
    tokens_read = passes * prompt + passes * (passes - 1) / 2
    return passes * shape.parameters * itemsize + kv_cache_bytes(shape, itemsize, rows, tokens_read)


def generation(recipe: Recipe, precision: Precision, shape: ModelShape, stage: int, ranks: int) -> Generation:
    """A generation's memory per rank (training/objectives/grpo/objective.py, sample): the rank's
    B = generation_batch_size / ranks completions (global_batch_size where unset) in one batch, each after a prompt
    of at most p = seq_len - max_completion_length tokens (what the data stage lets in; compiled decoding pads it to the
    next power of two, and seq_len below is then p + max_completion_length), with c = kv_heads x head_dim, L layers,
    a the weights' bytes (weights_dtype):
      KV cache of t tokens:  2*L*c*a*B*t
      prefill:   KV(p) + B*p*((3i + 4h + 2d)*a + p)   (the MLP's three intermediates of width i; the residual
                                              stream, the normed input, the attention's output and the embedding's, of
                                              width h; the rotary cosines and sines, of the head's width d; the
                                              padding's p x p mask of booleans)
      decoding:  KV(seq_len)*(1 + 1/(2L)) + B*V*4*k   (generate's dynamic cache grows by concatenation: a layer's
                                              keys, or values, are copied at a time; grpo.generation_engine's
                                              static cache is allocated whole in the prefill, KV(seq_len) in both,
                                              and its pass holds, in the same allowance, the attention's scores over
                                              the whole cache, which CPU's math kernel makes for its mask, and the
                                              head's inputs; the last position's logits in fp32, k copies:
                                              transformers' and SeededSampling's (its warped scores, its uniform
                                              draws, the scores it returns), 6.5 (measured 6.1-6.4), and the largest
                                              warper's more: generation_kwargs.typical_p's 8, top_p's sort 3,
                                              eta_cutoff's 3; top_k's, min_p's, top_h's, epsilon_cutoff's and the
                                              repetition penalty's stay within the 6.5; with any of
                                              generation_kwargs' token bans or biases, generate's processors, one
                                              more and their index over the vocabulary, 8*V)
      the larger of the two, plus the whole weights (P*a) under ZeRO-3 with grpo.ds3_gather_for_generation.
      With grpo.cast_lm_head_to_fp32 in a run whose weights are not fp32, each pass's fp32 copy of the head's weight
      (4*V*h) is live while the head runs: in prefill, and in decoding in place of the sampling's copies (when larger)
      beside 3 of them (the head's logits, and the previous pass's two that generate still holds).
    A reward model (grpo.rewards' model) scores one group of G = num_generations sequences of at most seq_len (s)
    tokens at a time, after the generation's memory is freed, without a gradient, its own shape's:
      scoring:   G*s*((3i + 6h + 2d)*a + s)   (one layer's working set, as in prefill, without a KV cache; the
                                              2 more hidden-wide tensors measured on CPU, 3-4% above it)
    Read off transformers' Llama modules and generate, and checked against a measurement of the allocations on CPU
    (tests/training/planning/test_memory.py). Not counted: the attention's p x p scores, which CPU's math kernel
    makes for a padded batch and CUDA's memory-efficient kernel does not."""
    grpo = recipe.grpo
    generated = grpo.generation_batch_size or recipe.training.global_batch_size  # over all ranks, at once
    completions = generated // ranks
    prompt = prompt_width(recipe.data.seq_len - grpo.max_completion_length, grpo.engine)
    seq_len = prompt + grpo.max_completion_length
    a = weights_dtype(precision, stage).itemsize

    def kv_cache(tokens: int) -> float:
        return kv_cache_bytes(shape, a, completions, tokens)

    static = grpo.engine in ("static", "compiled")

    logits = completions * shape.vocab_size * 4
    more = grpo.generation_kwargs
    warper = max(8 * (more.typical_p < 1), 3 * (grpo.top_p < 1), 3 * (more.eta_cutoff > 0))
    processors = bool(more.passed())
    sampling = logits * (6.5 + warper + processors) + 8 * shape.vocab_size * processors
    whole = shape.parameters * a if stage == 3 and grpo.ds3_gather_for_generation else 0.0
    head = 4 * shape.vocab_size * shape.hidden_size if grpo.cast_lm_head_to_fp32 and a < 4 else 0.0

    def layer_pass(model: ModelShape, rows: int, tokens: int, itemsize: int, hidden_wide: int) -> float:
        return rows * tokens * ((3 * model.intermediate_size + hidden_wide * model.hidden_size + 2 * model.head_dim)
                                * itemsize + tokens)

    scoring = max((layer_pass(model, grpo.num_generations, recipe.data.seq_len, DTYPES[precision].itemsize, 6)
                   for model in reward_models(recipe)), default=0.0)
    if grpo.engine == "vllm":  # the server samples; a ZeRO-3 push gathers one module at a time on every rank
        return Generation(0.0, 0.0, 0.0, largest_module(shape) * a if stage == 3 else 0.0, scoring)
    return Generation(kv_cache(seq_len),
                      kv_cache(seq_len if static else prompt) + layer_pass(shape, completions, prompt, a, 4) + head,
                      kv_cache(seq_len) * (1 + 1 / (2 * shape.num_layers))
                      + max(sampling, head + 3 * logits if head else 0.0), whole, scoring)


def largest_module(shape: ModelShape) -> int:
    """The parameters of the model's largest module (its own, not its children's): what a ZeRO-3 push gathers at once
    (vllm_engine.py, engine_weights): the embedding or the head (V x h), or an MLP projection (h x i)."""
    return max(shape.vocab_size * shape.hidden_size, shape.hidden_size * shape.intermediate_size)


@dataclass(frozen=True)
class VllmEngine:
    """grpo.generation_engine=vllm's server and its weight pushes (vllm_engine.py), beside the ranks."""
    weights: float  # the server's copy of the weights, in the engine's dtype (the run's compute dtype)
    kv_cache: float | None  # on a CPU: grpo.vllm_kv_cache_gib; None on a GPU, whose share the server takes
    # (grpo.vllm_gpu_memory_utilization) holds the weights and the KV cache in the rest
    kv_per_completion: float  # one completion's KV cache at its longest (seq_len tokens)
    completions: int  # a generation's, over every rank: what the server samples at once, where its cache holds them
    push: float  # bytes rank 0 gathers on the host, writes to /dev/shm and the server reloads, per push (one
    # before each generation that follows an optimizer step)

    @property
    def concurrent(self) -> int | None:
        """The completions the CPU server's KV cache holds at their longest at once (None on a GPU)."""
        return None if self.kv_cache is None else int(self.kv_cache // self.kv_per_completion)


def vllm_engine(recipe: Recipe, precision: Precision, shape: ModelShape) -> VllmEngine:
    """The vLLM server's memory and the push's traffic (grpo.generation_engine=vllm):
      weights   P*e                   e: the engine's dtype (fp32 runs fp32, fp16 fp16, the others bf16)
      KV cache  grpo.vllm_kv_cache_gib on a CPU; 2*L*c*e per token, s = seq_len tokens a completion at most
      push      P*e per push, rank 0's host copy while written
    A push under ZeRO-3 gathers one module at a time on every rank (largest_module, in generation's gathered
    weights)."""
    grpo = recipe.grpo
    e = 4 if precision == Precision.FP32 else 2
    weights = shape.parameters * e
    kv_cache = None if torch.cuda.is_available() else grpo.vllm_kv_cache_gib * 2 ** 30
    completions = grpo.generation_batch_size or recipe.training.global_batch_size
    return VllmEngine(weights, kv_cache, kv_cache_bytes(shape, e, 1, recipe.data.seq_len), completions, weights)


def grpo_memory(recipe: Recipe, precision: Precision, shape: ModelShape, stage: int, ranks: int) -> ObjectiveMemory:
    """What GRPO holds per rank beside the trained model at ZeRO `stage` over `ranks` ranks: its reference (beta > 0;
    whole in each checkpoint with grpo.sync_ref_model), its reward models and its generation's memory."""
    live = recipe.grpo.beta > 0
    saved = reference_bytes(live, recipe, precision, shape, stage, 1) if recipe.grpo.sync_ref_model else 0.0
    return ObjectiveMemory(reference=reference_bytes(live, recipe, precision, shape, stage, ranks),
                           reward_models=reward_model_bytes(recipe, precision),
                           generation=generation(recipe, precision, shape, stage, ranks).total,
                           saved_reference=saved)
