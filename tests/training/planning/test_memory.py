import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from training.objectives.spec import HeadTraits
from training.planning.activations import ActivationInputs, activation_bytes, layer_bytes_per_token
from training.planning.ds_config import zero_setting
from training.planning.model_states import fp32_zero_states, gradient_bucket_bytes, model_states, zero_arithmetic
from training.planning.shape import model_shape

# Shapes unlike the ones the rules were read from: GQA, a head_dim that is not hidden/heads, odd widths.
CONFIGS = {
    "llama": dict(hidden_size=192, intermediate_size=384, num_attention_heads=6, num_key_value_heads=2,
                  vocab_size=700),
    "mistral": dict(hidden_size=128, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=48, vocab_size=500),
    "qwen3": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=40, vocab_size=600),
    "mixtral": dict(hidden_size=128, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2, head_dim=40,
                    vocab_size=600, num_local_experts=6, num_experts_per_tok=2),
    "qwen3_moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=40, vocab_size=600, num_experts=8, num_experts_per_tok=3),
    "gpt2": dict(n_embd=160, n_head=5, vocab_size=900, n_positions=512, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0),
}
LAYERS, BATCH, SEQ_LEN = 3, 2, 96


def saved_activation_bytes(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for the backward pass, each storage once, weights excluded."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()  # the tensor itself would keep its own graph alive from C++, out of gc's reach

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=input_ids, labels=input_ids, position_ids=position_ids)
    return sum(storages.values())


def measure(model_type: str, dtype: torch.dtype, checkpointing: bool, tiling=None, fused_loss: bool = False,
            compiled: bool = False, documents: int = 2, fp32_head: bool = False):
    layers_key = "n_layer" if model_type == "gpt2" else "num_hidden_layers"
    config = AutoConfig.for_model(model_type, **CONFIGS[model_type], **{layers_key: LAYERS})
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).train()
    if tiling:
        from training.models.long_context import apply_long_context
        apply_long_context(model, tiling)
    if fused_loss:
        from training.models.fused_loss import fuse_head_and_loss
        fuse_head_and_loss(model)
    if fp32_head:
        from training.models.model import cast_lm_head_to_fp32
        cast_lm_head_to_fp32(model)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if compiled:  # the min-cut partitioner inductor uses, without generating code
        from training.models.compile import compile_layers
        torch._dynamo.reset()
        compile_layers(model, backend="aot_eager_decomp_partition")
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQ_LEN))
    position_ids = (torch.cat([torch.arange(40), torch.arange(SEQ_LEN - 40)]) if documents == 2  # two documents
                    else torch.arange(SEQ_LEN)).repeat(BATCH, 1)
    return model_shape(config), saved_activation_bytes(model, input_ids, position_ids)


