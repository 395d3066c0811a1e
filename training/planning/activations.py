"""Activation memory per rank, estimated before a run: one micro-batch's activations with and without checkpointing.

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
buffers of the activations, the CUDA context and allocator fragmentation are not: `fits`
(training/planning/memory.py) leaves 10% of the memory for them.

Expert parallelism of N (training/parallel/expert_parallel.py, ZeRO-1 and 2 only), with top-k routing:
  activations:   as without expert parallelism, plus 2*k*a*h per token for the all-to-alls of the MoE layer running
     (with balanced routing a rank's experts receive as many token copies, k per token, as its tokens send, and
     AutoEP's layer saves what the MoE rule counts: tests/training/planning/test_expert_parallel_memory.py; the
     all-to-alls' send and receive buffers are saved by nothing, so they are added once, to the peak)
  model states:  training/planning/model_states.py
"""
from dataclasses import dataclass, replace

from training.config.families import family_of
from training.config.precision import Precision
from training.config.recipe import Recipe
from training.objectives.spec import HeadTraits
from training.planning.kernels import CHUNK_TOKENS, uses_fused_loss
from training.planning.precision import DTYPES
from training.planning.shape import ModelShape


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
    family = family_of(shape.model_type)  # its rule: training/config/families.py
    if family.activations == "llama":
        per_layer = a * (4 * h + 4 * shape.q_dim) + 8 * h + 8 + attention_softmax + mlp_bytes_per_token(shape, a)
        if family.qk_norm:
            per_layer += (a + 4) * (shape.q_dim + shape.kv_dim) + 4 * (shape.num_heads + shape.num_kv_heads)
        if attn_implementation == "flex_attention":  # native GQA: keys and values saved at their own width
            per_layer -= 2 * a * (shape.q_dim - shape.kv_dim)
        if compiled and not shape.num_experts:
            per_layer -= a * shape.intermediate_size + 8 * h + (4 * (shape.q_dim + shape.kv_dim)
                                                                if family.qk_norm else 0)
        return per_layer
    if family.activations == "gpt2" and shape.intermediate_size == 4 * h and attn_implementation != "eager":
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
    saved = (2 * a * h + 24 + 2 * a if family_of(shape.model_type).activations == "gpt2"
             else (2 * a + 4) * h + 2 * a * shape.head_dim + 20) + 4 * vocab
    return saved + (a + 4) * vocab



@dataclass(frozen=True)
class Activations:
    without_checkpointing: float
    with_checkpointing: float
    host: float = 0.0  # with checkpointing, the saved layer inputs offloaded to host memory

    def peak(self, checkpointing: bool) -> float:
        return self.with_checkpointing if checkpointing else self.without_checkpointing



@dataclass(frozen=True)
class ActivationInputs:
    """What the activation arithmetic (activation_bytes) reads of a run, as one value: activation_inputs makes it from
    the recipe; a pipeline stage (its layers, with_head) or a micro-batch of other rows is a dataclasses.replace of
    it."""
    tokens: int  # of one micro-batch on this rank: a 1/N slice of each row under sequence parallelism
    seq_len: int
    dtype_bytes: int  # the activations' dtype
    attn_implementation: str
    layers: int | None = None  # the decoder layers it runs through (a pipeline stage's); None: all
    with_head: bool = True  # and the embedding, head and loss
    sequence_parallel: int = 1
    tiled_mlp: bool = False
    logits_tile_tokens: int | None = None
    offload_checkpoints: bool = False
    expert_parallel: int = 1
    fused_loss: bool = False
    compiled: bool = False
    head: HeadTraits = HeadTraits()  # what the objective's loss adds at the head (its spec's head_traits)
    statistics_chunk_tokens: int = 0  # the objective reads statistics of the logits this many tokens at a time; 0: not

    def at_setting(self, setting: str) -> "ActivationInputs":
        """Under the ZeRO `setting` (model_states.ZERO_SETTINGS' names): compiled layers are planned eager under
        ZeRO-3, where compile: auto leaves them eager and DeepSpeed's hooks break a compiled layer's graph."""
        return replace(self, compiled=self.compiled and int(setting[0]) < 3)



