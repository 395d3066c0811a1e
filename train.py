"""Train a recipe with DeepSpeed.

    deepspeed [launcher args] train.py --recipe NAME_OR_DIR [--output-dir DIR] [--dry-run] [--resume] [key.path=value ...]
    python train.py --recipe tiny_llama training.max_steps=20      # one process, no launcher
    python train.py --recipe llama2_7b --dry-run --num-gpus 8 --gpu-mem 80   # the plan for a machine you are not on

The story: validate the recipe and DeepSpeed config (exit 2 on bad input) -> prepare the data
(cached) -> build the model -> deepspeed.initialize -> train -> checkpoint and export to hf/.
"""
import argparse
import logging
import os
import signal
import sys
import threading
import time
import warnings
from dataclasses import replace
from contextlib import nullcontext
from pathlib import Path

import training  # noqa: F401 (first: it keeps DeepSpeed's import from loading mlflow, training/compat/deepspeed.py)
import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from data_pipeline.prepare import prepare_dataset
from data_pipeline.stream import StreamingBatches
from training.compat import check_versions
from training.compat.deepspeed import loss_scale, withheld_step, zero0_grad_norm
from training.planning.auto_config import choose_ds_config
from training.planning.ds_config import accumulation_steps, build_ds_config, load_ds_config, zero_setting, zero_stage
from training.base.errors import ConfigError, positive_float, positive_int
from training.planning.micro_batch import choose_micro_batch
from training.config.recipe import load_recipe, recipe_inputs
from training.loop.benchmarks import benchmark_checkpoint, benchmark_run, check_benchmarks
from training.loop.engine import start_engine
from training.loop.metrics import (FlopsMeter, MetricsLogger, Stopwatch, flops_meter, gpu_metrics, measured_model_states,
                                   Throughput, peak_memory_bytes, record_model_states, run_totals, write_summary)
from training.loop.health import WeightWatch
from training.objectives import OBJECTIVES, Objective
from training.loop.stability import StabilityGuard, finite, rewind
from training.loop.trackers import Trackers, check_trackers
from training.models.attention import resolve_attention
from training.parallel.build import build_run_model
from training.models.compile import resolve_compile
from training.models.lora import lora_files
from training.models.model import (check_checkpoint_folder, check_checkpoint_matches, check_recipe_against_model,
                                   load_model_config, load_tokenizer, weights_digest)
from training.models.moe import RouterMeter, router_meter, with_router_loss
from training.parallel import distributed
from training.parallel.pipeline import pipeline_batches
from training.parallel.tensor_parallel import loss_copies
from training.checks import check_layout, refusal
from training.planning.plan import RunPlan, planned_machine
from training.planning.precision import resolve_precision
from training.planning.report import print_plan
from training.state.checkpoint import latest_tag, record_position, save_checkpoint
from training.state.export import export_run
from training.state.output_dir import (check_output_dir, claim_output_dir, default_output_dir, finish_output_dir,
                                       start_output_dir)
from training.state.resume import plan_resume, resume_engine, saved_micro_batch
from training.state.run_state import RunState
from training.state.universal import convert_on_rank_0

stop_requested = threading.Event()  # set by SIGTERM: the run saves a checkpoint at the end of the step and exits


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="a name under recipes/, a recipe folder or a YAML file")
    parser.add_argument("--output-dir", type=Path,
                        help="default: outputs/<recipe>, or outputs/<recipe>-N when earlier runs are there")
    parser.add_argument("--dry-run", action="store_true", help="validate everything, print the plan, train nothing")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the output dir")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run in the output dir")
    parser.add_argument("--num-gpus", type=positive_int, help="with --dry-run: plan for this many GPUs per node")
    parser.add_argument("--num-nodes", type=positive_int, default=1, help="with --dry-run and --num-gpus: nodes "
                        "(default 1)")
    parser.add_argument("--gpu-mem", type=positive_float, metavar="GiB", help="with --dry-run: memory per GPU to fit "
                        "into (default: this machine's)")
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # set by the launcher
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="e.g. training.max_steps=20")
    return parser.parse_intermixed_args(argv)  # overrides may come before or after the options


