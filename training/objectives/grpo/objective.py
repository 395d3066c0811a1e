"""training.objective=grpo: online RL with verifiable rewards (GRPO and TRL's kin of it: Dr. GRPO, DAPO, BNPO, CISPO,
SAPO, LUSPO, VESPO, GSPO's sequence-level ratio, GDPO's rewards), TRL's GRPOTrainer in this loop: the same DeepSpeed
engine, gradient accumulation and ZeRO stages as the language model's loss.

A step: the rank's prompts (data_pipeline/loader.py PromptBatches) are sampled num_generations times each with
transformers' `generate` on the current weights, all of the rank's completions in one batch (under ZeRO-3 each
layer's weights are gathered as its forward pass needs them, as the training step does: no second full copy, every
rank stepping together, `synced_gpus`; with grpo.ds3_gather_for_generation the whole weights once per generation;
eagerly and with sdpa: `decoding`). With grpo.generation_batch_size a generation samples the prompts of several
steps at once, and each step trains on its own share of it. Each completion draws from a random stream of its own,
seeded by (training.seed, the generation, the prompt's row, its index in the group) (sampling.py), so the
completions are the same under any layout and after a resume. The reward functions score them (rewards.py), the
rewards of the whole generation make each group's advantages (loss.py), and the completions, each after its
prompt, one per row or packed whole into rows (rollout.py), are the steps' micro-batches. Their loss is
grpo_loss's, on the completions' own layout (unpack), with the old log-probabilities kept from the generation when
the policy moves before their last use (num_iterations > 1, or several steps per generation) and the reference's
when beta > 0 (LoRA: the base with the adapters disabled; else the starting checkpoint, loaded again, frozen: a full
copy per rank at ZeRO 0-2, partitioned over the ranks under ZeRO-3, reference.py; with sync_ref_model mixed with the
policy as the run goes).
Evaluation samples the held-out prompts alike and scores them (evaluate).
"""
import json
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from transformers import PretrainedConfig, TrainerState

from data_pipeline.loader import EvalPromptBatches, PromptBatches
from data_pipeline.prepare import pad_token_id
from training.base.errors import ConfigError
from training.compat.deepspeed.zero import zero3_whole_weights
from training.config.recipe import Recipe
from training.models.model import cast_lm_head_to_fp32, disable_dropout
from training.objectives.base import Objective
from training.objectives.grpo.logs import generation_metrics, log_samples, logged_metrics
from training.objectives.grpo.loss import (
    EXTREMES,
    STEP_TOKEN_MEAN,
    entropy_threshold,
    group_advantages,
    grpo_loss,
    kept_tokens,
    metric_means,
    normalized_sum_advantages,
    weighted_rewards,
)
from training.objectives.grpo.report import console_line, plan_lines, summary_rows
from training.objectives.grpo.rewards import RewardLog, check_rewarded, reward_functions, score
from training.objectives.grpo.rollout import Rollout, completion_logps, completion_rows, completion_values
from training.objectives.grpo.sampling import decoding, sample, sampling_seed
from training.objectives.grpo.settings import entropy_control, eval_generations, loss_settings, steps_per_generation
from training.objectives.grpo.spec import COMPLETIONS_FILE, GrpoSection
from training.objectives.grpo.vllm_engine import SERVER_LOG, Engine, check_vllm
from training.objectives.reference import SyncedReference, load_reference, partitioned
from training.parallel import distributed
from training.planning.kernels import replaced_head
from training.planning.plan import RunPlan
from training.planning.precision import DTYPES


