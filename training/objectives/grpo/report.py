"""GRPO's words: the dry run's lines (plan_lines: the batch, the loss, generation's memory and cost), a logged
step's console text (console_line) and the summary table's rows (summary_rows)."""
import torch

from training.config.precision import Precision
from training.loop.metrics import device_name
from training.objectives.grpo.loss import CLIPPED
from training.objectives.grpo.memory import decoding_reads, generation, reward_model_bytes, vllm_engine
from training.objectives.grpo.settings import loss_settings, steps_per_generation
from training.objectives.grpo.spec import GrpoSection
from training.objectives.reference import reference_place, synced_note
from training.planning.flops import flops_per_token, gpu_spec
from training.planning.plan import RunPlan
from training.planning.precision import weights_dtype
from training.planning.report import format_bytes


def plan_lines(plan: RunPlan) -> list[str]:
    """The batch in prompts and completions, and what generation adds: its memory (memory.py, generation) and
    its cost."""
    training, grpo, steps = plan.recipe.training, plan.recipe.grpo, steps_per_generation(plan.recipe)
    prompts = training.global_batch_size // grpo.num_generations
    per_rank = training.global_batch_size // plan.dims.dp_size * steps  # completions a rank generates at once
    memory = generation(plan.recipe, plan.precision, plan.shape, plan.zero_stage, plan.dims.dp_size)
    ignored = (f" (grpo.ds3_gather_for_generation is ZeRO-3's and does nothing at ZeRO-{plan.zero_stage})"
               if grpo.ds3_gather_for_generation else "")
    gathered = (pushed(plan, memory.gathered_weights) if grpo.engine == "vllm" else
                f"the rank's own full weights{ignored}" if plan.zero_stage != 3 else
                "ZeRO-3, gathered whole once per generation (grpo.ds3_gather_for_generation)"
                if grpo.ds3_gather_for_generation else
                "ZeRO-3: each layer's weights gathered for its forward pass, as in training (no full copy)")
    reference = ("none (beta 0)" if grpo.beta == 0 else "the base with the adapters disabled"
                 if plan.recipe.lora.enabled else reference_place(plan))
    if grpo.sync_ref_model:
        reference += synced_note(plan, grpo.ref_model_mixup_alpha, grpo.ref_model_sync_steps)
    return [f"batch: {prompts} prompts x {grpo.num_generations} generations = {training.global_batch_size} "
            f"completions per step; {training.micro_batch_size} completions/rank x {plan.accumulation_steps} "
            f"accumulation x {plan.dims.dp_size} data-parallel ranks, each a row of prompt + completion (at most "
            f"{plan.recipe.data.seq_len} tokens)",
            *loss_lines(grpo, steps),
            *([head_line(plan)] if grpo.cast_lm_head_to_fp32 else []),
            f"generation: {prompts * steps // plan.dims.dp_size} prompt(s) x {grpo.num_generations} per rank in one "
            f"batch{f' (grpo.generation_batch_size: {steps} optimizer steps)' if steps > 1 else ''}, "
            f"{sampling(grpo)}, up to {grpo.max_completion_length} decoding passes (new tokens), "
            f"{ENGINES[grpo.engine]} (grpo.generation_engine={grpo.generation_engine}); weights: "
            f"{gathered}; reference: {reference}",
            *(engine_lines(plan) if grpo.engine == "vllm" else [
              f"generation memory per rank, between the steps (in the memory table's peak where larger than the "
              f"activations): {format_bytes(memory.total)} = the larger of the prompts' pass "
            f"({format_bytes(memory.prefill)}) and the last decoding pass ({format_bytes(memory.decoding)}, of "
            f"which KV cache {format_bytes(memory.kv_cache)})"
            + (f" + the whole weights gathered ({format_bytes(memory.gathered_weights)})"
               if memory.gathered_weights else "")
            + (f"; or a reward model's pass over one group, if larger ({format_bytes(memory.scoring)})"
               if memory.scoring else "")]),
            *([f"reward models: a whole frozen copy on each rank, {format_bytes(models)} in the model states"]
              if (models := reward_model_bytes(plan.recipe, plan.precision)) else []),
            generation_cost(plan, per_rank)]