def make_plan(args: argparse.Namespace, world_size: int | None = None) -> RunPlan:
    """Every check that needs no model, data or process group: bad input fails here, fast. world_size:
    the ranks to plan for (default: --num-gpus x --num-nodes, or the launcher's)."""
    what_if = args.num_gpus is not None or args.gpu_mem is not None or args.num_nodes != 1
    if what_if and not args.dry_run:
        raise ConfigError("--num-gpus, --num-nodes and --gpu-mem plan for another machine: use them with --dry-run "
                          "(a run's ranks come from the deepspeed launcher)")
    if args.num_nodes != 1 and args.num_gpus is None:
        raise ConfigError(f"--num-nodes {args.num_nodes} plans for nodes of --num-gpus GPUs each: give --num-gpus too")
    recipe = load_recipe(args.recipe, args.overrides)
    check_trackers(recipe.logging.report_to)
    check_benchmarks(recipe)
    if recipe.model.name_or_path:
        check_checkpoint_folder(recipe.model.name_or_path)
    model_config = with_router_loss(load_model_config(recipe.model), recipe.moe)
    if recipe.model.config and recipe.model.name_or_path:
        check_checkpoint_matches(model_config, recipe.model)
    tokenizer = load_tokenizer(recipe.tokenizer_path, recipe.model.trust_remote_code, cached_only=args.dry_run)
    check_recipe_against_model(recipe, model_config, len(tokenizer) if tokenizer else None)
    recipe = resolve_attention(recipe, model_config, for_gpus=args.num_gpus is not None)
    world_size = world_size or (args.num_gpus * args.num_nodes if args.num_gpus else distributed.world_size())
    auto_config = recipe.deepspeed.config == "auto"
    machine = None
    if auto_config or recipe.training.micro_batch_size == "auto":
        machine = planned_machine(args.num_gpus, args.num_nodes, args.gpu_mem, world_size)
    if auto_config:
        precision = resolve_precision(recipe.precision, {}, for_gpus=args.num_gpus is not None)
        recipe = choose_ds_config(recipe, model_config, precision, machine,
                                  lambda chosen: refusal(chosen, model_config, world_size, args.num_gpus is not None))
    raw_ds_config, ds_config_path = load_ds_config(recipe)
    precision = resolve_precision(recipe.precision, raw_ds_config, for_gpus=args.num_gpus is not None)
    recipe = resolve_compile(recipe, zero_stage(raw_ds_config), for_gpus=args.num_gpus is not None)
    check_layout(recipe, model_config, raw_ds_config, precision, world_size, args.num_gpus is not None)
    parallelism = recipe.parallelism
    dp_size = world_size // (parallelism.pipeline_stages * parallelism.sequence_parallel * parallelism.tensor_parallel)
    output_dir = args.output_dir or default_output_dir(recipe.name, args.resume)
    recipe, micro_batch = choose_micro_batch(recipe, model_config, precision, zero_setting(raw_ds_config), machine,
                                             dp_size, saved_micro_batch(output_dir) if args.resume else None)
    if not args.dry_run:
        check_output_dir(output_dir, args.resume, args.overwrite, [*recipe_inputs(recipe), ds_config_path])

    def ds_config(universal: bool) -> dict:
        return build_ds_config(raw_ds_config, ds_config_path, recipe, model_config, dp_size, precision, universal)

    plan = RunPlan(recipe, model_config, tokenizer, precision, ds_config(False), ds_config_path, world_size,
                   accumulation_steps(recipe.training, dp_size), output_dir,
                   chosen_for=machine if auto_config else None, micro_batch=micro_batch,
                   base_digest=weights_digest(recipe.model.name_or_path) if recipe.model.name_or_path else None)
    if args.resume and plan_resume(plan):  # the checkpoint loads in this layout only through a universal conversion
        plan = replace(plan, ds_config=ds_config(True), resume_universal=True)
    return plan


def make_batches(plan: RunPlan, objective: Objective) -> tuple:
    """The objective's training batches from prepared rows (local rank 0 prepares and caches them while the other
    ranks wait), or batches from a stream; evaluation batches when the data has an eval split; the data's stats."""
    data, training = plan.recipe.data, plan.recipe.training
    rank = plan.dp_rank(dist.get_rank())
    if data.streaming:
        return StreamingBatches(data, plan.tokenizer, training.micro_batch_size, plan.accumulation_steps, rank,
                                plan.dp_size, training.seed), None, {"streaming": True}
    with distributed.local_main_first():
        prepared, stats = prepare_dataset(data, plan.tokenizer)
    return *objective.batches(prepared, rank), stats


