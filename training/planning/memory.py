"""Memory per rank, estimated before a run: model states under each ZeRO setting, activations with and without
checkpointing, and whether they fit.

Model states use DeepSpeed's own estimators for ZeRO-2 and ZeRO-3 (with and without CPU offload) in mixed
precision; ZeRO-0/1, and fp32 runs (the estimators assume 16-bit weights), use the ZeRO paper's arithmetic, fp32 under
ZeRO on DeepSpeed's layout of the weights (fp32_zero_states). DeepSpeed's own buffers (its gradient buckets, sized by
the resolved config, and Muon's staged momentum) are added to each (with_deepspeed_buffers), and so is the frozen
reference model of GRPO and of DPO's sync_ref_model (with_objective). A GRPO generation's own memory (its KV cache,
generation) comes between the steps, in place of the activations: the peak counts the larger (ModelStates.peak_with).

Activations are the bytes autograd saves for the backward pass, per token, as transformers' Llama-family and
GPT-2 modules save them with PyTorch's scaled-dot-product attention. The rules below were read off those
modules and are checked against a measurement of the saved tensors (tests/training/planning/test_memory.py):
  Llama, Mistral, Qwen2 (per decoder layer): a*(4h + 4q + 4i + s) + 8h + 4*heads + 8
     Qwen3 adds its q/k norms:               (a + 4)*(q + kv) + 4*(heads + kv_heads)
     Mixtral, Qwen3-MoE: the MLP's 4*a*i becomes k*a*(2h + 4i_e) + 4E + 28k + 4 (top-k of E experts of width i_e)
  GPT-2 (per layer, no dropout):             28*a*h + a*s + 4*heads + 4*a
  outside the layers: Llama family (2a + 4)*h + 2*a*head_dim + 4*V + 20, GPT-2 2*a*h + 4*V + 24 + 2a
with a the activation dtype's bytes, h the hidden size, q/kv the query/key widths, i the MLP width, s the
row length (the per-layer copy of the packed-document mask; flash_attention_2 and flex_attention have none) and V
the vocabulary (the fp32 log-softmax of the loss). With checkpointing each layer keeps only its input (a*h) and one
layer's activations are rebuilt at a time in the backward pass. The loss briefly holds the logits and their fp32
copy too, (a + 4)*V per token, which is added to the peak. The fused loss (fused_loss, on by default) saves no
logits: its hidden states' gradient (a*h) takes the place of the head's saved input, and 4*V + 8 per token are gone;
one chunk of C tokens is live at a time, its logits and their gradient (2a*V per token, in the kernel CUDA compiles
for it; more on a CPU, where it runs eager), with the head's weight gradient, (4 + a)*V*h. A compiled layer (dense
Llama family) saves a*i + 8h less (and Qwen3 4*(q + kv) less): the partitioner recomputes them. flex_attention keeps
grouped keys and values at their own width (kv, not q: 2a*(q - kv) less than sdpa under the document mask). Gradient
buffers of the activations, the CUDA context and allocator fragmentation are not: `fits` leaves 10% of the memory
for them.

Expert parallelism of N (training/parallel/expert_parallel.py, ZeRO-1 and 2 only) over R data-parallel ranks, with
P parameters of which P_e are the experts' (all layers):
  model states:  S(P - P_e, R) + S(P_e / N, R / N)
     (S the ZeRO setting's per-rank bytes of so many parameters over so many ranks: the routers, attention and
     embeddings whole on every rank, sharded over all R; a rank's E/N experts of each layer sharded over the R/N
     ranks that hold the same experts)
  activations:   as without expert parallelism, plus 2*k*a*h per token for the all-to-alls of the MoE layer running
     (with balanced routing a rank's experts receive as many token copies, k per token, as its tokens send, and
     AutoEP's layer saves what the MoE rule counts: tests/training/planning/test_expert_parallel_memory.py; the
     all-to-alls' send and receive buffers are saved by nothing, so they are added once, to the peak)
"""
import json
import math
from dataclasses import dataclass, replace

from deepspeed.runtime.utils import partition_balanced, partition_uniform
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from training.compat.deepspeed import zero_cuts
from training.planning.ds_config import ds_config_file, params_offloaded, zero_setting, zero_stage
from training.config.recipe import Recipe
from training.planning.kernels import CHUNK_TOKENS, DPO_CHUNK_TOKENS, uses_fused_loss
from training.planning.layout import EXPERT_PARALLEL_STAGES
from training.planning.optimizer_states import optimizer_state_bytes
from training.planning.plan import Machine, RunPlan
from training.planning.precision import DTYPES, is_mixed, weights_dtype
from training.planning.shape import ModelShape, reward_model_parameters, reward_model_shape

ZERO_SETTINGS = ("0", "1", "2", "3", "2_offload", "3_offload")  # named as the ds_configs/zero*.json files
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")  # the MoE ones with their own MLP term
HEADROOM = 0.9  # share of a GPU's memory the estimate may fill
EXPERT_PARALLEL_SETTINGS = tuple(str(stage) for stage in EXPERT_PARALLEL_STAGES)  # no offload with expert parallelism


