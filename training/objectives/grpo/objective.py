"""training.objective=grpo: online RL with verifiable rewards (GRPO and TRL's kin of it: Dr. GRPO, DAPO, BNPO, CISPO,
SAPO, LUSPO, VESPO, GSPO's sequence-level ratio, GDPO's rewards), TRL's GRPOTrainer in this loop: the same DeepSpeed
engine, gradient accumulation and ZeRO stages as the language model's loss.

A step: the rank's prompts (data_pipeline/loader.py PromptBatches) are sampled num_generations times each with
transformers' `generate` on the current weights, all of the rank's completions in one batch (under ZeRO-3 each
layer's weights are gathered as its forward pass needs them, as the training step does: no second full copy, every
rank stepping together, `synced_gpus`; with grpo.ds3_gather_for_generation the whole weights once per generation;
eagerly and with sdpa: `decoding`). With grpo.generation_batch_size a generation samples the prompts of several
steps at once, and each step trains on its own share of it. Each completion draws from a random stream of its own,
seeded by (training.seed, the generation, the prompt's row, its index in the group) (SeededSampling), so the
completions are the same under any layout and after a resume. The reward functions score them (rewards.py), the
rewards of the whole generation make each group's advantages (grpo_loss.py), and the completions, each after its
prompt, one per row or packed whole into rows (completion_rows), are the steps' micro-batches. Their loss is
grpo_loss's, on the completions' own layout (unpack), with the old log-probabilities kept from the generation when
the policy moves before their last use (num_iterations > 1, or several steps per generation) and the reference's
when beta > 0 (LoRA: the base with the adapters disabled; else the starting checkpoint, loaded again, frozen: a full
copy per rank at ZeRO 0-2, partitioned over the ranks under ZeRO-3, reference.py; with sync_ref_model mixed with the
policy as the run goes).
Evaluation samples the held-out prompts alike and scores them (evaluate).
"""
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import fields, replace
from pathlib import Path
from typing import NamedTuple

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from transformers import (EpsilonLogitsWarper, EtaLogitsWarper, GenerationConfig, LogitsProcessor, LogitsProcessorList,
                          MinPLogitsWarper, PretrainedConfig, PreTrainedTokenizerBase, RepetitionPenaltyLogitsProcessor,
                          StoppingCriteria, StoppingCriteriaList, StopStringCriteria, TemperatureLogitsWarper,
                          TopHLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, TrainerState, TypicalLogitsWarper)

from data_pipeline.loader import EvalPromptBatches, PromptBatches
from data_pipeline.pack import best_fit_decreasing
from data_pipeline.prepare import pad_token_id
from training.base.errors import ConfigError, DataError
from training.base.strict_json import dumps
from training.compat.deepspeed.zero import zero3_whole_weights
from training.config.recipe import Recipe
from training.loop.metrics import device_name
from training.models.model import cast_lm_head_to_fp32, disable_dropout
from training.objectives.base import Objective
from training.objectives.grpo.spec import GrpoSection
from training.objectives.grpo.loss import (CLIPPED, EXTREMES, STEP_TOKEN_MEAN, EntropyControl, LossSettings,
                                           entropy_threshold, group_advantages, grpo_loss, kept_tokens, metric_means,
                                           nanstd, normalized_sum_advantages, token_logps, weighted_rewards)
from training.objectives.reference import SyncedReference, load_reference, partitioned, reference_place, synced_note
from training.objectives.grpo.rewards import RewardLog, RewardModel, check_rewarded, load_reward, score
from training.parallel import distributed
from training.planning.flops import flops_per_token, gpu_spec
from training.planning.kernels import replaced_head
from training.planning.objective_memory import decoding_reads, generation, reward_model_bytes
from training.planning.plan import RunPlan
from training.planning.precision import DTYPES, weights_dtype
from training.planning.report import format_bytes
from training.planning.shape import reward_model_shape
from training.state.output_dir import COMPLETIONS_FILE


def reward_functions(recipe: Recipe, device: torch.device | None = None, dtype: torch.dtype | None = None) -> list:
    """grpo.rewards loaded (a module beside the recipe's YAML found by its name), and its reward models built on
    `device` in `dtype` (without a device only their configs are read: the check before anything is built); a
    ConfigError names a bad one."""
    folder = str(Path(recipe.path).resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)
    functions = []
    for spec in recipe.grpo.rewards:
        if spec.function:
            functions.append(load_reward(spec.function, spec.params))
        elif device is None:
            reward_model_shape(spec.model, recipe.model.trust_remote_code)
        else:
            functions.append(RewardModel(spec.model, recipe.grpo.num_generations, device, dtype,
                                         recipe.model.trust_remote_code, recipe.grpo.chat_template_kwargs))
    return functions


def sampling_seed(seed: int, generation: int, row: int, index: int, evaluation: bool = False) -> int:
    """The random stream of completion `index` of the prompt at `row` of the training split in a generation, or of
    the evaluation split (the same streams at every evaluation: what changes is the model)."""
    return int(np.random.SeedSequence([seed, 4 if evaluation else 3, generation, row, index]).generate_state(1)[0])


class Rollout(NamedTuple):
    """A rank's prompts (each repeated for its group), their completions and every reward function's scores."""
    prompt_ids: list[torch.Tensor]
    prompts: list  # as the data gave them (strings or chat messages)
    completions: list[torch.Tensor]
    texts: list[str]
    truncated: list[bool]
    per_function: torch.Tensor  # [completions, functions], NaN: no opinion
    log: RewardLog  # what the reward functions logged (log_metric, log_extra)