@pytest.mark.parametrize("model_type", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_rule_matches_the_saved_tensors(model_type, dtype):
    shape, measured = measure(model_type, dtype, checkpointing=False)
    tokens, size = BATCH * SEQ_LEN, dtype.itemsize
    estimate = activation_bytes(shape, ActivationInputs(tokens, SEQ_LEN, size, "sdpa")).without_checkpointing
    logits_transient = tokens * (size + 4) * shape.vocab_size  # in the peak, never saved for backward
    assert estimate - logits_transient == pytest.approx(measured, rel=0.005)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_the_fp32_head_rule_matches_the_saved_tensors(model_type):
    """grpo.cast_lm_head_to_fp32 in bf16: the head saves its input in fp32 in place of bf16, and the fp32 copy of its
    weight; its logits are fp32 from the start (the transient: no bf16 logits beside their fp32 copy)."""
    shape, measured = measure(model_type, torch.bfloat16, checkpointing=False, fp32_head=True)
    tokens = BATCH * SEQ_LEN
    inputs = ActivationInputs(tokens, SEQ_LEN, 2, "sdpa", head=HeadTraits(fp32_head=True))
    estimate = activation_bytes(shape, inputs).without_checkpointing
    logits_transient = tokens * 4 * shape.vocab_size
    assert estimate - logits_transient == pytest.approx(measured, rel=0.005)
    _, without = measure(model_type, torch.bfloat16, checkpointing=False)
    assert measured - without == tokens * 2 * shape.hidden_size + 4 * shape.vocab_size * shape.hidden_size


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_checkpointing_keeps_only_layer_inputs(model_type):
    shape, measured = measure(model_type, torch.bfloat16, checkpointing=True)
    tokens = BATCH * SEQ_LEN
    estimate = activation_bytes(shape, ActivationInputs(tokens, SEQ_LEN, 2, "sdpa")).with_checkpointing
    recomputed_layer = tokens * layer_bytes_per_token(shape, SEQ_LEN, 2, "sdpa")  # live during its backward only
    logits_transient = tokens * 6 * shape.vocab_size
    assert estimate - recomputed_layer - logits_transient == pytest.approx(measured, rel=0.03)
    _, without = measure(model_type, torch.bfloat16, checkpointing=False)
    assert measured < without / 2


def test_zero_arithmetic_shards_what_each_stage_shards():
    params, ranks = 1_000, 4
    assert zero_arithmetic(params, 0, ranks, "bf16") == 16_000
    # under ZeRO, the fp32 gradient partition the optimizer steps from (4 bytes) too: 20.0 bytes/parameter measured
    # at bf16 ZeRO-1 on one H200 (benchmarks/results/gpu_validate_nvidia_h200/bf16-noac-zero1_summary.json)
    assert zero_arithmetic(params, 1, ranks, "bf16") == 4_000 + 16_000 / 4
    assert zero_arithmetic(params, 2, ranks, "bf16") == 2_000 + 18_000 / 4
    assert zero_arithmetic(params, 3, ranks, "bf16") == 20_000 / 4
    assert zero_arithmetic(params, 0, ranks, "fp32") == 16_000
    # fp32 ZeRO-2/3 also clone their partition of the weights as the master copy (4): DeepSpeed does in every precision
    assert zero_arithmetic(params, 2, ranks, "fp32") == 4_000 + 20_000 / 4
    assert zero_arithmetic(params, 3, ranks, "fp32") == 24_000 / 4


def test_model_states_use_deepspeeds_estimators_for_zero_2_and_3():
    shape = model_shape(AutoConfig.from_pretrained("recipes/tiny_llama/config.json"))
    zero2 = model_states("2", shape, 8, 1, "bf16", zero_init=False)
    assert zero2.source == "DeepSpeed estimator"
    assert zero2.device_bytes == 2 * shape.parameters + int(18 * shape.parameters / 8)  # its documented formula
    offloaded = model_states("3_offload", shape, 8, 1, "bf16", zero_init=True)
    assert offloaded.device_bytes < model_states("3", shape, 8, 1, "bf16", zero_init=True).device_bytes
    assert offloaded.host_bytes > 0
    assert model_states("1", shape, 8, 1, "bf16", zero_init=False).source == "ZeRO arithmetic"


@pytest.mark.parametrize("name, expected", [("zero1", "1"), ("zero3", "3"), ("zero2_offload", "2_offload"),
                                            ("zero3_offload", "3_offload")])
def test_zero_setting_of_the_shipped_configs(name, expected):
    import json
    assert zero_setting(json.loads(open(f"ds_configs/{name}.json").read())) == expected


@pytest.mark.parametrize("tiled_mlp, logits_tile_tokens", [(True, None), (False, 64), (True, 64)])
def test_tiling_rules_match_the_saved_tensors(tiled_mlp, logits_tile_tokens):
    """training/models/long_context.py's tiles: the MLPs' and the head's wide activations are no longer saved; one
    tile's are live at a time."""
    from training.config.sections import LongContextSection
    section = LongContextSection(tiled_mlp=tiled_mlp, logits_tile_tokens=logits_tile_tokens)
    shape, measured = measure("llama", torch.bfloat16, checkpointing=False, tiling=section)
    tokens, a, vocab = BATCH * SEQ_LEN, 2, shape.vocab_size
    estimate = activation_bytes(shape, ActivationInputs(tokens, SEQ_LEN, a, "sdpa", tiled_mlp=tiled_mlp,
                                                         logits_tile_tokens=logits_tile_tokens)).without_checkpointing
    mlp_tile = min(tokens, BATCH * shape.hidden_size) * 4 * a * shape.intermediate_size if tiled_mlp else 0
    logits = min(tokens, logits_tile_tokens or tokens) * (a + 4) * vocab
    transient = max(mlp_tile, logits) if logits_tile_tokens else mlp_tile + logits
    # sequence_tiled_compute keeps its inputs (the head's input and the labels) on its context object, out of
    # the saved-tensor hooks' sight: added to the measurement
    held = tokens * (a * shape.hidden_size + 8) if logits_tile_tokens else 0
    assert estimate - transient == pytest.approx(measured + held, rel=0.005)


def test_the_fused_loss_saves_gigabytes_on_a_large_vocabulary():
    """The 1.24B Llama of benchmarks/llama_1b (vocabulary 128,256) at 4 rows of 2,048 tokens in bf16: the plan
    drops the whole logits (2 + 8 bytes x vocabulary per token) for one chunk's and the head's weight gradient."""
    shape = model_shape(AutoConfig.from_pretrained("benchmarks/llama_1b/config.json"))
    plain, fused = (activation_bytes(shape, ActivationInputs(4 * 2048, 2048, 2, "flex_attention", fused_loss=fused))
                    .without_checkpointing for fused in (False, True))
    assert (plain - fused) / 2**30 == pytest.approx(7.34, abs=0.01)  # 9.79 GiB of logits less 0.98 + 1.47


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_the_fused_loss_rule_matches_the_saved_tensors(model_type):
    """training/models/fused_loss.py saves no logits; it keeps the hidden states' gradient on its context, out of the
    saved-tensor hooks' sight (added to the measurement), in place of the head's saved input. One chunk's logits and
    the head's weight gradient are live at a time."""
    from training.planning.kernels import CHUNK_TOKENS
    shape, measured = measure(model_type, torch.bfloat16, checkpointing=False, fused_loss=True)
    tokens, a, vocab, hidden = BATCH * SEQ_LEN, 2, shape.vocab_size, shape.hidden_size
    estimate = activation_bytes(shape, ActivationInputs(tokens, SEQ_LEN, a, "sdpa", fused_loss=True)
                                ).without_checkpointing
    transient = min(tokens, CHUNK_TOKENS) * 2 * a * vocab + (4 + a) * vocab * hidden
    held = tokens * a * hidden
    assert estimate - transient == pytest.approx(measured + held, rel=0.005)


@pytest.mark.slow
@pytest.mark.parametrize("model_type, dtype", [("llama", torch.bfloat16), ("mistral", torch.bfloat16),
                                               ("qwen3", torch.bfloat16), ("llama", torch.float32)])
def test_the_compiled_layer_rule_matches_the_saved_tensors(model_type, dtype):
    """Layers compiled as training/models/compile.py compiles them, through AOTAutograd's min-cut partitioner (what
    inductor partitions with; dynamo's aot_eager_decomp_partition backend runs it without generating code)."""
    shape, measured = measure(model_type, dtype, checkpointing=False, compiled=True)
    tokens, size = BATCH * SEQ_LEN, dtype.itemsize
    estimate = activation_bytes(shape, ActivationInputs(tokens, SEQ_LEN, size, "sdpa", compiled=True)
                                ).without_checkpointing
    logits_transient = tokens * (size + 4) * shape.vocab_size
    assert estimate - logits_transient == pytest.approx(measured, rel=0.005)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3"])
def test_the_flex_attention_rule_matches_sdpas_saved_tensors_without_a_mask(model_type):
    """FlexAttention has no backward pass on a CPU; it saves what sdpa saves where transformers needs no mask (rows
    of one document): queries, keys and values with grouped heads at their own width, the output and a log-sum-exp
    per head, and no mask."""
    shape, measured = measure(model_type, torch.bfloat16, checkpointing=False, documents=1)
    tokens = BATCH * SEQ_LEN
    estimate = activation_bytes(shape, ActivationInputs(tokens, SEQ_LEN, 2, "flex_attention")).without_checkpointing
    assert estimate - tokens * 6 * shape.vocab_size == pytest.approx(measured, rel=0.005)


def test_fp32_zero_states_follow_deepspeeds_layout():
    """Two groups, one of a 6 x 4 matrix and a 2 x 4 one (32 values), one of a vector of 6, on 2 ranks. ZeRO-1/2:
    the groups pad to 32 and 8 (multiples of 2 x ranks), so each rank's partition is 16 + 4 master values; rank 0 holds
    16 of the 6 x 4 matrix's values and 4 of the vector's, rank 1 the rest of both and the 2 x 4 matrix: its
    contiguous gradient buffer takes those weights whole, 24 + 8 + 6 = 38 values (the busiest rank); the step's fp32
    gradient copy is one group's, 16. ZeRO-3: pieces of 12 + 4 and 3 values, as weights, gradients and master copy,
    the copy 16."""
    groups, params = (((6, 4), (2, 4)), ((6,),)), 38
    states = 8 * params / 2  # AdamW's, sharded
    zero2 = 4 * (params + (16 + 4) + 38 + 16) + states
    assert fp32_zero_states(groups, 2, 2) == zero2
    assert fp32_zero_states(groups, 1, 2) == max(zero2, 4 * (2 * params + 20) + states)  # whole gradients, backward
    assert fp32_zero_states(groups, 3, 2) == 4 * (3 * (12 + 4 + 3) + 16) + states
    assert fp32_zero_states(groups, 2, 2, state_bytes=4) == zero2 - 4 * params / 2  # Lion's one momentum
    assert fp32_zero_states((((6, 4),),), 2, 2) == 4 * (24 + 12 + 24 + 12) + 8 * 24 / 2  # one group: 12 each


def zero(stage: int, **keys) -> dict:
    return {"zero_optimization": {"stage": stage, **keys}, "data_types": {"grad_accum_dtype": "fp32"}}


def test_gradient_buckets_take_the_resolved_configs_values():
    """reduce_bucket_size elements per bucket: ZeRO-1/2 one, two with overlap_comm, in the weights' dtype (ZeRO-1: the
    fp32 gradient-accumulation dtype); ZeRO-3 one, in the communication dtype; none without contiguous_gradients or
    at ZeRO-0. Unset keys are DeepSpeed's defaults: 5e8 elements, overlap_comm at ZeRO-3 only."""
    size = 1000
    assert gradient_bucket_bytes(zero(0, reduce_bucket_size=size), "fp32") == 0
    assert gradient_bucket_bytes(zero(1, reduce_bucket_size=size), "bf16") == size * 4
    assert gradient_bucket_bytes(zero(2, reduce_bucket_size=size), "bf16") == size * 2
    assert gradient_bucket_bytes(zero(2, reduce_bucket_size=size, overlap_comm=True), "fp32") == 2 * size * 4
    assert gradient_bucket_bytes(zero(2, reduce_bucket_size=size, contiguous_gradients=False), "fp32") == 0
    assert gradient_bucket_bytes(zero(3, reduce_bucket_size=size, overlap_comm=True), "bf16") == size * 2
    assert gradient_bucket_bytes({**zero(3, reduce_bucket_size=size), "communication_data_type": "fp32"},
                                 "bf16") == size * 4
    assert gradient_bucket_bytes(zero(2), "fp32") == 5e8 * 4 and gradient_bucket_bytes(zero(3), "fp32") == 5e8 * 4


def test_the_run_plans_the_buckets_of_its_own_config():
    """ZeRO-2 with tiny_llama (hidden 256): the shipped zero2.json's "auto" is 256^2 elements, doubled by its
    overlap_comm, in fp32; a recipe's deepspeed.overrides of the bucket size and overlap_comm change the run's plan,
    and the table row of its setting, by exactly the buckets' difference."""
    import train
    from training.planning.memory import planned_model_states, states_per_setting
    from training.planning.plan import Machine

    def plan(*overrides):
        args = train.parse_args(["--recipe", "tiny_llama", "--dry-run", "precision=fp32", "deepspeed.config=zero2",
                                 *overrides])
        return train.make_plan(args, world_size=2)

    shipped, own = plan(), plan("deepspeed.overrides={zero_optimization: {reduce_bucket_size: 1000000, "
                                "overlap_comm: false}}")
    assert gradient_bucket_bytes(shipped.ds_config, "fp32") == 2 * 256**2 * 4
    difference = 1_000_000 * 4 - 2 * 256**2 * 4
    assert planned_model_states(own).device_bytes - planned_model_states(shipped).device_bytes == difference
    machine = Machine(2, 1, 2**34, "test")
    rows = {name: states_per_setting(p.recipe, "fp32", p.shape, machine, p.ds_config) for name, p in
            (("shipped", shipped), ("own", own))}
    assert rows["own"]["2"].device_bytes - rows["shipped"]["2"].device_bytes == difference
    assert rows["own"]["3"] == rows["shipped"]["3"]  # another setting's row: its shipped file's buckets


def test_whole_gradients_grow_as_the_activations_are_freed():
    """At ZeRO-0 and (16-bit) ZeRO-1 autograd makes the whole gradients in the backward pass while the saved
    activations are freed: the peak is the model states plus the activations beyond those gradients."""
    from training.planning.model_states import ModelStates, whole_gradient_bytes
    assert [whole_gradient_bytes(1000, stage, "bf16") for stage in range(4)] == [4000, 2000, 0, 0]
    assert [whole_gradient_bytes(1000, stage, "fp32") for stage in range(4)] == [4000, 0, 0, 0]
    states = ModelStates(20_000, 0.0, "ZeRO arithmetic", made_in_backward=2000)
    assert states.peak_with(5000) == 23_000 and states.peak_with(1500) == 20_000
    shape = model_shape(AutoConfig.from_pretrained("recipes/tiny_llama/config.json"))
    assert model_states("1", shape, 1, 1, "bf16", zero_init=False).made_in_backward == 2 * shape.parameters
    assert model_states("2", shape, 8, 1, "bf16", zero_init=False).made_in_backward == 0


def allocated_peak(run) -> int:
    """The most bytes CPU tensors held at once, beyond those alive before, while `run` ran: the running sum of the
    profiler's allocation events (kineto's records, in time order)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    events = sorted((event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"),
                    key=lambda event: event.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


SAMPLING = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=8000)  # the logits the most


@pytest.mark.parametrize("shape_of, dtype, seq_len, completion, sampling", [
    (dict(num_hidden_layers=6, hidden_size=128, intermediate_size=256, vocab_size=256), torch.float32, 80, 64, {}),
    (dict(num_hidden_layers=6, hidden_size=128, intermediate_size=256, vocab_size=256), torch.bfloat16, 80, 64, {}),
    (SAMPLING, torch.float32, 32, 16, {"top_p": 0.9}),
    (SAMPLING, torch.float32, 32, 16, {"top_k": 50, "min_p": 0.05, "repetition_penalty": 1.2}),  # none of them
    # raises the peak (measured one by one too): top_p's sort does
    (SAMPLING, torch.float32, 32, 16, {"top_k": 50, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.2}),
    (dict(num_hidden_layers=2, hidden_size=512, intermediate_size=2048, vocab_size=256), torch.float32, 204, 4, {}),
    (SAMPLING, torch.bfloat16, 32, 16, {"cast_lm_head_to_fp32": True}),  # the head's fp32 copy the most
    *((SAMPLING, torch.float32, 32, 16, {f"generation_kwargs.{key}": value for key, value in settings.items()})
      for settings in ({"typical_p": 0.9, "top_h": 0.5, "epsilon_cutoff": 1e-4, "eta_cutoff": 1e-4,
                        "sequence_bias": [[[5, 6], -2.0]]},  # typical_p's buffers the most, and a processor's
                       {"eta_cutoff": 1e-4, "suppress_tokens": [5, 6], "min_new_tokens": 4,
                        "no_repeat_ngram_size": 2, "bad_words_ids": [[5, 6]]})),
], ids=["kv-cache", "kv-cache-bf16", "sampling-top-p", "sampling-top-k-min-p-penalty",
        "sampling-every-setting", "prefill", "fp32-head", "generation-kwargs-typical", "generation-kwargs-eta"])
@pytest.mark.parametrize("engine", ["generate", "static"])
def test_the_generation_rule_matches_the_allocations(tmp_path, shape_of, dtype, seq_len, completion, sampling, engine):
    """A GRPO generation's memory (grpo/memory.py, generation) against what generate allocates on CPU, with
    prompts at the budget and no completion ending early: a bound within 10% where the KV cache, the sampling's
    buffers over a large vocabulary (with every sampling setting), or the prompts' pass is the most; with either
    engine's KV cache (generation_engine)."""
    from tests.conftest import save_small_checkpoint
    from training.config.recipe import load_recipe
    from training.objectives.grpo.memory import generation
    from training.objectives.grpo.sampling import sample
    config = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2, **shape_of)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()
    if sampling.get("cast_lm_head_to_fp32"):
        from training.models.model import cast_lm_head_to_fp32
        cast_lm_head_to_fp32(model)
    save_small_checkpoint(tmp_path / "base")
    completions = 8
    recipe = load_recipe("tiny_llama_grpo", [
        f"model.name_or_path={tmp_path / 'base'}", f"training.global_batch_size={completions}",
        f"training.micro_batch_size={completions}", f"data.seq_len={seq_len}",
        f"grpo.max_completion_length={completion}", f"grpo.generation_engine={engine}",
        *(f"grpo.{key}={value}" for key, value in sampling.items())])
    prompts = [torch.randint(3, config.vocab_size, (seq_len - completion,)) for _ in range(completions)]
    never = config.vocab_size  # no token ends a completion early
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a CPU's bf16 matmuls on several threads allocate buffers per thread (1.8% more at 2),
    try:  # which a GPU has not: the rule counts one thread's
        measured = allocated_peak(lambda: sample(model, prompts, list(range(completions)), recipe.grpo, never, 0,
                                                 False))
    finally:
        torch.set_num_threads(threads)
    planned = generation(recipe, "fp32" if dtype == torch.float32 else "bf16", model_shape(config), 1, 1)
    assert measured <= planned.total <= 1.1 * measured, (measured, planned)