@dataclass(frozen=True)
class ModelStates:
    device_bytes: float  # per rank (GPU)
    host_bytes: float  # per node (CPU memory with offload; DeepSpeed also counts its loading buffers)
    source: str  # which estimator
    made_in_backward: float = 0.0  # of device_bytes: the whole gradients autograd makes in the backward pass
    generation_bytes: float = 0.0  # GRPO: what a generation holds beside them, while no activations are (generation)

    def peak_with(self, activation_bytes: float) -> float:
        """Peak bytes per rank with a micro-batch's activations, or with a generation's memory where that is larger
        (it comes between the steps, when neither activations nor whole gradients exist). Where the model states
        count whole gradients (ZeRO-0, and ZeRO-1's 16-bit ones), autograd makes them in the backward pass as it
        frees the saved activations: at the end of the forward pass they do not exist yet, and they outgrow the
        activations only where those are smaller (measured on an H200, bf16 ZeRO-1: the peak within 1% of states -
        16-bit gradients + activations)."""
        return self.device_bytes + max(activation_bytes - self.made_in_backward,
                                       self.generation_bytes - self.made_in_backward, 0.0)


def zero_arithmetic(params: float, stage: int, ranks: int, precision: str, state_bytes: float = 8.0) -> float:
    """Per-rank bytes of weights + gradients + optimizer states (the ZeRO paper's arithmetic).

    Mixed precision keeps 16-bit weights and gradients (2 + 2 bytes) and fp32 master weights (4) and optimizer
    states (`state_bytes`: AdamW's momentum and variance, 8); under ZeRO also the fp32 copy of its gradient
    partition that DeepSpeed's optimizer steps from (4; measured on an H200: 20.0 bytes per parameter at bf16
    ZeRO-1 with AdamW). fp32 keeps 4 + 4 and, under ZeRO, that fp32 partition copy too (4; measured on CPU
    ranks), at ZeRO-0 only the optimizer states; at ZeRO-2 and 3 also the master weights (4): DeepSpeed clones
    the weights' partition as its master copy in fp32 too. (At ZeRO-1 as well: there the end of the backward pass,
    with the whole gradients and the master copy but no gradient copy yet, is what its 4 + 4 + 12/N count.)
    ZeRO-1 shards the optimizer states over the ranks, ZeRO-2 the gradients too, ZeRO-3 the weights too. (ZeRO-0
    bf16 runs as torch autocast over fp32 weights: 16 bytes with AdamW.) Where the weights' shapes are known, an
    fp32 run is counted on DeepSpeed's layout instead (fp32_zero_states); DeepSpeed's own buffers are
    with_deepspeed_buffers'."""
    mixed = is_mixed(precision)
    weights, grads = (2, 2) if mixed else (4, 4)
    optimizer = state_bytes + (4 if mixed or stage >= 2 else 0) + (4 if stage else 0)
    shard = [(1, 1, 1), (1, 1, ranks), (1, ranks, ranks), (ranks, ranks, ranks)][stage]
    return params * (weights / shard[0] + grads / shard[1] + optimizer / shard[2])


def fp32_zero_states(groups: tuple[tuple[tuple[int, ...], ...], ...], stage: int, ranks: int,
                     state_bytes: float = 8.0) -> float:
    """The busiest rank's bytes of weights + gradients + optimizer states in an fp32 run under DeepSpeed's ZeRO-1, 2
    or 3 optimizer, from how it cuts the trained weights (their shapes per parameter group, zero_cuts), as its step
    flattens a group's gradients:
      weights            all of them at ZeRO-1/2; at ZeRO-3 the rank's piece of each (ceil(size / ranks))
      master weights     the rank's partition of each group, cloned in fp32 (also when the weights are fp32)
      gradients          ZeRO-1/2's contiguous buffer holds the whole of every weight the rank has a part of;
                         ZeRO-3's flat buffer the rank's pieces
      gradient copy      the flat fp32 gradient the optimizer steps from: one group's partition at a time
      optimizer states   state_bytes per parameter, sharded
    4 bytes each. train.py's census measures this as the first of two or more groups steps (docs/planning.md);
    stepping a model's only group, ZeRO-1/2 have freed the buffer by then. At ZeRO-1 the end of the backward pass
    may hold more, the whole gradients before they are reduced (in place of the buffer and the copy): the larger."""
    sizes = [math.prod(shape) for group in groups for shape in group]
    params, states = sum(sizes), state_bytes * sum(sizes) / ranks
    if stage == 3:
        partitions = [sum(math.ceil(math.prod(shape) / ranks) for shape in group) for group in groups]
        return 4 * (3 * sum(partitions) + max(partitions)) + states
    partitions = [2 * math.ceil(sum(map(math.prod, group)) / (2 * ranks)) for group in groups]
    whole = max(sum(sizes[index] for index, _, _ in zero_cuts([list(map(math.prod, group)) for group in groups],
                                                             stage, ranks, rank)) for rank in range(ranks))
    held = 4 * (params + sum(partitions) + whole + max(partitions)) + states
    return max(held, 4 * (2 * params + sum(partitions)) + states) if stage == 1 else held