class Grpo(Objective):
    """training.objective=grpo: a step's completions generated, scored and trained on (module docstring)."""
    name = "grpo"
    carried = ("reward", "rewards/", "completions/", "kl", "clip_ratio/", "entropy", "frac_reward_zero_std",
               "generation_time_s", "sampling/", "eval_")

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
        self.vllm, self.pushed = None, False  # grpo.generation_engine=vllm's server; whether it has the weights

    @staticmethod
    def check(recipe: Recipe, model_config: PretrainedConfig | None, world_size: int | None = None,
              zero_stage: int | None = None) -> None:
        data, grpo = recipe.data, recipe.grpo
        cycle = grpo.num_iterations * max(1, steps_per_generation(recipe))  # 0 steps: refused below
        refused = [reason for condition, reason in (
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
            (zero_stage == 3 and grpo.engine == "compiled" and not grpo.ds3_gather_for_generation,
             "grpo.generation_engine=compiled under ZeRO-3 without grpo.ds3_gather_for_generation: each decoding pass "
             "would gather the layers through DeepSpeed's hooks, which a compiled graph cannot hold; set "
             "grpo.ds3_gather_for_generation=true (the whole weights gathered once per generation), or "
             "generation_engine=static"),
            (grpo.sync_ref_model and recipe.lora.enabled,
             "grpo.sync_ref_model with lora: the reference is the base with the adapters disabled, not a model of its "
             "own to mix the policy into (TRL refuses it alike)")) if condition]
        if refused:
            raise ConfigError(f"training.objective=grpo does not support {refused[0]}")
        if grpo.engine == "vllm":
            check_vllm(grpo, model_config, world_size is not None)
        reward_functions(recipe)
        # every rank is data-parallel: its spec refuses the other degrees (training/parallel/support.py, run first)
        per_rank = recipe.training.global_batch_size // (world_size or 1)
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
        """The batch in prompts and completions, and what generation adds: its memory and its cost (report.py)."""
        return plan_lines(plan)

    def batches(self, prepared, rank: int) -> tuple[PromptBatches, EvalPromptBatches | None]:
        """The training prompts, a generation's share per step, and the evaluation prompts in batches of as many
        completions (num_generations_eval per prompt; every prompt each evaluation, or training.eval_max_rows of
        them)."""
        plan, grpo, training = self.plan, self.section, self.plan.recipe.training
        completions = training.global_batch_size // plan.dims.dp_size
        prompts_per_rank = completions // grpo.num_generations  # whole groups (check)
        evaluation = EvalPromptBatches(prepared["eval"], completions // eval_generations(grpo), rank, plan.dims.dp_size,
                                       training.eval_max_rows) if "eval" in prepared else None
        batches = PromptBatches(prepared["train"], prompts_per_rank, rank, plan.dims.dp_size, training.seed,
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
        if grpo.engine == "vllm":
            self.vllm = Engine(grpo, plan.precision, plan.recipe.data.seq_len, plan.output_dir / SERVER_LOG)
            self.vllm.start(engine.module, plan.tokenizer, engine.zero_optimization_stage() == 3)
            self.pushed = grpo.vllm_server_host is None  # a started server starts from the weights
        if grpo.cast_lm_head_to_fp32:
            for model in (engine.module, self.reference):
                if model is not None:
                    try:
                        cast_lm_head_to_fp32(model.module if partitioned(model) else model)
                    except ConfigError as error:
                        raise ConfigError(f"grpo.cast_lm_head_to_fp32: {error}; set it false") from None

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
            if rollout.sampling_logps is not None:
                batch["sampling_logps"] = completion_values(rollout.sampling_logps[part], batch["completion_mask"])
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
        sampling_logps = None
        if self.vllm:
            if not self.pushed:
                self.vllm.push(engine.module, zero3)
                self.pushed = True
            completions, truncated, sampling_logps = self.vllm.sample([ids.tolist() for ids in prompt_ids], seeds,
                                                                      self.eos_id)
        else:
            whole = zero3 and grpo.ds3_gather_for_generation
            engine.module.eval()
            with zero3_whole_weights(engine) if whole else nullcontext(), \
                    decoding(engine.module, self.plan.recipe.model.attn_implementation, grpo.engine):
                completions, truncated = sample(engine.module, [ids.to(engine.device) for ids in prompt_ids], seeds,
                                                grpo, self.eos_id, self.pad_id, synced=zero3 and not whole,
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
        return Rollout(prompt_ids, given, completions, texts, truncated, per_function, log, sampling_logps)

    def advantages(self, engine: deepspeed.DeepSpeedEngine, generation: int, rollout: Rollout,
                   where: str) -> torch.Tensor:
        """The rank's completions' advantages, from the rewards of the whole generation (every rank's, put in the
        prompts' order; a DataError on every rank where none has a reward); notes the generation's metrics and logs
        its samples."""
        rank = self.plan.dims.dp_rank(dist.get_rank())
        count, steps = len(rollout.completions), self.steps_per_generation
        gathered = self.gathered(engine, rollout)  # rank by rank, each rank's steps in turn
        # into the prompts' order, step by step, the same in every layout (so the sums over the generation add alike)
        in_order = torch.arange(len(gathered[0]), device=engine.device).view(-1, steps, count // steps)
        in_order = in_order.transpose(0, 1).reshape(-1)
        everyone, lengths, truncated = (values[in_order] for values in gathered)
        check_rewarded(everyone, self.names, where)
        rewards = weighted_rewards(everyone, self.weights)
        advantages, std = self.advantages_of(everyone, rewards, self.section.num_generations)
        self.step_metrics = {**generation_metrics(self.names, everyone, rewards, std, lengths, truncated,
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
        sampling = batch["sampling_logps"].to(engine.device) if "sampling_logps" in batch else None
        high_entropy = None
        if settings.top_entropy_quantile < 1.0:
            high_entropy = entropy_threshold(distributed.all_gather_ragged(entropies[mask]),
                                             settings.top_entropy_quantile)
        loss, sums = grpo_loss(logps, batch.get("old_logps"), batch.get("ref_logps"),
                               batch["advantages"].to(engine.device), mask, settings,
                               tokens_per_micro_batch=max(per_micro_batch, 1e-8), entropies=entropies,
                               high_entropy=high_entropy, sampling_per_token_logps=sampling)
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
        self.pushed = self.pushed and not applied  # the server samples the next generation from the new weights
        self.last_step = step

    def finish(self) -> None:
        if self.vllm:
            self.vllm.close()

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
        """Every grpo.log_completions_every generations, every rank's samples appended to completions.jsonl by rank 0
        in the prompts' order (logs.py; lines of a generation at or past this one, from before a resume, replaced)."""
        every = self.section.log_completions_every
        if not every or generation % every:
            return
        log_samples(self.plan.output_dir / COMPLETIONS_FILE, generation, rollout, rewards, self.names, in_order,
                    self.plan.dims.world_size // self.plan.dims.dp_size,
                    rewrite=self.logged_up_to is None or self.logged_up_to >= generation)
        self.logged_up_to = generation

    def console(self, record: dict) -> str:
        return console_line(record)

    def summary(self) -> dict:
        return {"first_reward": self.first_reward} if self.first_reward is not None else {}

    def table(self, summary: dict) -> list[tuple[str, str]]:
        return summary_rows(summary)

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
        metrics = generation_metrics(self.names, per_function, rewards, std, lengths, truncated, generations)
        return {f"eval_{name}": value for name, value in metrics.items()}