def grad_norm_before_step(engine: deepspeed.DeepSpeedEngine) -> torch.Tensor | None:
    """DeepSpeed reports the gradient norm for its ZeRO and half-precision optimizers only; for a plain
    stage-0 optimizer it is computed here from the (already all-reduced) gradients."""
    if engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled():
        return None
    return zero0_grad_norm(engine)


def train_step(engine: deepspeed.DeepSpeedEngine, micro_batches: list[dict], dp_size: int, objective: Objective,
               guard: StabilityGuard | None = None,
               shard: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor | float, int, bool]:
    """One optimizer step. Returns this rank's share of the step's loss (the shares of all ranks sum to the
    mean over every target token of the global batch), the gradient norm before clipping, the real
    (non-padding) tokens of the global batch, and whether any rank has been asked to stop. Under sequence
    parallelism (shard) each rank of a group holds the same rows and runs its slice of them.

    Each micro-batch's loss is its summed token loss divided by (global target count / (micro-batches
    x ranks)): DeepSpeed's averaging over accumulation steps and ranks then yields exactly the global
    token mean, not a mean of micro-batch means. The counts are reduced on the host, in the same
    collective as the stop flag. The stability guard, when on, reads the step's loss before the last
    backward pass and may drop the step (training/loop/stability.py): one wait for the device per step. The
    objective says what the loss is a mean over (DPO: pairs in place of target tokens) and computes it."""
    targets, tokens, stops = distributed.all_reduce_on_host([
        sum(map(objective.count, micro_batches)),
        sum(int(batch["length"].sum()) for batch in micro_batches), float(stop_requested.is_set())])
    copies = dist.get_world_size() // dp_size  # the ranks of a pipeline, sequence or tensor group hold the same rows
    targets, tokens = targets / copies, tokens // copies
    targets_per_micro_batch = targets / (len(micro_batches) * dp_size)
    if isinstance(engine, PipelineEngine):
        engine.module.loss_fn.targets_per_micro_batch = targets_per_micro_batch
        loss = engine.train_batch(data_iter=pipeline_batches(micro_batches))
        # every rank holds the whole step's loss; the caller sums the ranks' shares
        if guard:
            guard.note_pipeline_loss(loss / dist.get_world_size())
        return loss / dist.get_world_size(), engine.get_global_grad_norm(), int(tokens), stops > 0
    shares = len(micro_batches) * dp_size * loss_copies(engine)
    loss_sum, grad_norm = torch.zeros((), device=engine.device), None
    objective.start_step()
    for index, batch in enumerate(micro_batches):
        loss = objective.loss(engine, batch, targets_per_micro_batch, shard)
        if guard and index == len(micro_batches) - 1:
            loss = guard.drop_if_bad((loss_sum + loss.detach()) / shares, loss)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary:
            grad_norm = grad_norm_before_step(engine)
        # without ZeRO no DeepSpeed check drops a non-finite step: the guard withholds it
        with withheld_step(engine.optimizer) if guard and boundary and not finite(grad_norm) else nullcontext():
            engine.step()
        loss_sum += loss.detach()
    grad_norm = engine.get_global_grad_norm() if grad_norm is None else grad_norm
    return loss_sum / shares, grad_norm, int(tokens), stops > 0


def train(engine: deepspeed.DeepSpeedEngine, objective: Objective, batches, evaluation, plan: RunPlan,
          start: RunState, total_steps: int, flops: FlopsMeter | None, trackers: Trackers, clock: Stopwatch,
          router: RouterMeter | None = None) -> dict:
    """The loop: batch, forward/backward/step, log every N steps, evaluate every E, checkpoint every M, and
    on SIGTERM checkpoint and stop. A step the stability guard drops is tried again on the next batch; a
    rewind goes back to the last checkpoint (training/loop/stability.py). Returns run totals. Only training is
    timed: the clock stops, once the accelerator has finished its queued work, for logging, evaluation,
    checkpoint saves and rewinds."""
    return Loop(engine, objective, batches, evaluation, plan, start, total_steps, flops, trackers, clock, router).run()