ENGINES = {"generate": "transformers' generate, its KV cache growing in each pass",
           "static": "transformers' generate with a static KV cache, allocated once at full length",
           "compiled": "transformers' generate with a static KV cache, each decoding pass compiled (CUDA graphs on a "
                       "GPU), the prompts padded to a power-of-two width",
           "vllm": "a vLLM server's continuous batching, one seeded request per completion (vllm_engine.py)"}


def pushed(plan: RunPlan, gathered: float) -> str:
    """The plan's words for the weights a vllm run samples from."""
    how = (f"ZeRO-3: gathered one module at a time on every rank, at most {format_bytes(gathered)} at once"
           if plan.zero_stage == 3 else "each module's from rank 0")
    lora = ", LoRA's adapters merged" if plan.recipe.lora.enabled else ""
    return f"pushed to the server before each generation that follows an optimizer step ({how}{lora})"


def engine_lines(plan: RunPlan) -> list[str]:
    """grpo.generation_engine=vllm's memory, on the ranks and in the server, and its weight pushes' traffic."""
    grpo, engine = plan.recipe.grpo, vllm_engine(plan.recipe, plan.precision, plan.shape)
    memory = generation(plan.recipe, plan.precision, plan.shape, plan.zero_stage, plan.dims.dp_size)
    on_ranks = (f"{format_bytes(memory.total)}: a push's gathered module" if memory.gathered_weights else "none")
    if memory.scoring:
        on_ranks += f"; a reward model's pass over one group, {format_bytes(memory.scoring)}"
    where = (f"at {grpo.vllm_server_host}:{grpo.vllm_server_port}, already running" if grpo.vllm_server_host else
             f"started by rank 0 from {grpo.vllm_environment} on port {grpo.vllm_server_port}")
    if engine.kv_cache is None:
        held = (f"{grpo.vllm_gpu_memory_utilization:g} of its GPU's memory (grpo.vllm_gpu_memory_utilization; on "
                f"rank 0's GPU unless it runs on GPUs of its own): the weights and the KV cache in the rest")
    else:
        fits = min(engine.concurrent, engine.completions)
        held = (f"{format_bytes(engine.weights + engine.kv_cache)} of host memory: the weights "
                f"({format_bytes(engine.weights)}) and a KV cache of {format_bytes(engine.kv_cache)} "
                f"(grpo.vllm_kv_cache_gib), room for {fits} of the generation's {engine.completions} completions at "
                f"full length at once ({format_bytes(engine.kv_per_completion)} each)"
                + ("" if fits == engine.completions else "; the others wait for room: raise grpo.vllm_kv_cache_gib"))
    per_step = 1 / (steps_per_generation(plan.recipe) * grpo.num_iterations)
    return [f"generation memory per rank: {on_ranks} (the vLLM server samples, beside the ranks)",
            f"vLLM server ({where}): {held}",
            f"weight push: {format_bytes(engine.push)} per push (rank 0 holds that copy on the host, writes it to "
            f"/dev/shm and the server reloads it), {per_step:g} push(es) per optimizer step: "
            f"{format_bytes(engine.push * per_step)} per step"]


def sampling(section: GrpoSection) -> str:
    """The plan's words for the sampling settings: the temperature, and those that are set (generation_kwargs'
    too)."""
    settings = {"top_k": section.top_k or None, "top_p": section.top_p if section.top_p < 1 else None,
                "min_p": section.min_p,
                "repetition_penalty": section.repetition_penalty if section.repetition_penalty != 1 else None}
    shown = ", ".join([*(f"{name} {value:g}" for name, value in settings.items() if value is not None),
                       *(f"{name} {value}" for name, value in
                         section.generation_kwargs.model_dump(exclude_defaults=True).items())])
    return f"sampled at temperature {section.temperature:g}" + (f" ({shown})" if shown else "")