def gradient_bucket_bytes(ds_config: dict, precision: str) -> float:
    """Per-rank bytes of DeepSpeed's gradient buckets (its ZeRO optimizers' "ipg" buffers) under a resolved config.

    With contiguous_gradients (DeepSpeed's default) each bucket is reduce_bucket_size elements: ZeRO-1 and 2 make one
    at every backward pass, two with overlap_comm, in the weights' dtype (at ZeRO-1 in the gradient-accumulation
    dtype where it differs), and free them before the optimizer step; ZeRO-3 makes one for the whole run, in the
    communication dtype. ZeRO-0 has none. Unset keys take DeepSpeed's defaults (reduce_bucket_size 5e8 elements,
    overlap_comm on at ZeRO-3 only)."""
    zero = DeepSpeedZeroConfig(**ds_config.get("zero_optimization", {}))
    stage = int(zero.stage)
    offloaded = zero.offload_optimizer is not None and zero.offload_optimizer.device != "none"
    if stage == 0 or not (zero.contiguous_gradients or offloaded):  # ZeRO-Offload makes them contiguous anyway
        return 0.0
    weight_bytes = DTYPES[precision].itemsize
    if stage == 3:
        communication = ds_config.get("communication_data_type")
        return zero.reduce_bucket_size * (DTYPES[communication].itemsize if communication else weight_bytes)
    accumulation = ds_config.get("data_types", {}).get("grad_accum_dtype")
    element = DTYPES[accumulation].itemsize if stage == 1 and accumulation else weight_bytes
    return zero.reduce_bucket_size * element * (2 if zero.overlap_comm else 1)


def shipped_ds_config(setting: str, hidden_size: int) -> dict:
    """ds_configs/zero<setting>.json with its bucket size resolved as train.py resolves "auto" (hidden_size^2, the
    HF Trainer's formula: training/planning/ds_config.py): the config a row of the plan's table stands for."""
    config = json.loads(ds_config_file(f"zero{setting}").read_text())
    zero = config.get("zero_optimization", {})
    if zero.get("reduce_bucket_size") == "auto":
        zero["reduce_bucket_size"] = hidden_size * hidden_size
    return config


def muon_staging_bytes(optimizer: str, shape: ModelShape, stage: int, ranks: int) -> float:
    """DeepSpeed's ZeRO-1/2 Muon writes each step's momentum into a staged copy of its momentum partition, which it
    keeps and commits after the step (stage_1_and_2._muon_staging_momentum): 4 bytes per decoder-layer matrix weight,
    sharded; 0 for other optimizers, stages and LoRA."""
    if optimizer != "muon" or stage not in (1, 2) or shape.lora_parameters is not None:
        return 0.0
    return 4 * shape.layer_matrix_parameters / ranks


def with_deepspeed_buffers(states: ModelStates, ds_config: dict, precision: str, optimizer: str, shape: ModelShape,
                           ranks: int) -> ModelStates:
    """`states` with what DeepSpeed's ZeRO optimizers hold beside weights, gradients and the optimizer's states,
    on the device: the gradient buckets and Muon's staged momentum."""
    stage = zero_stage(ds_config)
    extra = gradient_bucket_bytes(ds_config, precision) + muon_staging_bytes(optimizer, shape, stage, ranks)
    return replace(states, device_bytes=states.device_bytes + extra)


def reference_bytes(recipe: Recipe, precision: str, shape: ModelShape, stage: int, ranks: int) -> float:
    """The reference model per rank (training/objectives/reference.py, load_reference) of GRPO with beta > 0 and of
    DPO with dpo.sync_ref_model, without LoRA: the starting checkpoint, frozen, in the trained weights' dtype
    (weights_dtype: fp32 at ZeRO-0, where 16-bit precision is torch autocast), partitioned over the `ranks`
    data-parallel ranks at ZeRO-3 and a full copy on each at 0-2. 0 where there is none to hold: GRPO's beta 0, DPO's
    stored reference values, another objective, or LoRA (the base with its adapters disabled)."""
    live = recipe.grpo.beta > 0 if recipe.training.spec.generates else recipe.dpo.sync_ref_model
    if not live or recipe.lora.enabled:
        return 0.0
    whole = shape.parameters * weights_dtype(precision, stage).itemsize
    return whole / ranks if stage == 3 else whole


def reward_models(recipe: Recipe) -> list[ModelShape]:
    """The shapes of GRPO's reward models (grpo.rewards' model entries)."""
    if not recipe.training.spec.generates:
        return []
    return [reward_model_shape(spec.model, recipe.model.trust_remote_code) for spec in recipe.grpo.rewards
            if spec.model]


def reward_model_bytes(recipe: Recipe, precision: str) -> float:
    """GRPO's reward models per rank (training/objectives/grpo/rewards.py, RewardModel): each a whole frozen copy on every
    rank, in the run's dtype."""
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