class Loop:
    """One run's loop: where it is (a RunState: step, tokens seen, data position), what it logged and saved, and its
    throughput, with the step, the stability guard's events, and the logging and saving as methods of their own."""

    def __init__(self, engine: deepspeed.DeepSpeedEngine, objective: Objective, batches, evaluation, plan: RunPlan,
                 start: RunState, total_steps: int, flops: FlopsMeter | None, trackers: Trackers, clock: Stopwatch,
                 router: RouterMeter | None):
        self.engine, self.objective, self.plan, self.total_steps = engine, objective, plan, total_steps
        self.batches, self.evaluation = batches, evaluation
        self.flops, self.trackers, self.clock, self.router = flops, trackers, clock, router
        recipe, self.checkpoints = plan.recipe, plan.output_dir / "checkpoints"
        self.state, self.first_step = start.model_copy(), start.step
        self.logger = MetricsLogger(plan.output_dir, total_steps, start.step, "tensorboard" in recipe.logging.report_to,
                                    dist.get_rank() == 0, trackers)
        self.guard = StabilityGuard(recipe.stability, plan.precision == "fp16", self.checkpoints) \
            if recipe.stability.enabled else None
        self.watch = WeightWatch(engine) if plan.pipeline_stages == plan.tensor_parallel == 1 else None
        self.records, self.saves, self.stopped = [], [], None
        self.interval, self.timed = Throughput(), Throughput()

    def evaluate_at(self, step: int) -> bool:
        every = self.plan.recipe.training.eval_every_steps
        return self.evaluation is not None and (step == self.total_steps or bool(every and step % every == 0))

    def log_at(self, step: int) -> bool:
        return (step == self.first_step + 1 or step % self.plan.recipe.logging.every_steps == 0
                or step == self.total_steps or self.evaluate_at(step))

    def save_at(self, step: int) -> bool:
        every = self.plan.recipe.checkpointing.every_steps
        return bool(every and step % every == 0) or step == self.total_steps

    def run(self) -> dict:
        self.engine.train()  # from_pretrained gives eval mode: dropout (LoRA's too) and the router's loss off
        self.clock.start()
        while self.state.step < self.total_steps:
            lr, loss_share, grad_norm, tokens, stop, event = self.step()
            if event and event["event"] != "spike":
                if self.guard_event(event):
                    break
                continue
            if event:
                self.logger.event(event)
            self.state.step, self.state.tokens_seen = self.state.step + 1, self.state.tokens_seen + tokens
            self.interval.add(Throughput(tokens, 1))
            self.logger.advance()
            log_now, save_now = self.log_at(self.state.step) or stop, stop or self.save_at(self.state.step)
            if log_now or save_now:
                self.clock.stop()
                if log_now:
                    self.log(lr, loss_share, grad_norm)
                if save_now:
                    self.save()
                    if not stop and self.state.step < self.total_steps:  # periodic (the final one is scored at the end)
                        benchmark_checkpoint(self.plan, self.state.step, self.logger)
                if stop:
                    break
                self.clock.start()
        self.logger.close()
        return self.totals()

    def step(self) -> tuple:
        """One optimizer step on the batches at the data position, which moves on: the learning rate, this rank's
        loss share, the gradient norm, the global batch's tokens, whether a stop was asked, and the guard's event."""
        engine, guard, state = self.engine, self.guard, self.state
        if self.watch and self.log_at(state.step + 1):
            self.watch.remember()
        lr = guard.set_lr(engine, state.step + 1) if guard else engine.get_lr()[0]
        skipped_before = engine.skipped_steps
        loss_share, grad_norm, tokens, stop = train_step(engine, self.batches.micro_batches(state.data_position),
                                                         self.plan.dp_size, self.objective, guard,
                                                         self.plan.sequence_shard(dist.get_rank()))
        state.data_position += 1
        event = guard.after_step(state.step + 1, state.data_position - 1, float(grad_norm),
                                 engine.skipped_steps > skipped_before) if guard else None
        return lr, loss_share, grad_norm, tokens, stop, event

    def guard_event(self, event: dict) -> bool:
        """The stability guard dropped the step, rewound to the last checkpoint or stops the run (its checkpoint
        saved); returns whether the run stops."""
        self.clock.stop()
        state = self.state
        if event["event"] == "rewind":
            restored = rewind(self.engine, self.batches, self.checkpoints, state.data_position, self.plan.layout())
            state.step, state.tokens_seen = restored.step, restored.tokens_seen
            event.update(rewound_to=state.step, batches_passed_over=state.data_position - restored.data_position)
            self.logger.rewind_to(state.step)
            self.guard.rewound(state.step)
        self.logger.event(event)
        if event["event"] != "stop":
            self.clock.start()
            return False
        self.stopped = event["message"]
        if latest_tag(self.checkpoints) == f"global_step{state.step}":  # saved at this step: only the data moved on
            record_position(self.engine, self.checkpoints, run_state(self.plan, state, self.trackers.ids),
                            self.batches.state_dict())
        else:
            self.save()
        return True

    def log(self, lr: float, loss_share: torch.Tensor, grad_norm: torch.Tensor | float) -> None:
        """The logged step's record: metrics.jsonl, the console, TensorBoard and the trackers."""
        step, interval = self.state.step, self.interval
        interval.seconds = self.clock.take()
        record = step_record(self.engine, step, lr, loss_share, grad_norm, interval, self.flops, self.router)
        record.update(self.objective.metrics())
        if self.watch and self.watch.before is not None:
            record.update(self.watch.measure())
        if step > self.first_step + 1:  # the first step pays for warm-up and is left out of the mean
            self.timed.add(interval)
        if self.evaluate_at(step):
            shard = self.plan.sequence_shard(dist.get_rank())
            record.update(self.objective.evaluate(self.engine, self.evaluation, shard))
        self.records.append(record)
        self.logger.log(record)
        self.interval = Throughput()

    def save(self) -> None:
        plan, engine, step = self.plan, self.engine, self.state.step
        hf_files = (plan.model_config, plan.tokenizer, *lora_files(engine.module))
        self.saves.append(save_checkpoint(engine, self.checkpoints, run_state(plan, self.state, self.trackers.ids),
                                          self.batches.state_dict(), hf_files, plan.recipe.checkpointing.keep_last))
        self.logger.note(f"checkpoint global_step{step}: {self.saves[-1]['bytes'] / 2**20:,.1f} MiB in "
                         f"{self.saves[-1]['seconds']:.2f} s")

    def totals(self) -> dict:
        guard, state = self.guard, self.state
        return {"last_step": state.step, "tokens_seen": state.tokens_seen,
                **run_totals(self.records, self.timed, self.saves, self.flops),
                **({"stability": guard.summary()} if guard else {}),
                **({"stopped": self.stopped} if self.stopped else {}), **self.objective.summary()}