def loss_lines(section: GrpoSection, steps: int = 1) -> list[str]:
    """The plan's lines on the loss: its type and settings, and a note where TRL warns of the combination."""
    settings = loss_settings(section)
    extras = [f"{settings.importance_sampling_level}-level ratio"]
    if settings.delta is not None:
        extras.append(f"delta {settings.delta:g}" if settings.loss_type in CLIPPED else
                      f"delta unused by {settings.loss_type}")
    extras.append(f"rewards {section.multi_objective_aggregation}" if section.multi_objective_aggregation ==
                  "normalize_then_sum" else f"scale_rewards {section.scale_rewards}")
    extras += [text for setting, text in (
        (settings.off_policy_mask_threshold, f"off-policy mask above KL {settings.off_policy_mask_threshold}"),
        (settings.top_entropy_quantile < 1, f"top {settings.top_entropy_quantile:g} of tokens by entropy"),
        (settings.entropy_coef and not section.use_adaptive_entropy, f"entropy bonus {settings.entropy_coef:g}"),
        (section.use_adaptive_entropy,
         f"adaptive entropy bonus from {settings.entropy_coef:g}, +/-{section.entropy_coef_delta:g} within "
         f"[{section.entropy_coef_min:g}, {section.entropy_coef_max:g}] by the entropy against "
         f"{section.entropy_target:g}"),
        (settings.beta and not settings.use_bias_correction_kl, "KL without the ratio")) if setting]
    lines = [f"GRPO: loss {settings.loss_type} ({', '.join(extras)}), beta {settings.beta:g}, epsilon "
             f"{settings.epsilon_low:g}/{settings.epsilon_high:g}, {steps * section.num_iterations} step(s) per "
             f"generation; rewards: " + ", ".join(f"{spec.function or spec.model} x {spec.weight:g}"
                                                   for spec in section.rewards)]
    level = settings.importance_sampling_level
    if settings.loss_type == "luspo" and level == "token":
        lines.append("note (TRL warns alike): luspo is meant with importance_sampling_level=sequence, GSPO's ratio")
    elif settings.loss_type == "vespo" and level == "sequence":
        lines.append("note (TRL warns alike): vespo weighs each sequence's whole ratio itself; keep "
                     "importance_sampling_level=token")
    elif level == "sequence" and settings.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        lines.append(f"note (TRL warns alike): {settings.loss_type} sums per-token losses, so a sequence-level ratio "
                     f"does not optimize the per-sequence objective; GSPO is loss_type=grpo with "
                     f"importance_sampling_level=sequence")
    return lines


def generation_cost(plan: RunPlan, completions: int) -> str:
    """What generating a generation's `completions` per rank (a step's, or generation_batch_size's) costs beside
    training on them: its FLOPs (2N per prompt and completion token, against training's) and the weights each
    decoding pass reads, which under ZeRO-3 it gathers from the ranks every pass (decoding is bound by memory and,
    there, by the network, not by FLOPs); on a GPU of flops.py's table, the least time that takes (generation_floor)."""
    shape, section, seq_len = plan.shape, plan.recipe.grpo, plan.recipe.data.seq_len
    steps = steps_per_generation(plan.recipe)
    when = "step" if steps == 1 else f"generation ({steps} steps)"
    training_flops = flops_per_token(shape, seq_len, plan.recipe.activation_checkpointing)[0]
    flops = 2 * shape.matmul_parameters * completions * seq_len
    weights = shape.parameters * weights_dtype(plan.precision, plan.zero_stage).itemsize
    passes = section.max_completion_length
    gathered = "" if plan.zero_stage != 3 or section.engine == "vllm" else (
        f"; under ZeRO-3 gathered once per generation ({format_bytes(weights)}, held whole on each rank while it "
        f"generates)" if section.ds3_gather_for_generation else
        f"; under ZeRO-3 every pass gathers them: {format_bytes(passes * weights)} gathered per {when} "
        f"(grpo.ds3_gather_for_generation: once, holding them whole)")
    share = 2 * shape.matmul_parameters / training_flops
    return (f"generation cost per {when} and rank: {flops:.3e} FLOPs at most ({share:.0%} of training on the same "
            f"tokens), in {passes} decoding passes{' in the vLLM server' if section.engine == 'vllm' else ''} "
            f"that each read the weights "
            f"({format_bytes(weights)}){gathered}{generation_floor(plan, completions, flops)}")