def generation(recipe: Recipe, precision: str, shape: ModelShape, stage: int, ranks: int) -> Generation:
    """A generation's memory per rank (training/objectives/grpo/objective.py, sample): the rank's B = generation_batch_size /
    ranks completions (global_batch_size where unset) in one batch, each after a prompt of at most
    p = seq_len - max_completion_length tokens (what the data stage lets in), with c = kv_heads x head_dim, L layers,
    a the weights' bytes (weights_dtype):
      KV cache of t tokens:  2*L*c*a*B*t
      prefill:   KV(p) + B*p*((3i + 4h + 2d)*a + p)   (the MLP's three intermediates of width i; the residual
                                              stream, the normed input, the attention's output and the embedding's, of
                                              width h; the rotary cosines and sines, of the head's width d; the
                                              padding's p x p mask of booleans)
      decoding:  KV(seq_len)*(1 + 1/(2L)) + B*V*4*k   (the cache grows by concatenation: a layer's keys, or values,
                                              are copied at a time; the last position's logits in fp32, k copies:
                                              transformers' and SeededSampling's, 7, and the largest warper's
                                              more: generation_kwargs.typical_p's 8, top_p's sort 3, eta_cutoff's 2;
                                              top_k's, min_p's, top_h's, epsilon_cutoff's and the repetition
                                              penalty's stay within the 7; with any of generation_kwargs' token
                                              bans or biases, generate's processors, one more and their index over
                                              the vocabulary, 8*V)
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
    if not recipe.training.spec.generates:
        return Generation(0.0, 0.0, 0.0, 0.0)
    grpo, seq_len = recipe.grpo, recipe.data.seq_len
    generated = grpo.generation_batch_size or recipe.training.global_batch_size  # over all ranks, at once
    completions, prompt = generated // ranks, seq_len - grpo.max_completion_length
    a = weights_dtype(precision, stage).itemsize

    def kv_cache(tokens: int) -> float:
        return kv_cache_bytes(shape, a, completions, tokens)

    logits = completions * shape.vocab_size * 4
    more = grpo.generation_kwargs
    warper = max(8 * (more.typical_p < 1), 3 * (grpo.top_p < 1), 2 * (more.eta_cutoff > 0))
    processors = bool(more.passed())
    sampling = logits * (7 + warper + processors) + 8 * shape.vocab_size * processors
    whole = shape.parameters * a if stage == 3 and grpo.ds3_gather_for_generation else 0.0
    head = 4 * shape.vocab_size * shape.hidden_size if grpo.cast_lm_head_to_fp32 and a < 4 else 0.0

    def layer_pass(model: ModelShape, rows: int, tokens: int, itemsize: int, hidden_wide: int) -> float:
        return rows * tokens * ((3 * model.intermediate_size + hidden_wide * model.hidden_size + 2 * model.head_dim)
                                * itemsize + tokens)

    scoring = max((layer_pass(model, grpo.num_generations, seq_len, DTYPES[precision].itemsize, 6)
                   for model in reward_models(recipe)), default=0.0)
    return Generation(kv_cache(seq_len), kv_cache(prompt) + layer_pass(shape, completions, prompt, a, 4) + head,
                      kv_cache(seq_len) * (1 + 1 / (2 * shape.num_layers))
                      + max(sampling, head + 3 * logits if head else 0.0), whole, scoring)


def with_objective(states: ModelStates, ds_config: dict, recipe: Recipe, precision: str, shape: ModelShape,
                   ranks: int, nodes: int) -> ModelStates:
    """`states` with what the objective holds beside the trained model under `ds_config`: its reference model
    (reference_bytes) on the device, or, where ZeRO-3 offloads the parameters (zero3_offload.json does; the
    reference's config keeps it), in the nodes' memory; its reward models (reward_model_bytes) on the device; and its
    generation's memory (generation)."""
    stage = zero_stage(ds_config)
    per_rank = reference_bytes(recipe, precision, shape, stage, ranks)
    states = replace(states, generation_bytes=generation(recipe, precision, shape, stage, ranks).total,
                     device_bytes=states.device_bytes + reward_model_bytes(recipe, precision))
    if params_offloaded(ds_config):
        return replace(states, host_bytes=states.host_bytes + per_rank * ranks / nodes)
    return replace(states, device_bytes=states.device_bytes + per_rank)


def model_states(setting: str, shape: ModelShape, gpus_per_node: int, nodes: int, precision: str,
                 zero_init: bool, state_bytes: float = 8.0) -> ModelStates:
    """Model-state memory for one ZeRO setting over gpus_per_node x nodes data-parallel ranks, with
    `state_bytes` of optimizer states per parameter (DeepSpeed's estimators assume AdamW's 8: the difference
    is taken from the sharded states, on the GPUs or, offloaded, in the nodes' memory)."""
    stage, offload = int(setting[0]), setting.endswith("_offload")
    ranks = gpus_per_node * nodes
    if stage < 2 or precision == "fp32":
        if offload:
            raise ValueError(f"no estimate for ZeRO-{setting} in {precision}")
        trained = sum(math.prod(weight) for group in shape.trained_shapes for weight in group)
        if precision == "fp32" and stage and trained == shape.parameters:  # the weights' shapes are these parameters'
            return ModelStates(fp32_zero_states(shape.trained_shapes, stage, ranks, state_bytes), 0.0,
                               "ZeRO arithmetic")
        return ModelStates(zero_arithmetic(shape.parameters, stage, ranks, precision, state_bytes), 0.0,
                           "ZeRO arithmetic", whole_gradient_bytes(shape.parameters, stage, precision))
    if stage == 2:
        host, device = estimate_zero2_model_states_mem_needs(shape.parameters, gpus_per_node, nodes, offload)
    else:
        largest_layer = max(shape.layer_parameters + (shape.embedding_parameters, shape.head_parameters))
        host, device, _ = estimate_zero3_model_states_mem_needs(shape.parameters, largest_layer, gpus_per_node,
                                                                nodes, offload, offload, zero_init)
    fewer = (8.0 - state_bytes) * shape.parameters
    if offload:
        host -= fewer / nodes
    else:
        device -= fewer / ranks
    return ModelStates(float(device), float(host), "DeepSpeed estimator")


def whole_gradient_bytes(params: float, stage: int, precision: str) -> float:
    """The whole gradients zero_arithmetic counts: ZeRO-0's (fp32: torch autocast keeps fp32 weights) and, in mixed
    precision, ZeRO-1's 16-bit ones; none where ZeRO-2 and 3 reduce them into partitions as the backward pass goes."""
    if stage == 0:
        return 4.0 * params
    return 2.0 * params if stage == 1 and is_mixed(precision) else 0.0


def expert_parallel_states(setting: str, shape: ModelShape, gpus_per_node: int, nodes: int, size: int,
                           precision: str, state_bytes: float = 8.0) -> ModelStates:
    """Model states per rank with each MoE layer's experts split over `size` ranks (the formula in the module
    docstring; S is model_states' ZeRO-1 arithmetic or ZeRO-2 estimator, each linear in the parameters). The node's
    memory is the whole model's: each rank builds it whole before AutoEP keeps its experts. The optimizer's bytes
    per parameter are the whole model's mean (exact for AdamW and Lion)."""
    if setting not in EXPERT_PARALLEL_SETTINGS:
        raise ValueError(f"no estimate for ZeRO-{setting} with expert parallelism")
    ranks = gpus_per_node * nodes
    parts = ((shape.parameters - shape.expert_parameters, ranks), (shape.expert_parameters // size, ranks // size))
    device = sum(model_states(setting, replace(shape, parameters=count), shards, 1, precision, False,
                              state_bytes).device_bytes for count, shards in parts)
    whole = model_states(setting, shape, gpus_per_node, nodes, precision, False, state_bytes)
    return ModelStates(device, whole.host_bytes, f"{whole.source}, experts / {size}")


NF4_BYTES = 4.127 / 8  # QLoRA's 4-bit NormalFloat with double-quantized block constants (Dettmers et al. 2023)


def lora_model_states(setting: str, shape: ModelShape, trainable: int, gpus_per_node: int, nodes: int,
                      precision: str, state_bytes: float = 8.0, nf4: bool = False) -> ModelStates:
    """Model states of a LoRA run (training/models/lora.py): the frozen base weights in the run's dtype, with no gradients,
    master copy or optimizer states (ZeRO-3 shards them; ZeRO-0 keeps fp32 weights, also under autocast), plus the
    `trainable` parameters' by the ZeRO arithmetic; offload moves those parameters' fp32 master weights, fp32
    gradient partitions and optimizer states to the nodes' memory. With nf4 (QLoRA) the decoder layers' matrices take NF4_BYTES each (the
    embedding, head and norms stay 16-bit)."""
    stage, offload = int(setting[0]), setting.endswith("_offload")
    ranks = gpus_per_node * nodes
    weight_bytes = 2 if stage and is_mixed(precision) else 4
    frozen = shape.parameters * weight_bytes
    if nf4:
        frozen -= shape.layer_matrix_parameters * (weight_bytes - NF4_BYTES)
    frozen /= ranks if stage == 3 else 1
    trained = zero_arithmetic(trainable, stage, ranks, precision, state_bytes)
    host = trainable * (state_bytes + 4 + (4 if is_mixed(precision) else 0)) / ranks if offload else 0.0
    return ModelStates(frozen + trained - host, host * gpus_per_node, "ZeRO arithmetic (LoRA)")


LAUNCHER_GRACE_S = 30  # DeepSpeed's launcher, on SIGTERM: passes it to the ranks, SIGKILLs them 30 s later


@dataclass(frozen=True)
class CheckpointSize:
    total: float  # bytes of one save, all ranks
    largest_rank: float  # bytes the busiest rank writes (rank 0, where it writes the weights)


def checkpoint_bytes(params: float, stage: int, ranks: int, precision: str, state_bytes: float = 8.0) -> CheckpointSize:
    """DeepSpeed's files for one save, as measured on its checkpoints with AdamW (tests/test_train_distributed.py;
    `state_bytes` of optimizer states per parameter, AdamW's 8). ZeRO-0: rank 0 writes the fp32 weights
    (train.py's ZeRO-0 keeps fp32 weights, also under autocast) and the states, 12 bytes per parameter with
    AdamW. ZeRO-1/2: rank 0 writes the weights in the run's dtype, and every rank its 1/N of the fp32 master
    weights and states (12/N). ZeRO-3: only those shards (the master copy is the weights). The model config and
    tokenizer, and each rank's data and RNG state, add a few MB."""
    shards = (4 + state_bytes) * params
    if stage == 0:
        return CheckpointSize(shards, shards)
    weights = 0 if stage == 3 else params * (2 if is_mixed(precision) else 4)
    return CheckpointSize(weights + shards, weights + shards / ranks)


def planned_checkpoint(plan: RunPlan) -> CheckpointSize:
    """What one save of this run writes (a LoRA run's checkpoints leave the frozen base weights out), with a synced
    reference (grpo.sync_ref_model, dpo.sync_ref_model: reference.safetensors, whole, written by rank 0)."""
    shape, recipe = plan.shape, plan.recipe
    size = checkpoint_bytes(shape.lora_parameters or shape.parameters, plan.zero_stage,
                            plan.world_size // plan.pipeline_stages, plan.precision, state_bytes(plan))
    if not (recipe.grpo.sync_ref_model or recipe.dpo.sync_ref_model):
        return size
    reference = reference_bytes(recipe, plan.precision, shape, plan.zero_stage, 1)  # whole: ranks=1
    return CheckpointSize(size.total + reference, size.largest_rank + reference)


def planned_export(plan: RunPlan) -> float:
    """What the finished run's export writes: hf/ in the run's dtype, a LoRA run's adapters (and hf/ when merged)."""
    shape, dtype_bytes = plan.shape, DTYPES[plan.precision].itemsize
    adapters = shape.lora_parameters or 0
    whole = shape.parameters if not plan.recipe.lora.enabled or plan.recipe.export.merge else 0
    return (whole + adapters) * dtype_bytes


def layer_bytes_per_token(shape: ModelShape, seq_len: int, dtype_bytes: int, attn_implementation: str,
                          sequence_parallel: int = 1, compiled: bool = False) -> float | None:
    """Bytes one decoder layer saves for the backward pass per token on a rank (rules in the module docstring).
    Under sequence parallelism a rank holds seq_len / N tokens of each row; attention then sees the whole row
    for heads / N (the same bytes), but sdpa's [seq, seq] mask is whole on every rank: N x as much per token.
    A compiled dense Llama-family layer (training/models/compile.py) saves less: its partitioner recomputes the
    SwiGLU product and the norms' fp32 copies in the backward pass."""
    a, h, s = dtype_bytes, shape.hidden_size, seq_len
    mask = 0 if attn_implementation in ("flash_attention_2", "flex_attention") else a * s * sequence_parallel
    attention_softmax = 4 * shape.num_heads + mask  # sdpa keeps a log-sum-exp per head
    if attn_implementation == "eager":  # the probabilities (fp32, and their cast to a) instead
        attention_softmax = shape.num_heads * s * (4 + (a if a != 4 else 0))
    if shape.model_type in LLAMA_FAMILY:
        per_layer = a * (4 * h + 4 * shape.q_dim) + 8 * h + 8 + attention_softmax + mlp_bytes_per_token(shape, a)
        if shape.model_type in ("qwen3", "qwen3_moe"):
            per_layer += (a + 4) * (shape.q_dim + shape.kv_dim) + 4 * (shape.num_heads + shape.num_kv_heads)
        if attn_implementation == "flex_attention":  # native GQA: keys and values saved at their own width
            per_layer -= 2 * a * (shape.q_dim - shape.kv_dim)
        if compiled and not shape.num_experts:
            per_layer -= a * shape.intermediate_size + 8 * h + (4 * (shape.q_dim + shape.kv_dim)
                                                                if shape.model_type == "qwen3" else 0)
        return per_layer
    if shape.model_type == "gpt2" and shape.intermediate_size == 4 * h and attn_implementation != "eager":
        return 28 * a * h + 4 * a + attention_softmax
    return None


def mlp_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> float:
    """What a Llama-family MLP saves per token: 4 intermediate-wide tensors; in a mixture of experts (Mixtral,
    Qwen3-MoE), for each of the token's top-k experts its gathered input, the down projection's output and the 4
    intermediate-wide tensors, plus the router's fp32 probabilities (4 per expert) and its top-k indices and
    weights (28 bytes per pick, measured; Qwen3-MoE's are 12 to 18 bytes fewer per token)."""
    a = dtype_bytes
    if not shape.num_experts:
        return 4 * a * shape.intermediate_size
    k = shape.experts_per_token
    return k * a * (2 * shape.hidden_size + 4 * shape.expert_intermediate_size) + 4 * shape.num_experts + 28 * k + 4


def all_to_all_bytes_per_token(shape: ModelShape, dtype_bytes: int, expert_parallel: int) -> float:
    """Under expert parallelism, the buffers of one MoE layer's all-to-all: each token's k hidden states sent to their
    experts' ranks and as many received there (balanced routing), and the same again for the experts' outputs on
    their way back; a buffer is freed once the next step has its copy, 2*k*a*h per token live at a time (module
    docstring); 0 without it."""
    if expert_parallel == 1 or not shape.num_experts:
        return 0.0
    return 2 * shape.experts_per_token * dtype_bytes * shape.hidden_size


def outside_layers_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> float:
    """Embedding, final norm, LM head and loss: what they save per token, plus the loss's logits transient."""
    a, h, vocab = dtype_bytes, shape.hidden_size, shape.vocab_size
    saved = (2 * a * h + 24 + 2 * a if shape.model_type == "gpt2"
             else (2 * a + 4) * h + 2 * a * shape.head_dim + 20) + 4 * vocab
    return saved + (a + 4) * vocab


@dataclass(frozen=True)
class Activations:
    without_checkpointing: float
    with_checkpointing: float
    host: float = 0.0  # with checkpointing, the saved layer inputs offloaded to host memory

    def peak(self, checkpointing: bool) -> float:
        return self.with_checkpointing if checkpointing else self.without_checkpointing


def activation_bytes(shape: ModelShape, tokens: int, seq_len: int, dtype_bytes: int, attn_implementation: str,
                     layers: int | None = None, with_head: bool = True, sequence_parallel: int = 1,
                     tiled_mlp: bool = False, logits_tile_tokens: int | None = None,
                     offload_checkpoints: bool = False, expert_parallel: int = 1,
                     fused_loss: bool = False, compiled: bool = False,
                     entropy_gradient: bool = False, fp32_head: bool = False,
                     dpo_statistics: bool = False) -> Activations | None:
    """Peak activation memory of one micro-batch of `tokens` tokens (on this rank: a 1/N slice of each row under
    sequence parallelism) through `layers` decoder layers (default: all) and, with_head, the embedding, head and
    loss; None for a model type without a rule.

    Tiling (training/models/long_context.py): a tiled MLP saves only its input, which the layer's norm output already
    counts, and one tile of hidden_size tokens per row is live at a time; tiled logits save nothing of the
    vocabulary's width, and one tile's logits and their fp32 copy are live at a time. The fused loss
    (training/models/fused_loss.py) saves the hidden states' gradient in place of the head's input and no logits;
    one chunk's logits and their gradient (in the run's dtype, CUDA's compiled kernel for the chunk) and the head's
    weight gradient (fp32, and its cast) are live at a time. Offloaded checkpoints keep
    the layers' saved inputs in host memory, all but the one brought back for the layer being recomputed. Under
    expert parallelism one MoE layer's all-to-all buffers are added to the peak. GRPO's entropy bonus
    (entropy_gradient) keeps the fp32 probabilities beside the log-probabilities for the entropy's gradient. Its
    fp32 head (fp32_head, grpo.cast_lm_head_to_fp32) in a bf16 run saves its input in fp32 (in place of the run
    dtype's) and an fp32 copy of its weight (4*V*h, once per micro-batch; none needed at ZeRO-0, whose weights are
    fp32: an upper bound there), and makes the logits in fp32 from the start, without the run-dtype logits beside
    their fp32 copy. DPO's token statistics and WPO weights (dpo_statistics, every DPO run) hold 12 bytes per token
    and vocabulary entry of a chunk of DPO_CHUNK_TOKENS tokens at a time."""
    a, h, vocab = dtype_bytes, shape.hidden_size, shape.vocab_size
    per_layer = layer_bytes_per_token(shape, seq_len, a, attn_implementation, sequence_parallel, compiled)
    if per_layer is None:
        return None
    layers = shape.num_layers if layers is None else layers
    transient = 0.0
    if tiled_mlp and shape.model_type in LLAMA_FAMILY and not shape.num_experts:
        per_layer -= 4 * a * shape.intermediate_size
        rows = max(1, tokens * sequence_parallel // seq_len)
        transient = min(tokens, rows * h) * 4 * a * shape.intermediate_size
    outside = outside_layers_bytes_per_token(shape, a) + 4 * vocab * entropy_gradient if with_head else 0.0
    if with_head and logits_tile_tokens:
        outside -= (a + 8) * vocab
        transient = max(transient, min(tokens, logits_tile_tokens) * (a + 4) * vocab)
    elif with_head and fused_loss:
        outside -= (a + 8) * vocab + 8  # and the loss's int64 targets; the gradient a*h takes the head input's place
        transient = max(transient, min(tokens, CHUNK_TOKENS) * 2 * a * vocab + (4 + a) * vocab * h)
    if with_head and fp32_head and a < 4:
        outside += (4 - a) * h - a * vocab
        transient += 4 * vocab * h
    if with_head and dpo_statistics:
        transient += min(tokens, DPO_CHUNK_TOKENS) * 12 * vocab
    if layers:
        transient += tokens * all_to_all_bytes_per_token(shape, a, expert_parallel)
    on_device = 1 if offload_checkpoints and layers else layers
    checkpointed = on_device * a * h + (per_layer if layers else 0.0)
    return Activations(tokens * (layers * per_layer + outside) + transient,
                       tokens * (checkpointed + outside) + transient, tokens * (layers - on_device) * a * h)


def fits(total: float, memory: float) -> bool:
    """Whether `total` bytes fit in a rank's `memory`, leaving HEADROOM's share for what the estimate leaves out."""
    return total <= HEADROOM * memory


def stage_bounds(layer_parameters: list[int], stages: int, method: str) -> list[int]:
    """Where each stage starts, as DeepSpeed's PipelineModule partitions the layers."""
    if method == "uniform":
        return partition_uniform(len(layer_parameters), stages)
    return partition_balanced(layer_parameters, stages)


def micro_batch_rows(recipe: Recipe) -> int:
    """The rows of a micro-batch; under DPO at its largest, every sequence of its pairs a whole row."""
    return recipe.training.micro_batch_size * recipe.training.spec.rows_per_example


def activations(recipe: Recipe, precision: str, shape: ModelShape, setting: str | None = None,
                **stage) -> Activations | None:
    """One micro-batch's activations on a rank: its slice of the rows under sequence parallelism, its share of
    the heads and the MLP width under tensor parallelism, the all-to-all buffers under expert parallelism. The
    layers count as compiled where the recipe compiles them (compile, as the plan resolved it) and the ZeRO
    `setting` (default: the recipe's own) is 0-2: under ZeRO-3, where compile: auto leaves them eager and DeepSpeed's
    hooks break a compiled layer's graph, they are planned eager."""
    seq_len, long_context, parallelism = recipe.data.seq_len, recipe.long_context, recipe.parallelism
    shape = tensor_parallel_shard(shape, parallelism.tensor_parallel)
    return activation_bytes(shape, micro_batch_rows(recipe) * seq_len // parallelism.sequence_parallel, seq_len,
                            DTYPES[precision].itemsize, recipe.model.attn_implementation,
                            sequence_parallel=parallelism.sequence_parallel, tiled_mlp=long_context.tiled_mlp,
                            logits_tile_tokens=long_context.logits_tile_tokens,
                            offload_checkpoints=long_context.offload_checkpoints,
                            expert_parallel=parallelism.expert_parallel,
                            fused_loss=uses_fused_loss(recipe, router_loss=bool(shape.num_experts)
                                                       and recipe.moe.aux_loss_coef != 0),
                            compiled=recipe.compile is True and (setting is None or int(setting[0]) < 3),
                            entropy_gradient=recipe.grpo.entropy_bonus,
                            fp32_head=recipe.grpo.cast_lm_head_to_fp32,
                            dpo_statistics=recipe.training.spec.token_statistics,
                            **stage)


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


def states_per_setting(recipe: Recipe, precision: str, shape: ModelShape, machine: Machine,
                       ds_config: dict | None = None) -> dict[str, ModelStates]:
    """Each ZeRO setting's model states per rank on `machine` (a rank's slice under tensor parallelism, ZeRO over
    the data-parallel ranks; with LoRA, the shape's lora_parameters on frozen weights; under expert parallelism only
    the settings it runs with, a rank's share of the experts); offload only in mixed precision (DeepSpeed's offload
    keeps 16-bit weights on the GPU). Each with the gradient buckets of the setting's shipped ds_configs file, or
    of `ds_config` (the run's resolved config) for the setting it is, and GRPO's reference and generation
    (with_objective)."""
    tp, ep = recipe.parallelism.tensor_parallel, recipe.parallelism.expert_parallel
    settings = [setting for setting in ZERO_SETTINGS if not (precision == "fp32" and setting.endswith("_offload"))]
    if ep > 1:
        settings = [setting for setting in settings if setting in EXPERT_PARALLEL_SETTINGS]
    ranks = machine.gpus_per_node * machine.nodes // tp
    optimizer = {setting: optimizer_state_bytes(recipe.optimizer.name, shape, int(setting[0]), ranks)
                 for setting in settings}
    if shape.lora_parameters is not None:
        states = {setting: lora_model_states(setting, shape, shape.lora_parameters, machine.gpus_per_node,
                                             machine.nodes, precision, optimizer[setting], recipe.lora.quantize == "nf4")
                  for setting in settings}
    elif ep > 1:
        states = {setting: expert_parallel_states(setting, shape, machine.gpus_per_node, machine.nodes, ep, precision,
                                                  optimizer[setting]) for setting in settings}
    else:
        states = {setting: model_states(setting, tensor_parallel_shard(shape, tp), machine.gpus_per_node // tp,
                                        machine.nodes, precision, zero_init=recipe.model.name_or_path is not None,
                                        state_bytes=optimizer[setting]) for setting in settings}
    own = zero_setting(ds_config) if ds_config else None
    for setting, state in states.items():
        config = ds_config if setting == own else shipped_ds_config(setting, shape.hidden_size)
        state = with_deepspeed_buffers(state, config, precision, recipe.optimizer.name, shape, ranks)
        states[setting] = with_objective(state, config, recipe, precision, shape, ranks, machine.nodes)
    return states


def planned_model_states(plan: RunPlan) -> ModelStates:
    """The run's model-state estimate per rank: its ZeRO setting over its data-parallel ranks (one node), a rank's
    share of the experts under expert parallelism, or with pipeline stages the largest stage's share; with the
    gradient buckets of its resolved DeepSpeed config (and Muon's staged momentum) and GRPO's reference and
    generation (with_objective). ValueError where there is no estimate (offload in fp32)."""
    states = with_deepspeed_buffers(weights_gradients_and_states(plan), plan.ds_config, plan.precision,
                                    plan.recipe.optimizer.name, plan.shape, plan.dp_size)
    return with_objective(states, plan.ds_config, plan.recipe, plan.precision, plan.shape, plan.dp_size, 1)


def planned_peak(plan: RunPlan, states: ModelStates) -> float | None:
    """The run's peak per rank, --dry-run's table cell for its setting: its model states (planned_model_states) with
    one micro-batch's activations, checkpointed as the recipe says, or GRPO's generation where larger; None under
    pipeline parallelism (planned per stage) or for a model type without an activation rule."""
    acts = activations(plan.recipe, plan.precision, plan.shape, plan.zero_setting)
    if acts is None or plan.pipeline_stages > 1:
        return None
    return states.peak_with(acts.peak(plan.recipe.activation_checkpointing))


def weights_gradients_and_states(plan: RunPlan) -> ModelStates:
    """planned_model_states without DeepSpeed's own buffers (with_deepspeed_buffers)."""
    shape = plan.shape
    if shape.lora_parameters is not None:
        return lora_model_states(plan.zero_setting, shape, shape.lora_parameters, plan.world_size, 1,
                                 plan.precision, state_bytes(plan), plan.recipe.lora.quantize == "nf4")
    if plan.expert_parallel > 1:
        return expert_parallel_states(plan.zero_setting, shape, plan.world_size, 1, plan.expert_parallel,
                                      plan.precision, state_bytes(plan))
    if plan.pipeline_stages == 1:
        return model_states(plan.zero_setting, tensor_parallel_shard(shape, plan.tensor_parallel),
                            plan.world_size // plan.tensor_parallel, 1, plan.precision,
                            zero_init=plan.recipe.model.name_or_path is not None, state_bytes=state_bytes(plan))
    layers = shape.pipeline_layer_parameters
    bounds = stage_bounds(layers, plan.pipeline_stages, plan.recipe.parallelism.partition_method)
    largest = max(sum(layers[start:end]) for start, end in zip(bounds, bounds[1:]))
    return ModelStates(zero_arithmetic(largest, plan.zero_stage, plan.dp_size, plan.precision, state_bytes(plan)),
                       0.0, "ZeRO arithmetic", whole_gradient_bytes(largest, plan.zero_stage, plan.precision))


def state_bytes(plan: RunPlan) -> float:
    """The run's optimizer-state bytes per trained parameter (training/planning/optimizer_states.py)."""
    return optimizer_state_bytes(plan.recipe.optimizer.name, plan.shape, plan.zero_stage, plan.dp_size)