def step_record(engine: deepspeed.DeepSpeedEngine, step: int, lr: float, loss_share: torch.Tensor,
                grad_norm: torch.Tensor | float, interval: Throughput, flops: FlopsMeter | None,
                router: RouterMeter | None) -> dict:
    """The metrics.jsonl line of a logged step: the step's loss (the language model's: without an MoE router's
    load-balancing loss, logged apart as aux_loss, with the tokens each expert was sent) and gradient norm, and the
    interval since the last logged step's throughput and peak memory."""
    peak = distributed.all_reduce(torch.tensor(peak_memory_bytes(), device=engine.device), dist.ReduceOp.MAX)
    scale = loss_scale(engine)
    routing = router.metrics() if router else {}
    aux = router.coefficient * routing["aux_loss"] if "aux_loss" in routing else 0.0
    loss = distributed.all_reduce(loss_share).item() - aux
    return {"step": step, "loss": loss, **routing, "lr": lr, "grad_norm": float(grad_norm),
            "tokens_per_s": interval.tokens / interval.seconds, "step_time_s": interval.seconds / interval.steps,
            "peak_mem_bytes": int(peak.item()),
            **({"loss_scale": scale} if scale is not None else {}),
            **gpu_metrics(flops, interval.steps, interval.seconds)}