def generation_floor(plan: RunPlan, completions: int, flops: float) -> str:
    """'; at least T s on <GPU>' where this machine's GPU is in flops.py's table: the generation's FLOPs at the GPU's
    bf16 peak, or what its decoding passes read (memory.py, decoding_reads: the weights every pass and the KV
    cache so far) at the GPU's memory bandwidth, whichever takes longer. A floor that a decoder at full bandwidth (vLLM)
    approaches; transformers' generate adds its per-pass overheads, which the logged generation_time_s measures
    (benchmarks/generation_batch.py measures both against the batch). ZeRO-3's gathers are not in it."""
    name = device_name()
    spec = gpu_spec(name)
    if spec is None:
        return ""
    passes = plan.recipe.grpo.max_completion_length
    reads = decoding_reads(plan.shape, weights_dtype(plan.precision, plan.zero_stage).itemsize, completions,
                           plan.recipe.data.seq_len - passes, passes)
    compute, memory = flops / (spec.peak_tflops * 1e12), reads / spec.bandwidth
    bound = f"{format_bytes(reads)} read at {spec.bandwidth / 1e12:g} TB/s" if memory >= compute else \
        f"at {spec.peak_tflops:g} TFLOP/s"
    return (f"; at least {max(memory, compute):.3g} s on {name} ({bound}; transformers' generate takes "
            f"longer, and the metrics' generation_time_s says how much)")


def head_line(plan: RunPlan) -> str:
    """The plan's words for grpo.cast_lm_head_to_fp32: what it changes, and its weight's fp32 copy."""
    if plan.precision == Precision.FP32:
        return "LM head in fp32 (grpo.cast_lm_head_to_fp32): already so, the run computes in fp32"
    said = "LM head in fp32 (grpo.cast_lm_head_to_fp32): the logits of the policy, the reference and sampling in fp32"
    if weights_dtype(plan.precision, plan.zero_stage) == torch.float32:
        return f"{said}, the head outside ZeRO-0's autocast"
    copy = 4 * plan.shape.vocab_size * plan.shape.hidden_size
    return f"{said}, from an fp32 copy of its weight made in each forward pass ({format_bytes(copy)})"


def console_line(record: dict) -> str:
    return (f"  reward {record['reward']:.3f} (std {record['reward_std']:.3f})  completion length "
            f"{record['completions/mean_length']:.1f}" + (f"  kl {record['kl']:.4f}" if "kl" in record else "")
            + f"  generation {record['generation_time_s'] / record['step_time_s']:.0%} of the step"
            + (f"  eval reward {record['eval_reward']:.3f}" if "eval_reward" in record else ""))


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    rows = [("GRPO reward (first -> last logged)", f"{summary['first_reward']:.3f} -> {summary['reward']:.3f}")] \
        if "first_reward" in summary and "reward" in summary else []
    rows += [("GRPO generation time per step (last logged)", f"{summary['generation_time_s']:.2f} s")] \
        if "generation_time_s" in summary else []
    return rows + ([("GRPO eval reward (last evaluation)", f"{summary['eval_reward']:.3f}")]
                   if "eval_reward" in summary else [])