def activation_bytes(shape: ModelShape, inputs: ActivationInputs) -> Activations | None:
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
    expert parallelism one MoE layer's all-to-all buffers are added to the peak. What the objective's loss adds at
    the head (HeadTraits, from its spec; docs/objectives.md): a loss that differentiates an entropy
    (entropy_gradient) keeps the fp32 probabilities beside the log-probabilities for its gradient; an fp32 head
    (fp32_head) in a bf16 run saves its input in fp32 (in place of the run dtype's) and an fp32 copy of its weight
    (4*V*h, once per micro-batch; none needed at ZeRO-0, whose weights are fp32: an upper bound there), and makes
    the logits in fp32 from the start, without the run-dtype logits beside their fp32 copy. A loss over tiles of
    both models' logits (divergence_tile, distill) saves no logits but a copy of the hidden states it projects, and
    holds two fp32 tiles, then the fp32 gradients of the hidden states and of the head's weight and their casts to the
    run's dtype (an upper bound: every token a target). An objective that reads
    statistics of the logits without a gradient (statistics_chunk_tokens) holds 12 bytes per token and vocabulary
    entry (the fp32 logits, and each logsumexp's) of one chunk of that many tokens at a time."""
    tokens, seq_len, a = inputs.tokens, inputs.seq_len, inputs.dtype_bytes
    layers, with_head, sequence_parallel = inputs.layers, inputs.with_head, inputs.sequence_parallel
    h, vocab = shape.hidden_size, shape.vocab_size
    per_layer = layer_bytes_per_token(shape, seq_len, a, inputs.attn_implementation, sequence_parallel,
                                      inputs.compiled)
    if per_layer is None:
        return None
    layers = shape.num_layers if layers is None else layers
    transient = 0.0
    if inputs.tiled_mlp and family_of(shape.model_type).activations == "llama" and not shape.num_experts:
        per_layer -= 4 * a * shape.intermediate_size
        rows = max(1, tokens * sequence_parallel // seq_len)
        transient = min(tokens, rows * h) * 4 * a * shape.intermediate_size
    head = inputs.head
    outside = outside_layers_bytes_per_token(shape, a) + 4 * vocab * head.entropy_gradient if with_head else 0.0
    if with_head and inputs.logits_tile_tokens:
        outside -= (a + 8) * vocab
        transient = max(transient, min(tokens, inputs.logits_tile_tokens) * (a + 4) * vocab)
    elif with_head and inputs.fused_loss:
        outside -= (a + 8) * vocab + 8  # and the loss's int64 targets; the gradient a*h takes the head input's place
        transient = max(transient, min(tokens, CHUNK_TOKENS) * 2 * a * vocab + (4 + a) * vocab * h)
    elif with_head and head.divergence_tile:
        rows, columns = head.divergence_tile
        outside -= (a + 8) * vocab + 8 - a * h  # no logits; the target tokens' hidden states copied for the loss
        transient = max(transient, 2 * min(tokens, rows) * columns * 4 + (4 + a) * (tokens + vocab) * h)
    if with_head and head.fp32_head and a < 4:
        outside += (4 - a) * h - a * vocab
        transient += 4 * vocab * h
    if with_head and inputs.statistics_chunk_tokens:
        transient += min(tokens, inputs.statistics_chunk_tokens) * 12 * vocab
    if layers:
        transient += tokens * all_to_all_bytes_per_token(shape, a, inputs.expert_parallel)
    on_device = 1 if inputs.offload_checkpoints and layers else layers
    checkpointed = on_device * a * h + (per_layer if layers else 0.0)
    return Activations(tokens * (layers * per_layer + outside) + transient,
                       tokens * (checkpointed + outside) + transient, tokens * (layers - on_device) * a * h)



def micro_batch_rows(recipe: Recipe) -> int:
    """The rows of a micro-batch at its largest: each example as many whole rows as its objective's spec says it
    takes at most (rows_per_example)."""
    return recipe.training.micro_batch_size * recipe.training.spec.rows_per_example



def activation_inputs(recipe: Recipe, precision: Precision, shape: ModelShape) -> ActivationInputs:
    """One micro-batch's activation inputs on a rank, from the recipe: its slice of the rows under sequence
    parallelism, the all-to-all buffers under expert parallelism, the layers compiled where the recipe compiles them
    (compile, as the plan resolved it; at_setting plans them eager under ZeRO-3), what the objective's spec says its
    loss adds at the head. Its arithmetic runs on a rank's share of the heads and the MLP width under tensor
    parallelism: activation_bytes(tensor_parallel_shard(shape, tp), inputs)."""
    seq_len, long_context, parallelism = recipe.data.seq_len, recipe.long_context, recipe.parallelism
    spec = recipe.training.spec
    return ActivationInputs(
        micro_batch_rows(recipe) * seq_len // parallelism.sequence_parallel, seq_len, DTYPES[precision].itemsize,
        recipe.model.attn_implementation, sequence_parallel=parallelism.sequence_parallel,
        tiled_mlp=long_context.tiled_mlp, logits_tile_tokens=long_context.logits_tile_tokens,
        offload_checkpoints=long_context.offload_checkpoints, expert_parallel=parallelism.expert_parallel,
        fused_loss=uses_fused_loss(recipe, router_loss=bool(shape.num_experts) and recipe.moe.aux_loss_coef != 0),
        compiled=recipe.compile is True,
        head=spec.head_traits(getattr(recipe, spec.name)) if spec.head_traits else HeadTraits(),
        statistics_chunk_tokens=spec.statistics_chunk_tokens)