def run_state(plan: RunPlan, state: RunState, trackers: dict[str, str]) -> dict:
    """What a checkpoint records besides DeepSpeed's states (training/state/run_state.py): where the run is (the data
    position runs ahead of the step by the batches passed over), what wrote it, and its tracker runs' ids."""
    base = plan.recipe.model.name_or_path
    return {"step": state.step, "tokens_seen": state.tokens_seen, "data_position": state.data_position,
            "recipe": plan.recipe.name,
            "trackers": trackers, "micro_batch_size": plan.recipe.training.micro_batch_size,
            **plan.layout().model_dump(), **({"base_model": {"name_or_path": base, "digest": plan.base_digest}} if base else {})}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # DeepSpeed's old c10d calls
    try:
        distributed.adopt_srun_environment()
        check_versions(show=distributed.local_rank() == 0)
        plan = make_plan(args)
        if args.dry_run:
            print_plan(plan, planned_machine(args.num_gpus, args.num_nodes, args.gpu_mem, plan.world_size))
            return 0
        if plan.planned_for and distributed.local_rank() == 0:
            print_plan(plan, plan.planned_for)  # why this DeepSpeed config or micro-batch
    except Exception as error:  # noqa: BLE001 (report_once raises again what is not a user error)
        return distributed.report_once(error)
    return distributed.run_in_process_group(lambda: run(plan, args))


def run(plan: RunPlan, args: argparse.Namespace) -> int:
    """Everything after the checks, inside the process group: data, model, engine, training, export. An error
    here on any rank ends every rank (training/parallel/failure.py)."""
    training, checkpoints = plan.recipe.training, plan.output_dir / "checkpoints"
    distributed.check_shared_folder(plan.output_dir)
    claim_output_dir(plan.output_dir, args.resume)
    objective = OBJECTIVES[training.objective](plan)
    batches, evaluation, data_stats = make_batches(plan, objective)
    total_steps = training.max_steps or training.epochs * batches.steps_per_epoch
    if plan.resume_universal:
        convert_on_rank_0(checkpoints, latest_tag(checkpoints))

    run_start = time.perf_counter()
    model, mpu, kernels = build_run_model(plan)
    engine = start_engine(plan, model, mpu, total_steps)
    start = resume_engine(engine, batches, plan, total_steps) if args.resume else \
        RunState(step=0, tokens_seen=0, data_position=0, **plan.layout().model_dump())
    start_output_dir(plan, args.overwrite, args.resume)  # every check has passed: only now may --overwrite remove the earlier run
    objective.start(engine, batches, evaluation, args.resume)
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_requested.set())  # from here a SIGTERM saves, then stops
    held_tensors = {}
    clock = Stopwatch()
    record_model_states(engine.optimizer, lambda: engine.global_steps, start.step + 1, held_tensors, clock)
    flops = flops_meter(plan)
    trackers = Trackers(plan, start.trackers, dist.get_rank() == 0)  # a resumed run continues its own
    totals = train(engine, objective, batches, evaluation, plan, start, total_steps, flops, trackers, clock,
                   router_meter(engine.module, plan.accumulation_steps))
    totals.update(model_state_bytes=measured_model_states(held_tensors), kernels=kernels)
    if totals["last_step"] < total_steps:
        trackers.finish(None)
        finish_output_dir(plan.output_dir)
        return stopped_early(plan, totals, total_steps)
    export_run(engine, plan)
    totals.update(benchmark_run(plan))  # eval.benchmarks: lm-eval on hf/
    trackers.finish(write_summary(plan, totals, start.step, total_steps, time.perf_counter() - run_start,
                                  data_stats, flops))
    finish_output_dir(plan.output_dir)
    return 0


def stopped_early(plan: RunPlan, totals: dict, total_steps: int) -> int:
    """Say why the run stopped before its last step and how to continue it: exit code 3 when the stability guard
    stopped it (a human should look), 0 after a SIGTERM (a preemption: the checkpoint is saved)."""
    by = "the stability guard" if "stopped" in totals else "SIGTERM"
    if dist.get_rank() == 0:
        print(f"stopped by {by} after step {totals['last_step']} of {total_steps}"
              + (f": {totals['stopped']}" if "stopped" in totals else "") +
              f"; the checkpoint is saved: continue with --resume --output-dir {plan.output_dir}", file=sys.stderr)
    return 3 if "stopped" in totals else 0


if __name__ == "__main__":
    exit_code = main()
    # Every output file is written and closed by now. Interpreter teardown can still abort a finished run:
    # a library's native thread destroyed during finalization ("terminate called without an active
    # exception", about 1 run in 50 on CPU ranks even with the process group destroyed), turning a good run's
    # exit code into a failure. So the process ends here, without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