@pytest.mark.slow  # compiling the decoding pass takes about 6 s on 2 cores, beyond the fast tier's share
def test_the_generation_rule_matches_compiled_decodings_allocations(tmp_path):
    """The same rule for the compiled engine, whose prompts (14 tokens here) are padded to a power-of-two width (16):
    its KV cache and prompts' pass are the static engine's at that width, with every sampling setting."""
    test_the_generation_rule_matches_the_allocations(tmp_path, SAMPLING, torch.float32, 30, 16, {
        "top_k": 50, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.2}, "compiled")


def test_the_entropy_bonus_keeps_what_the_plan_adds():
    """GRPO's entropy bonus takes the entropies' gradient: autograd keeps the fp32 probabilities beside the
    log-probabilities, one more [tokens, vocabulary] fp32 tensor, which activation_bytes adds
    (HeadTraits.entropy_gradient)."""
    from training.objectives.grpo.loss import token_logps

    def saved(entropy_gradient: bool) -> int:
        storages = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor.detach()

        logits = torch.randn(BATCH, SEQ_LEN, CONFIGS["llama"]["vocab_size"], dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            token_logps(logits, torch.zeros(BATCH, SEQ_LEN, dtype=torch.long), 0.7, entropy_gradient)
        return sum(storages.values())

    shape = model_shape(AutoConfig.for_model("llama", **CONFIGS["llama"], num_hidden_layers=LAYERS))
    planned = [activation_bytes(shape, ActivationInputs(BATCH * SEQ_LEN, SEQ_LEN, 2, "sdpa",
                                                        head=HeadTraits(entropy_gradient=entropy_gradient)))
               .without_checkpointing for entropy_gradient in (False, True)]
    assert planned[1] - planned[0] == saved(True) - saved(False) == BATCH * SEQ_LEN * shape.vocab_size * 4


@pytest.mark.parametrize("tokens", [300, 1500])
@pytest.mark.parametrize("weighting", [False, True])
def test_the_dpo_token_statistics_take_what_the_plan_adds(tokens, weighting):
    """DPO's token statistics (TRL's token metrics, and with use_weighting WPO's weights), computed without a gradient
    a chunk at a time, allocate what activation_bytes (statistics_chunk_tokens) adds to the transient, within 1% (one
    chunk, or the whole batch when smaller)."""
    from training.objectives.dpo.loss import token_statistics
    from training.objectives.dpo.spec import DPO_CHUNK_TOKENS
    shape = model_shape(AutoConfig.for_model("llama", **CONFIGS["llama"], num_hidden_layers=LAYERS))
    logits = torch.randn(1, tokens + 1, shape.vocab_size, dtype=torch.bfloat16)
    labels, owners = torch.randint(0, shape.vocab_size, (1, tokens + 1)), torch.zeros(1, tokens + 1, dtype=torch.long)
    measured = allocated_peak(lambda: token_statistics(logits, labels, owners, torch.tensor([float(tokens)]),
                                                       weighting))
    planned = [activation_bytes(shape, ActivationInputs(tokens, SEQ_LEN, 2, "sdpa", statistics_chunk_tokens=chunk))
               .without_checkpointing for chunk in (0, DPO_CHUNK_TOKENS)]
    assert planned[1] - planned[0] == pytest.approx(measured, rel=0.01)


def test_a_reward_models_weights_and_pass_are_what_the_plan_counts(tmp_path):
    """GRPO's reward model (grpo.rewards' model): its weights per rank are the loaded classifier's parameters in the
    run's dtype (reward_model_bytes), and its pass over one group of seq_len-token sequences (Generation.scoring) a
    bound within 10% of what scoring allocates on CPU."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tests.conftest import REPO, save_small_checkpoint
    from training.config.recipe import load_recipe
    from training.objectives.grpo.memory import generation, reward_model_bytes
    from training.objectives.grpo.rewards import RewardModel
    group, seq_len = 8, 128
    config = AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=256, intermediate_size=1024,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=4096, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "judge")
    AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer").save_pretrained(tmp_path / "judge")
    save_small_checkpoint(tmp_path / "base")
    recipe = load_recipe("tiny_llama_grpo", [
        f"model.name_or_path={tmp_path / 'base'}", f"grpo.num_generations={group}", f"data.seq_len={seq_len}",
        f"training.global_batch_size={group}", f"training.micro_batch_size={group}", "grpo.max_completion_length=64",
        f"grpo.rewards=[{{model: {tmp_path / 'judge'}}}]"])
    judge = RewardModel(str(tmp_path / "judge"), group, torch.device("cpu"), torch.float32, False, {})
    assert reward_model_bytes(recipe, "fp32") == 4 * sum(p.numel() for p in judge.model.parameters())
    assert reward_model_bytes(recipe, "bf16") == 2 * sum(p.numel() for p in judge.model.parameters())
    prompts, completions = [" a" * 64] * group, [" a" * (seq_len - 64)] * group  # one token each: seq_len in all
    measured = allocated_peak(lambda: judge(prompts, completions))
    planned = generation(recipe, "fp32", model_shape(AutoConfig.from_pretrained(tmp_path / "base")), 1, 1).scoring
    assert measured <= planned <= 1.1 * measured, (measured, planned)