class SeededSampling(LogitsProcessor):
    """Sampling as transformers' `generate` samples (in its order: repetition_penalty over each row's tokens, its left
    padding left out; temperature; top_h; top_k; top_p; min_p; typical_p; epsilon and eta cutoffs), with a random
    stream per completion, for `generate`'s greedy search: the Gumbel-max draw, argmax(logits + Gumbel noise), is a
    sample of softmax(logits) (tokens cut off stay at -inf). transformers' own sampling draws every row from one
    stream, so a completion would depend on which others share its batch, that is on the layout; here it depends on its
    seed alone. generation_kwargs' token bans and biases are generate's own processors, which run before this one:
    transformers runs the repetition penalty between them, where it commutes with the bans' -inf."""

    def __init__(self, seeds: list[int], section: GrpoSection, padding: torch.Tensor, device: torch.device):
        self.generators = [torch.Generator(device).manual_seed(seed) for seed in seeds]
        more = section.generation_kwargs
        self.warpers = LogitsProcessorList([TemperatureLogitsWarper(section.temperature)])
        if section.repetition_penalty != 1.0:
            self.warpers.insert(0, RepetitionPenaltyLogitsProcessor(section.repetition_penalty,
                                                                    prompt_ignore_length=padding))
        if more.top_h is not None:
            self.warpers.append(TopHLogitsWarper(more.top_h))
        if section.top_k > 0:
            self.warpers.append(TopKLogitsWarper(section.top_k))
        if section.top_p < 1:
            self.warpers.append(TopPLogitsWarper(section.top_p))
        if section.min_p is not None:
            self.warpers.append(MinPLogitsWarper(section.min_p))
        if more.typical_p < 1:
            self.warpers.append(TypicalLogitsWarper(more.typical_p))
        if more.epsilon_cutoff > 0:
            self.warpers.append(EpsilonLogitsWarper(more.epsilon_cutoff))
        if more.eta_cutoff > 0:
            self.warpers.append(EtaLogitsWarper(more.eta_cutoff, device=device))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = self.warpers(input_ids, scores.float())
        noise = torch.stack([torch.empty(scores.shape[1], device=scores.device).exponential_(generator=generator)
                             for generator in self.generators])
        return scores - noise.log()


class StopStrings(StoppingCriteria):
    """grpo.generation_kwargs.stop_strings, as transformers' StopStringCriteria finds them, noting where each row first
    completed one: generate pads a stopped row, so its end is not seen in the tokens afterwards."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: list[str], rows: int):
        self.criteria, self.ends = StopStringCriteria(tokenizer, stop_strings), [None] * rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        done = self.criteria(input_ids, scores)
        for row in done.nonzero().flatten().tolist():
            self.ends[row] = self.ends[row] or input_ids.shape[1]
        return done


def generation_config(section: GrpoSection, eos_id: int | None, pad_id: int) -> GenerationConfig:
    """generate's settings for sample: greedy search over SeededSampling's scores, with generation_kwargs' token bans
    and biases, which generate applies before it."""
    return GenerationConfig(do_sample=False, max_new_tokens=section.max_completion_length, eos_token_id=eos_id,
                            pad_token_id=pad_id, use_cache=True, **section.generation_kwargs.passed())


def sample(model: torch.nn.Module, prompts: list[torch.Tensor], seeds: list[int], section: GrpoSection,
           eos_id: int, pad_id: int, synced: bool,
           tokenizer: PreTrainedTokenizerBase | None = None) -> tuple[list[torch.Tensor], list[bool]]:
    """One completion per prompt (1-D tensors; the same prompt repeated for a group), sampled in one batch, the
    prompts left-padded: each completion ends at its first EOS (kept), where it completes one of
    generation_kwargs.stop_strings (the tokenizer's), or at max_completion_length (truncated)."""
    device, width = prompts[0].device, max(len(p) for p in prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    inputs = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(inputs)
    for row, prompt in enumerate(prompts):
        inputs[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    config = generation_config(section, eos_id, pad_id)
    stops = section.generation_kwargs.stop_strings
    stop = StopStrings(tokenizer, stops, len(prompts)) if stops else None
    with torch.no_grad():
        out = model.generate(input_ids=inputs, attention_mask=mask, generation_config=config, synced_gpus=synced,
                             logits_processor=LogitsProcessorList([SeededSampling(seeds, section, width - lengths,
                                                                                  device)]),
                             stopping_criteria=StoppingCriteriaList([stop] if stop else []))
    completions, truncated = [], []
    for row, sequence in enumerate(out[:, width:]):
        ends = [int(e) + 1 for e in (sequence == eos_id).nonzero()[:1]]
        ends += [stop.ends[row] - width] if stop and stop.ends[row] else []
        length = min(ends, default=min(len(sequence), section.max_completion_length))
        completions.append(sequence[:length].cpu())
        truncated.append(not ends)
    return completions, truncated


@contextmanager
def decoding(model: torch.nn.Module, attention: str) -> Iterator[None]:
    """Generation runs eagerly, and with sdpa where training runs FlexAttention. Compiled decoder layers
    (training/models/compile.py) would be traced again for each layer's KV cache, whose state dynamo guards on, until
    dynamo's recompile limit: the first generation of a 1.24B Llama on an H200 took 34.5 s instead of 4 (docs/grpo.md).
    FlexAttention's path builds a block mask in every decoding pass; sdpa takes the padding's mask as it is."""
    if attention == "flex_attention":
        model.set_attn_implementation("sdpa")
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        if attention == "flex_attention":
            model.set_attn_implementation(attention)


def completion_rows(prompts: list[torch.Tensor], completions: list[torch.Tensor], pad_id: int, seq_len: int,
                    packing: str) -> dict:
    """A micro-batch's completions, each after its prompt, as the model's rows: one per row right-padded to the
    longest (packing none), or packed whole into rows of at most seq_len, best-fit decreasing (bfd), each keeping
    its own positions (restarting at 0), so no token attends to another sequence's. `slots` maps every position
    whose next token is a completion's to that token's place in the completions' own [completions, longest
    completion] layout (-1 elsewhere), where the loss is computed (unpack): packed or not, the loss sees the same
    tensors. `length` is each row's real tokens."""
    lengths = np.array([len(p) + len(c) for p, c in zip(prompts, completions)], dtype=np.int64)
    if packing == "bfd":
        rows, offsets = best_fit_decreasing(lengths, seq_len)
    else:
        rows, offsets = np.arange(len(lengths)), np.zeros(len(lengths), dtype=np.int64)
    fill = np.bincount(rows, weights=lengths).astype(np.int64)
    width, longest = int((offsets + lengths).max()), max(len(c) for c in completions)
    input_ids = torch.full((len(fill), width), pad_id, dtype=torch.long)
    position_ids = torch.arange(width).repeat(len(fill), 1)  # a row's padding continues its last sequence's
    if packing == "bfd":  # or, packed, restarts at 0: the padding is a sequence of its own, seen by none
        position_ids = (position_ids - torch.from_numpy(fill)[:, None]).clamp(min=0)
    slots = torch.full((len(fill), width - 1), -1, dtype=torch.long)
    mask = torch.zeros(len(completions), longest, dtype=torch.bool)
    for index, (prompt, completion, row, offset) in enumerate(zip(prompts, completions, rows.tolist(),
                                                                  offsets.tolist())):
        end = offset + len(prompt) + len(completion)
        input_ids[row, offset:end] = torch.cat([prompt, completion])
        position_ids[row, offset:end] = torch.arange(end - offset)
        slots[row, offset + len(prompt) - 1:end - 1] = index * longest + torch.arange(len(completion))
        mask[index, :len(completion)] = True
    return {"input_ids": input_ids, "position_ids": position_ids, "slots": slots, "completion_mask": mask,
            "length": torch.from_numpy(fill)}


def unpack(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """Per-position values of the rows ([rows, width - 1], position t scoring token t + 1) in the completions' own
    layout [completions, longest completion], zero where a completion has ended (completion_rows' `slots`)."""
    slots = batch["slots"].to(values.device)
    taken = slots >= 0
    shape = batch["completion_mask"].shape
    flat = values.new_zeros(shape.numel()).index_put((slots[taken],), values[taken])
    return flat.view(shape)


def completion_logps(model: torch.nn.Module, batch: dict, device: torch.device, temperature: float,
                     entropy_gradient: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-probability (from the logits before it) and the entropy of the distribution it
    was drawn from (token_logps), in the completions' layout [completions, longest completion]
    (batch["completion_mask"] marks the tokens)."""
    logits = model(input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device),
                   use_cache=False).logits  # with a cache transformers would not mask packed sequences apart
    logps, entropies = token_logps(logits[:, :-1], batch["input_ids"][:, 1:].to(device), temperature,
                                   entropy_gradient)
    return unpack(logps, batch), unpack(entropies, batch)


def loss_settings(section: GrpoSection) -> LossSettings:
    """The grpo section's loss settings: those of the same name (TRL's), and its `epsilon` as the lower bound, which
    epsilon_high defaults to."""
    named = {field.name for field in fields(LossSettings)} & set(GrpoSection.model_fields) - {"epsilon_high"}
    return LossSettings(epsilon_low=section.epsilon, epsilon_high=section.epsilon_high or section.epsilon,
                        entropy_bonus=section.entropy_bonus, **section.model_dump(include=named))


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


def eval_generations(section: GrpoSection) -> int:
    """Completions per evaluation prompt: num_generations_eval, or num_generations."""
    return section.num_generations_eval or section.num_generations


def entropy_control(section: GrpoSection) -> EntropyControl:
    return EntropyControl(section.entropy_coef, section.entropy_target, section.entropy_coef_delta,
                          section.entropy_coef_min, section.entropy_coef_max)


def steps_per_generation(recipe: Recipe) -> int:
    """The optimizer steps one generation serves: grpo.generation_batch_size over the global batch (checked whole)."""
    return (recipe.grpo.generation_batch_size or recipe.training.global_batch_size) // recipe.training.global_batch_size


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
    gathered = "" if plan.zero_stage != 3 else (
        f"; under ZeRO-3 gathered once per generation ({format_bytes(weights)}, held whole on each rank while it "
        f"generates)" if section.ds3_gather_for_generation else
        f"; under ZeRO-3 every pass gathers them: {format_bytes(passes * weights)} gathered per {when} "
        f"(grpo.ds3_gather_for_generation: once, holding them whole)")
    share = 2 * shape.matmul_parameters / training_flops
    return (f"generation cost per {when} and rank: {flops:.3e} FLOPs at most ({share:.0%} of training on the same "
            f"tokens), in {passes} decoding passes that each read the weights "
            f"({format_bytes(weights)}){gathered}{generation_floor(plan, completions, flops)}")


def generation_floor(plan: RunPlan, completions: int, flops: float) -> str:
    """'; at least T s on <GPU>' where this machine's GPU is in flops.py's table: the generation's FLOPs at the GPU's
    bf16 peak, or what its decoding passes read (memory.decoding_reads: the weights every pass and the KV cache so
    far) at the GPU's memory bandwidth, whichever takes longer. A floor that a decoder at full bandwidth (vLLM)
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
    if plan.precision == "fp32":
        return "LM head in fp32 (grpo.cast_lm_head_to_fp32): already so, the run computes in fp32"
    said = "LM head in fp32 (grpo.cast_lm_head_to_fp32): the logits of the policy, the reference and sampling in fp32"
    if weights_dtype(plan.precision, plan.zero_stage) == torch.float32:
        return f"{said}, the head outside ZeRO-0's autocast"
    copy = 4 * plan.shape.vocab_size * plan.shape.hidden_size
    return f"{said}, from an fp32 copy of its weight made in each forward pass ({format_bytes(copy)})"


def logged_metrics(log: RewardLog) -> dict[str, float]:
    """The reward functions' log_metric values of a generation: each name's mean over every call on every rank (TRL's),
    the names gathered so that every rank reduces the same ones in the same order."""
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(log.metrics))
    names = sorted(set().union(*names))
    if not names:
        return {}
    sums = distributed.all_reduce_on_host([value for name in names for value in
                                           (sum(log.metrics.get(name, [])), len(log.metrics.get(name, [])))])
    return {name: sums[2 * i] / sums[2 * i + 1] for i, name in enumerate(names)}


def extra_columns(log: RewardLog, count: int) -> dict[str, list]:
    """The reward functions' log_extra columns of a rank's `count` completions; a DataError names one of another
    length."""
    for column, values in log.columns.items():
        if len(values) != count:
            raise DataError(f"a reward function's log_extra({column!r}, ...) gave {len(values)} values for {count} "
                            f"completions; give one per completion")
    return log.columns


class Grpo(Objective):
    """training.objective=grpo: a step's completions generated, scored and trained on (module docstring)."""
    name = "grpo"
    carried = ("reward", "rewards/", "completions/", "kl", "clip_ratio/", "entropy", "frac_reward_zero_std",
               "generation_time_s", "eval_")

    def __init__(self, plan: RunPlan):
        super().__init__(plan)
        self.section: GrpoSection = plan.recipe.grpo
        self.rollout, self.reference, self.synced, self.first_reward = None, None, None, None
        self.sums, self.step_metrics, self.logged_up_to = [], {}, None
        self.generation_seconds, self.steps = 0.0, 0  # since the last logged step
        self.last_step = 0  # the last step ended, for the evaluation's trainer_state
        self.loss_settings = loss_settings(self.section)
        self.steps_per_generation = steps_per_generation(plan.recipe)
        self.entropy_control = entropy_control(self.section) if self.section.use_adaptive_entropy else None
        self.entropy_window = []  # the step's [entropy sum, tokens] per micro-batch, for adaptive entropy control

    @staticmethod
    def check(recipe: Recipe, model_config: PretrainedConfig | None, world_size: int | None = None) -> None:
        data, parallelism, grpo = recipe.data, recipe.parallelism, recipe.grpo
        cycle = grpo.num_iterations * max(1, steps_per_generation(recipe))  # 0 steps: refused below
        refused = [reason for condition, reason in (
            (parallelism.pipeline_stages > 1, "parallelism.pipeline_stages > 1: generation runs the whole model on "
                                              "each rank"),
            (parallelism.tensor_parallel > 1, "parallelism.tensor_parallel > 1"),
            (parallelism.sequence_parallel > 1, "parallelism.sequence_parallel > 1: a completion is sampled whole"),
            (parallelism.expert_parallel > 1, "parallelism.expert_parallel > 1"),
            (recipe.long_context.logits_tile_tokens is not None, "long_context.logits_tile_tokens: the loss needs "
                                                                 "each token's log-probability"),
            (data.packing == "concat", "data.packing=concat: it would cut completions across rows; use bfd "
                                       "(each micro-batch's completions packed whole) or none (one per row)"),
            (bool(data.filters), "data.filters: the quality filters judge documents; filter the prompts first"),
            (data.streaming, "data.streaming: prompts are prepared (deduplicated, fitted to seq_len) before the run"),
            (bool(grpo.generation_batch_size and grpo.generation_batch_size % recipe.training.global_batch_size),
             f"grpo.generation_batch_size={grpo.generation_batch_size} with training.global_batch_size="
             f"{recipe.training.global_batch_size}: each optimizer step trains on a whole global batch of the "
             f"generation; make it a multiple of the global batch size"),
            (bool(recipe.checkpointing.every_steps and recipe.checkpointing.every_steps % cycle),
             f"checkpointing.every_steps={recipe.checkpointing.every_steps} with {cycle} steps per generation "
             f"(grpo.num_iterations x generation_batch_size / global_batch_size): a checkpoint inside a generation "
             f"would resume without its completions; save every multiple of {cycle}"),
            (grpo.beta > 0 and not recipe.lora.enabled and not recipe.model.name_or_path,
             "grpo.beta > 0 from model.config alone: the reference is the starting checkpoint, loaded again; set "
             "model.name_or_path, or beta=0"),
            (grpo.sync_ref_model and grpo.beta == 0, "grpo.sync_ref_model with beta=0: there is no reference to sync"),
            (grpo.cast_lm_head_to_fp32 and (replaced_head(recipe) or (recipe.lora.enabled and "lm_head" in
                                                                      recipe.lora.target_modules)),
             "grpo.cast_lm_head_to_fp32 with another module in the LM head's place (LoRA on lm_head, "
             "lora.modules_to_save, fp8.lm_head): it casts a plain linear head (TRL refuses LoRA on the head alike)"),
            (grpo.sync_ref_model and recipe.lora.enabled,
             "grpo.sync_ref_model with lora: the reference is the base with the adapters disabled, not a model of its "
             "own to mix the policy into (TRL refuses it alike)")) if condition]
        if refused:
            raise ConfigError(f"training.objective=grpo does not support {refused[0]}")
        reward_functions(recipe)
        per_rank = recipe.training.global_batch_size // (world_size or 1)  # every rank is data-parallel (above)
        if world_size and (recipe.training.global_batch_size % world_size or per_rank % grpo.num_generations):
            raise ConfigError(f"training.global_batch_size={recipe.training.global_batch_size} over {world_size} "
                              f"data-parallel ranks is not whole groups of grpo.num_generations={grpo.num_generations} "
                              f"on each rank: make it a multiple of {grpo.num_generations * world_size}")
        if world_size and eval_generations(grpo) > per_rank:
            raise ConfigError(f"grpo.num_generations_eval={grpo.num_generations_eval}: more completions of one "
                              f"evaluation prompt than a rank generates in training ({per_rank}), which the memory "
                              f"plan counts; lower it, or raise training.global_batch_size")
        vocab = getattr(model_config, "vocab_size", None)
        if vocab and (beyond := [i for i in grpo.generation_kwargs.token_ids() if i >= vocab]):
            raise ConfigError(f"grpo.generation_kwargs names token id {beyond[0]}, beyond the model's vocabulary of "
                              f"{vocab}: token ids count from 0 (the tokenizer's convert_tokens_to_ids gives them)")
        if model_config is not None and getattr(model_config, "output_router_logits", False):
            raise ConfigError("training.objective=grpo with the router's load-balancing loss: GRPO's loss has no "
                              "place for it; set moe.aux_loss_coef=0")

    @staticmethod
    def describe(plan: RunPlan) -> list[str]:
        """The batch in prompts and completions, and what generation adds: its memory (memory.generation) and its cost."""
        training, grpo, steps = plan.recipe.training, plan.recipe.grpo, steps_per_generation(plan.recipe)
        prompts = training.global_batch_size // grpo.num_generations
        per_rank = training.global_batch_size // plan.dp_size * steps  # completions a rank generates at once
        memory = generation(plan.recipe, plan.precision, plan.shape, plan.zero_stage, plan.dp_size)
        ignored = (f" (grpo.ds3_gather_for_generation is ZeRO-3's and does nothing at ZeRO-{plan.zero_stage})"
                   if grpo.ds3_gather_for_generation else "")
        gathered = (f"the rank's own full weights{ignored}" if plan.zero_stage != 3 else
                    "ZeRO-3, gathered whole once per generation (grpo.ds3_gather_for_generation)"
                    if grpo.ds3_gather_for_generation else
                    "ZeRO-3: each layer's weights gathered for its forward pass, as in training (no full copy)")
        reference = ("none (beta 0)" if grpo.beta == 0 else "the base with the adapters disabled"
                     if plan.recipe.lora.enabled else reference_place(plan))
        if grpo.sync_ref_model:
            reference += synced_note(plan, grpo.ref_model_mixup_alpha, grpo.ref_model_sync_steps)
        return [f"batch: {prompts} prompts x {grpo.num_generations} generations = {training.global_batch_size} "
                f"completions per step; {training.micro_batch_size} completions/rank x {plan.accumulation_steps} "
                f"accumulation x {plan.dp_size} data-parallel ranks, each a row of prompt + completion (at most "
                f"{plan.recipe.data.seq_len} tokens)",
                *loss_lines(grpo, steps),
                *([head_line(plan)] if grpo.cast_lm_head_to_fp32 else []),
                f"generation: {prompts * steps // plan.dp_size} prompt(s) x {grpo.num_generations} per rank in one "
                f"batch{f' (grpo.generation_batch_size: {steps} optimizer steps)' if steps > 1 else ''}, "
                f"{sampling(grpo)}, up to {grpo.max_completion_length} decoding passes (new tokens); weights: "
                f"{gathered}; reference: {reference}",
                f"generation memory per rank, between the steps (in the memory table's peak where larger than the "
                f"activations): {format_bytes(memory.total)} = the larger of the prompts' pass "
                f"({format_bytes(memory.prefill)}) and the last decoding pass ({format_bytes(memory.decoding)}, of "
                f"which KV cache {format_bytes(memory.kv_cache)})"
                + (f" + the whole weights gathered ({format_bytes(memory.gathered_weights)})"
                   if memory.gathered_weights else "")
                + (f"; or a reward model's pass over one group, if larger ({format_bytes(memory.scoring)})"
                   if memory.scoring else ""),
                *([f"reward models: a whole frozen copy on each rank, {format_bytes(models)} in the model states"]
                  if (models := reward_model_bytes(plan.recipe, plan.precision)) else []),
                generation_cost(plan, per_rank)]

    def batches(self, prepared, rank: int) -> tuple[PromptBatches, EvalPromptBatches | None]:
        """The training prompts, a generation's share per step, and the evaluation prompts in batches of as many
        completions (num_generations_eval per prompt; every prompt each evaluation, or training.eval_max_rows of
        them)."""
        plan, grpo, training = self.plan, self.section, self.plan.recipe.training
        completions = training.global_batch_size // plan.dp_size
        prompts_per_rank = completions // grpo.num_generations  # whole groups (check)
        evaluation = EvalPromptBatches(prepared["eval"], completions // eval_generations(grpo), rank, plan.dp_size,
                                       training.eval_max_rows) if "eval" in prepared else None
        batches = PromptBatches(prepared["train"], prompts_per_rank, rank, plan.dp_size, training.seed,
                                grpo.num_iterations, grpo.num_generations, self.steps_per_generation)
        self.steps_per_epoch = batches.steps_per_epoch  # and the run's steps: where the trainer_state says the run is
        self.total_steps = training.total_steps(batches.steps_per_epoch)
        return batches, evaluation

    def start(self, engine: deepspeed.DeepSpeedEngine, batches, evaluation, resume: bool) -> None:
        plan, grpo = self.plan, self.section
        self.functions = reward_functions(plan.recipe, engine.device, DTYPES[plan.precision])
        self.names = [function.__name__ for function in self.functions]
        self.weights = [spec.weight for spec in grpo.rewards]
        self.eos_id, self.pad_id = plan.tokenizer.eos_token_id, pad_token_id(plan.tokenizer)
        if grpo.disable_dropout:
            disable_dropout(engine.module)
        if grpo.beta > 0 and not plan.recipe.lora.enabled:
            self.reference = load_reference(plan, engine)
            if grpo.sync_ref_model:
                self.synced = SyncedReference(self.reference, grpo.ref_model_mixup_alpha, grpo.ref_model_sync_steps,
                                              "grpo.sync_ref_model")
        if grpo.cast_lm_head_to_fp32:
            for model in (engine.module, self.reference):
                if model is not None:
                    cast_lm_head_to_fp32(model.module if partitioned(model) else model)

    def step_batches(self, engine: deepspeed.DeepSpeedEngine, micro_batches: list[dict]) -> list[dict]:
        [prompts] = micro_batches
        if self.rollout is None or self.rollout[0] != prompts["generation"]:
            started = time.perf_counter()
            self.rollout = prompts["generation"], self.generate(engine, prompts)
            self.generation_seconds += time.perf_counter() - started
        return self.rollout[1][prompts["part"]]

    def generate(self, engine: deepspeed.DeepSpeedEngine, prompts: dict) -> list[list[dict]]:
        """The rank's completions of its prompts, scored, with their advantages, as each step's micro-batches (the
        generation's steps in order: the prompts come step by step)."""
        seeds = [sampling_seed(self.plan.recipe.training.seed, prompts["generation"], int(row), index)
                 for row in prompts["rows"] for index in range(self.section.num_generations)]
        done = prompts["generation"] * self.steps_per_generation * self.section.num_iterations  # steps before it
        where = f"generation {prompts['generation']}, step {done + 1}"  # for the rewards' errors
        rollout = self.rollout_of(engine, prompts, seeds, self.trainer_state(done), where)
        advantages = self.advantages(engine, prompts["generation"], rollout, where)
        micro, data, batches = self.plan.recipe.training.micro_batch_size, self.plan.recipe.data, []
        for start in range(0, len(rollout.completions), micro):
            part = slice(start, start + micro)
            batch = completion_rows(rollout.prompt_ids[part], rollout.completions[part], self.pad_id, data.seq_len,
                                    data.packing)
            batch.update(advantages=advantages[part], truncated=torch.tensor(rollout.truncated[part]))
            batches.append(self.with_fixed_logps(engine, batch))
        steps = self.steps_per_generation
        if steps > 1 and self.section.loss_type in STEP_TOKEN_MEAN:
            # TRL's normalizer over a generation of several steps: its tokens / steps, not each step's own count
            share = sum(int(self.completion_mask(batch).sum()) for batch in batches) / len(batches)
            for batch in batches:
                batch["normalizer"] = share
        per_step = len(batches) // steps
        return [batches[step * per_step:(step + 1) * per_step] for step in range(steps)]

    def trainer_state(self, step: int) -> TrainerState:
        """Where the run is, for the reward functions (TRL's trainer_state): `step` optimizer steps done."""
        return TrainerState(global_step=step, max_steps=self.total_steps, epoch=step / self.steps_per_epoch)

    def rollout_of(self, engine: deepspeed.DeepSpeedEngine, prompts: dict, seeds: list[int],
                   state: TrainerState, where: str) -> Rollout:
        """Completions of each of the rank's prompts, as many as their seeds (num_generations, or in evaluation
        num_generations_eval), sampled in one batch, and the reward functions' scores of them (each given the prompt,
        the completion, the row's other fields and TRL's other arguments: rewards.py; `where` names the run's moment
        in their errors)."""
        grpo, generations = self.section, len(seeds) // len(prompts["prompt_ids"])
        prompt_ids = [torch.from_numpy(ids) for ids in prompts["prompt_ids"] for _ in range(generations)]
        zero3 = engine.zero_optimization_stage() == 3
        whole = zero3 and grpo.ds3_gather_for_generation
        engine.module.eval()
        with zero3_whole_weights(engine) if whole else nullcontext(), \
                decoding(engine.module, self.plan.recipe.model.attn_implementation):
            completions, truncated = sample(engine.module, [ids.to(engine.device) for ids in prompt_ids], seeds, grpo,
                                            self.eos_id, self.pad_id, synced=zero3 and not whole,
                                            tokenizer=self.plan.tokenizer)
        engine.module.train()
        texts = [self.plan.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        given = [json.loads(p) for p in prompts["prompt"] for _ in range(generations)]
        replies = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(given, texts)]
        fields = [json.loads(f) for f in prompts["fields"] for _ in range(generations)]
        row_fields = {name: [f.get(name) for f in fields] for name in (fields[0] if fields else {})}
        log = RewardLog()
        per_function = score(self.functions, given, replies, row_fields, where, trainer_state=state,
                             log_metric=log.metric, log_extra=log.extra,
                             completion_ids=[c.tolist() for c in completions])
        return Rollout(prompt_ids, given, completions, texts, truncated, per_function, log)

    def advantages(self, engine: deepspeed.DeepSpeedEngine, generation: int, rollout: Rollout,
                   where: str) -> torch.Tensor:
        """The rank's completions' advantages, from the rewards of the whole generation (every rank's, put in the
        prompts' order; a DataError on every rank where none has a reward); notes the generation's metrics and logs
        its samples."""
        rank, count, steps = self.plan.dp_rank(dist.get_rank()), len(rollout.completions), self.steps_per_generation
        gathered = self.gathered(engine, rollout)  # rank by rank, each rank's steps in turn
        # into the prompts' order, step by step, the same in every layout (so the sums over the generation add alike)
        in_order = torch.arange(len(gathered[0]), device=engine.device).view(-1, steps, count // steps)
        in_order = in_order.transpose(0, 1).reshape(-1)
        everyone, lengths, truncated = (values[in_order] for values in gathered)
        check_rewarded(everyone, self.names, where)
        rewards = weighted_rewards(everyone, self.weights)
        advantages, std = self.advantages_of(everyone, rewards, self.section.num_generations)
        self.step_metrics = {**self.generation_metrics(everyone, rewards, std, lengths, truncated,
                                                       self.section.num_generations), **logged_metrics(rollout.log)}
        if self.first_reward is None:
            self.first_reward = self.step_metrics["reward"]
        share = in_order.argsort()[rank * count:(rank + 1) * count]  # the rank's completions, in its own order
        self.log_samples(generation, rollout, rewards[share], in_order.tolist())
        return advantages[share].cpu()

    def advantages_of(self, per_function: torch.Tensor, rewards: torch.Tensor,
                      generations: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch's advantages over groups of `generations`, and the std each was scaled by, as
        grpo.multi_objective_aggregation makes them from the rewards: per function and their weighted sum."""
        grpo = self.section
        if grpo.multi_objective_aggregation == "normalize_then_sum":
            return normalized_sum_advantages(per_function, self.weights, generations)
        return group_advantages(rewards, generations, grpo.scale_rewards)

    @staticmethod
    def gathered(engine: deepspeed.DeepSpeedEngine, rollout: Rollout) -> tuple[torch.Tensor, ...]:
        """Every rank's scores, completion lengths and truncation, in rank order (the prompts' order)."""
        lengths = torch.tensor([len(c) for c in rollout.completions], dtype=torch.float32, device=engine.device)
        return (distributed.all_gather(rollout.per_function.to(engine.device)), distributed.all_gather(lengths),
                distributed.all_gather(torch.tensor(rollout.truncated, device=engine.device)))

    def with_fixed_logps(self, engine: deepspeed.DeepSpeedEngine, batch: dict) -> dict:
        """The batch with the log-probabilities that stay fixed over its steps: the old policy's (where the policy
        moves before the batch's last use: num_iterations > 1, or several steps per generation) and the reference's
        (beta > 0)."""
        grpo, model = self.section, engine.module
        with torch.no_grad():
            if grpo.num_iterations > 1 or self.steps_per_generation > 1:
                batch["old_logps"] = completion_logps(model, batch, engine.device, grpo.temperature)[0]
            if grpo.beta > 0 and self.reference is not None:
                batch["ref_logps"] = completion_logps(self.reference, batch, engine.device, grpo.temperature)[0]
            elif grpo.beta > 0:
                with model.disable_adapter():
                    batch["ref_logps"] = completion_logps(model, batch, engine.device, grpo.temperature)[0]
        return batch

    def may_stop_after(self, data_position: int) -> bool:
        """At the end of a generation only (all its steps done): a resumed run would sample it again."""
        return data_position % (self.section.num_iterations * self.steps_per_generation) == 0

    def count(self, batch: dict) -> int:
        """dapo, cispo, vespo (STEP_TOKEN_MEAN): the completion tokens (their loss is the step's token mean; over a
        generation of several steps, TRL's: the generation's mean per step, `normalizer`); the others normalize
        within the micro-batch."""
        if self.section.loss_type not in STEP_TOKEN_MEAN:
            return 1
        return batch.get("normalizer", int(self.completion_mask(batch).sum()))

    def completion_mask(self, batch: dict) -> torch.Tensor:
        """The completion tokens that take the loss: all, or with mask_truncated_completions the ended ones'."""
        if self.section.mask_truncated_completions:
            return batch["completion_mask"] & ~batch["truncated"].unsqueeze(1)
        return batch["completion_mask"]

    def start_step(self, micro_batches: list[dict]) -> None:
        self.sums, self.entropy_window, self.steps = [], [], self.steps + 1

    def loss(self, engine: deepspeed.DeepSpeedEngine, batch: dict, per_micro_batch: float,
             shard: tuple[int, int]) -> torch.Tensor:
        control, settings = self.entropy_control, self.loss_settings
        if control:
            settings = replace(settings, entropy_coef=control.applied())
        logps, entropies = completion_logps(engine, batch, engine.device, self.section.temperature,
                                            entropy_gradient=settings.entropy_bonus)
        mask = self.completion_mask(batch).to(engine.device)
        high_entropy = None
        if settings.top_entropy_quantile < 1.0:
            high_entropy = entropy_threshold(distributed.all_gather_ragged(entropies[mask]),
                                             settings.top_entropy_quantile)
        loss, sums = grpo_loss(logps, batch.get("old_logps"), batch.get("ref_logps"),
                               batch["advantages"].to(engine.device), mask, settings,
                               tokens_per_micro_batch=max(per_micro_batch, 1e-8), entropies=entropies,
                               high_entropy=high_entropy)
        self.sums.append(sums)
        if control:
            kept = kept_tokens(mask, entropies, high_entropy)
            self.entropy_window.append(torch.stack([(entropies.detach() * kept).sum(), kept.sum()]))
        return loss

    def end_step(self, engine: deepspeed.DeepSpeedEngine, step: int, applied: bool) -> None:
        """After an applied step, adaptive entropy control moves by the step's entropy over every rank's tokens, and
        every ref_model_sync_steps steps the policy is mixed into the reference (sync_ref_model)."""
        if self.entropy_control:
            entropy_sum, tokens = distributed.all_reduce(torch.stack(self.entropy_window).sum(0)).tolist()
            if applied:
                self.entropy_control.update(entropy_sum / max(tokens, 1.0))
        if self.synced:
            self.synced.end_step(engine.module, step, applied)
        self.last_step = step

    def state_dict(self) -> dict:
        return self.entropy_control.state_dict() if self.entropy_control else {}

    def save(self, folder: Path) -> None:
        if self.synced:
            self.synced.save(folder)

    def restore(self, state: dict, folder: Path) -> None:
        if self.entropy_control and state:
            self.entropy_control.load_state_dict(state)
        if self.synced:
            self.synced.restore(folder)

    def generation_metrics(self, per_function: torch.Tensor, rewards: torch.Tensor, std: torch.Tensor,
                           lengths: torch.Tensor, truncated: torch.Tensor, generations: int) -> dict:
        """TRL's metrics of a generation, over the global batch of groups of `generations`."""
        ended = lengths[~truncated]
        return {
            "reward": rewards.nanmean().item(),
            "reward_std": nanstd(rewards).item(),  # TRL's: over the whole generation, not the groups' mean
            "frac_reward_zero_std": (std.view(-1, generations)[:, 0] < 1e-6).float().mean().item(),
            **{f"rewards/{name}/mean": per_function[:, i].nanmean().item() for i, name in enumerate(self.names)},
            **{f"rewards/{name}/std": nanstd(per_function[:, i]).nan_to_num().item()  # 0 under 2 values (TRL: NaN)
               for i, name in enumerate(self.names)},
            "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.float().mean().item(),
            **({"completions/mean_terminated_length": ended.mean().item(),
                "completions/min_terminated_length": ended.min().item(),
                "completions/max_terminated_length": ended.max().item()} if len(ended) else {})}

    def metrics(self) -> dict:
        """The generation's metrics and the loss's: per micro-batch the token means over every rank (and the
        extremes over every rank's completions), averaged over the step's micro-batches (as TRL logs them); and
        generation_time_s, the seconds a step spent generating (sampling, scoring, the fixed log-probabilities) on
        rank 0, a mean over the steps since the last logged one, as step_time_s is."""
        names = [name for name in self.sums[0] if name not in EXTREMES]
        stacked = distributed.all_reduce(torch.stack([torch.stack([sums[name] for name in names])
                                                      for sums in self.sums]))
        reduced = [dict(zip(names, row)) for row in stacked]  # per micro-batch
        for name in [name for name in EXTREMES if name in self.sums[0]]:  # in one order on every rank
            op = dist.ReduceOp.MIN if EXTREMES[name] == "min" else dist.ReduceOp.MAX
            for record, value in zip(reduced, distributed.all_reduce(torch.stack([s[name] for s in self.sums]), op)):
                record[name] = value
        means = [metric_means(record) for record in reduced]
        settings = {"generation_time_s": self.generation_seconds / self.steps}
        if self.section.entropy_bonus:
            settings["entropy_coef"] = self.entropy_control.coef if self.entropy_control else self.section.entropy_coef
        self.generation_seconds, self.steps = 0.0, 0
        return {**self.step_metrics, **{name: float(np.mean([m[name] for m in means])) for name in means[0]},
                **settings}

    def log_samples(self, generation: int, rollout: Rollout, rewards: torch.Tensor, in_order: list[int]) -> None:
        """Every grpo.log_completions_every generations, every rank's prompts, completions, rewards and the reward
        functions' log_extra columns appended to completions.jsonl by rank 0 in the prompts' order (`in_order`: the
        indices of the ranks' records, rank by rank, in it; lines of a generation at or past this one, from before a
        resume, replaced)."""
        every = self.section.log_completions_every
        if not every or generation % every:
            return
        columns = extra_columns(rollout.log, len(rollout.texts))
        records = [{"generation": generation, "prompt": p, "completion": c, "reward": float(r),
                    **{name: float(v) for name, v in zip(self.names, values)},
                    **{column: values[index] for column, values in columns.items()}}
                   for index, (p, c, r, values) in enumerate(zip(rollout.prompts, rollout.texts, rewards.tolist(),
                                                                 rollout.per_function.tolist()))]
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
        if dist.get_rank() != 0:
            return
        path = self.plan.output_dir / COMPLETIONS_FILE
        if self.logged_up_to is None or self.logged_up_to >= generation:
            kept = [line for line in path.read_text().splitlines()
                    if json.loads(line)["generation"] < generation] if path.exists() else []
            path.write_text("".join(line + "\n" for line in kept))
        rank_by_rank = [record for rank_records in gathered[::self.plan.world_size // self.plan.dp_size]
                        for record in rank_records]
        with path.open("a") as file:
            file.writelines(dumps(rank_by_rank[index]) + "\n" for index in in_order)
        self.logged_up_to = generation

    def console(self, record: dict) -> str:
        return (f"  reward {record['reward']:.3f} (std {record['reward_std']:.3f})  completion length "
                f"{record['completions/mean_length']:.1f}" + (f"  kl {record['kl']:.4f}" if "kl" in record else "")
                + f"  generation {record['generation_time_s'] / record['step_time_s']:.0%} of the step"
                + (f"  eval reward {record['eval_reward']:.3f}" if "eval_reward" in record else ""))

    def summary(self) -> dict:
        return {"first_reward": self.first_reward} if self.first_reward is not None else {}

    def table(self, summary: dict) -> list[tuple[str, str]]:
        rows = [("GRPO reward (first -> last logged)", f"{summary['first_reward']:.3f} -> {summary['reward']:.3f}")] \
            if "first_reward" in summary and "reward" in summary else []
        rows += [("GRPO generation time per step (last logged)", f"{summary['generation_time_s']:.2f} s")] \
            if "generation_time_s" in summary else []
        return rows + ([("GRPO eval reward (last evaluation)", f"{summary['eval_reward']:.3f}")]
                       if "eval_reward" in summary else [])

    def evaluate(self, engine: deepspeed.DeepSpeedEngine, evaluation: EvalPromptBatches,
                 shard: tuple[int, int]) -> dict:
        """The evaluation prompts' completions, num_generations_eval each, sampled as in training (with streams of
        their own, the same at every evaluation) and scored: TRL's generation metrics, named eval_*."""
        generations, seed = eval_generations(self.section), self.plan.recipe.training.seed
        where, parts = f"evaluation after step {self.last_step}", []
        for prompts in evaluation:
            seeds = [sampling_seed(seed, 0, int(row), index, evaluation=True)
                     for row in prompts["rows"] for index in range(generations)]
            real = torch.from_numpy(prompts["real"]).repeat_interleave(generations).to(engine.device)
            rollout = self.rollout_of(engine, prompts, seeds, self.trainer_state(self.last_step), where)  # log unused
            parts.append((*self.gathered(engine, rollout), distributed.all_gather(real)))
        per_function, lengths, truncated, real = (torch.cat(values) for values in zip(*parts))
        per_function, lengths, truncated = per_function[real], lengths[real], truncated[real]
        check_rewarded(per_function, self.names, where)
        rewards = weighted_rewards(per_function, self.weights)
        _, std = self.advantages_of(per_function, rewards, generations)
        metrics = self.generation_metrics(per_function, rewards, std, lengths, truncated, generations)
        return {f"eval_{name}": value for name, value in metrics.items()}
