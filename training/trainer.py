"""The training loop of train.py: a run's optimizer step (train_step) and its Loop, which logs, evaluates, checkpoints
and obeys the stability guard and SIGTERM, and returns the run's totals. It sits above the objectives (README.md,
Layout): the objective says what a micro-batch's loss is, the loop how steps are taken, timed and kept."""
import threading
from contextlib import nullcontext

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from training.compat.deepspeed.engine_step import loss_scale, withheld_step, zero0_grad_norm
from training.config.precision import Precision
from training.loop.benchmarks import benchmark_checkpoint
from training.loop.health import WeightWatch
from training.loop.metrics import (
    FlopsMeter,
    MetricsLogger,
    RunTotals,
    Stopwatch,
    Throughput,
    gpu_metrics,
    peak_memory_bytes,
)
from training.loop.stability import StabilityGuard, finite, rewind
from training.loop.trackers import Trackers
from training.models.lora import lora_files
from training.models.moe import RouterMeter
from training.objectives.base import Objective
from training.parallel import distributed
from training.parallel.pipeline import pipeline_batches
from training.parallel.tensor_parallel import loss_copies
from training.planning.plan import RunPlan
from training.state.checkpoint import latest_tag, record_position
from training.state.disk_room import check_room_to_save
from training.state.run_state import RunState
from training.state.saving import Saving

stop_requested = threading.Event()  # set by SIGTERM: the run saves a checkpoint at the end of the step (or a later
# one the objective waits for, e.g. the end of a generation: Objective.may_stop_after) and exits


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
    objective says what the loss is a mean over (e.g. pairs in place of target tokens) and computes it."""
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
    objective.start_step(micro_batches)
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
          router: RouterMeter | None = None) -> RunTotals:
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
        if start.step:  # resumed: the objective goes on from the checkpoint
            objective.restore(start.objective, self.checkpoints / f"global_step{start.step}")
        self.logger = MetricsLogger(plan.output_dir, total_steps, start.step, "tensorboard" in recipe.logging.report_to,
                                    dist.get_rank() == 0, trackers)
        self.guard = StabilityGuard(recipe.stability, plan.precision == Precision.FP16, self.checkpoints) \
            if recipe.stability.enabled else None
        self.watch = WeightWatch(engine) if plan.dims.pipeline_stages == plan.dims.tensor_parallel == 1 else None
        self.records, self.saves, self.stopped = [], [], None
        self.saving = Saving(engine, self.checkpoints, recipe.checkpointing.asynchronous)
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

    def run(self) -> RunTotals:
        self.engine.train()  # from_pretrained gives eval mode: dropout (LoRA's too) and the router's loss off
        self.clock.start()
        try:
            self.train_steps()
            self.note_save(self.saving.finish())
        finally:
            self.logger.close()  # an error that ends the run is printed below the progress bar, not on its line
        return self.totals()

    def train_steps(self) -> None:
        while self.state.step < self.total_steps:
            lr, loss_share, grad_norm, tokens, stop, event = self.step()
            self.note_save(self.saving.poll())
            if event and event["event"] != "spike":
                if self.guard_event(event):
                    break
                continue
            if event:
                self.logger.event(event)
            self.state.step, self.state.tokens_seen = self.state.step + 1, self.state.tokens_seen + tokens
            stop = stop and self.objective.may_stop_after(self.state.data_position)
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
                        if self.plan.recipe.eval.benchmark_checkpoints:
                            self.note_save(self.saving.finish())  # the export reads the files
                        benchmark_checkpoint(self.plan, self.state.step, self.logger)
                if stop:
                    break
                self.clock.start()

    def step(self) -> tuple:
        """One optimizer step on the batches at the data position, which moves on: the learning rate, this rank's
        loss share, the gradient norm, the global batch's tokens, whether a stop was asked, and the guard's event."""
        engine, guard, state = self.engine, self.guard, self.state
        if self.watch and self.log_at(state.step + 1):
            self.watch.remember()
        lr = guard.set_lr(engine, state.step + 1) if guard else engine.get_lr()[0]
        skipped_before = engine.skipped_steps
        micro_batches = self.objective.step_batches(engine, self.batches.micro_batches(state.data_position))
        loss_share, grad_norm, tokens, stop = train_step(engine, micro_batches, self.plan.dims.dp_size, self.objective,
                                                         guard, self.plan.dims.sequence_shard(dist.get_rank()))
        state.data_position += 1
        applied = engine.skipped_steps == skipped_before
        self.objective.end_step(engine, state.step + 1, applied)
        event = guard.after_step(state.step + 1, state.data_position - 1, float(grad_norm),
                                 not applied) if guard else None
        return lr, loss_share, grad_norm, tokens, stop, event

    def guard_event(self, event: dict) -> bool:
        """The stability guard dropped the step, rewound to the last checkpoint or stops the run (its checkpoint
        saved); returns whether the run stops."""
        self.clock.stop()
        state = self.state
        if event["event"] in ("rewind", "stop"):
            self.note_save(self.saving.finish())  # a rewind loads the latest checkpoint; a stop reads which it is
        if event["event"] == "rewind":
            restored = rewind(self.engine, self.batches, self.checkpoints, state.data_position, self.plan.layout())
            state.step, state.tokens_seen = restored.step, restored.tokens_seen
            self.objective.restore(restored.objective, self.checkpoints / f"global_step{restored.step}")
            event.update(rewound_to=state.step, batches_passed_over=state.data_position - restored.data_position)
            self.logger.rewind_to(state.step)
            self.guard.rewound(state.step)
        self.logger.event(event)
        if event["event"] != "stop":
            self.clock.start()
            return False
        self.stopped = event["message"]
        if latest_tag(self.checkpoints) == f"global_step{state.step}":  # saved at this step: only the data moved on
            record_position(self.engine, self.checkpoints, self.run_state(), self.batches.state_dict())
        else:
            self.save()
        return True

    def log(self, lr: float, loss_share: torch.Tensor, grad_norm: torch.Tensor | float) -> None:
        """The logged step's record: metrics.jsonl, the console, TensorBoard and the trackers."""
        step, interval = self.state.step, self.interval
        interval.seconds = self.clock.take()
        record = step_record(self.engine, step, lr, loss_share, grad_norm, interval, self.flops, self.router)
        record.update(self.objective.metrics(), **self.batches.metrics(self.state.data_position))
        if self.watch and self.watch.before is not None:
            record.update(self.watch.measure())
        if step > self.first_step + 1:  # the first step pays for warm-up and is left out of the mean
            self.timed.add(interval)
        if self.evaluate_at(step):
            shard = self.plan.dims.sequence_shard(dist.get_rank())
            record.update(self.objective.evaluate(self.engine, self.evaluation, shard))
        self.records.append(record)
        self.logger.log(record, self.objective.console(record))
        self.interval = Throughput()

    def save(self) -> None:
        plan, engine, step = self.plan, self.engine, self.state.step
        hf_files = (plan.model_config, plan.tokenizer, *lora_files(engine.module))
        self.note_save(self.saving.finish())  # the save before, written in the background
        check_room_to_save(plan, step, latest_tag(self.checkpoints))
        self.note_save(self.saving.save(self.run_state(), self.batches.state_dict(), hf_files,
                                        plan.recipe.checkpointing.keep_last, self.objective.save))

    def note_save(self, records: list[dict]) -> None:
        """Complete saves: their records for the run's totals, and their console lines (with the seconds the step
        waited, where a save was written in the background)."""
        for record in records:
            self.saves.append(record)
            waited = (f" ({record['stall_seconds']:.2f} s of them in the step)"
                      if record["stall_seconds"] < record["seconds"] else "")
            self.logger.note(f"checkpoint global_step{record['step']}: {record['bytes'] / 2**20:,.1f} MiB in "
                             f"{record['seconds']:.2f} s{waited}")

    def run_state(self) -> RunState:
        """What a checkpoint records besides DeepSpeed's states (training/state/run_state.py): where the run is (the
        data position runs ahead of the step by the batches passed over), what wrote it, its tracker runs' ids and the
        objective's state."""
        plan, state, base = self.plan, self.state, self.plan.recipe.model.name_or_path
        return RunState.written(step=state.step, tokens_seen=state.tokens_seen, data_position=state.data_position,
                                recipe=plan.recipe.name, trackers=self.trackers.ids,
                                micro_batch_size=plan.recipe.training.micro_batch_size,
                                objective=self.objective.state_dict(), **plan.layout().model_dump(),
                                **({"base_model": {"name_or_path": base, "digest": plan.base_digest}} if base else {}))

    def totals(self) -> RunTotals:
        objective, records = self.objective, self.records
        carried = {key: value for key, value in records[-1].items() if key.startswith(objective.carried)}
        return RunTotals.of(self.state.step, self.state.tokens_seen, records, self.timed, self.saves, self.flops,
                            {**carried, **objective.summary()}, self.guard.summary() if self.guard else None,
                            self.stopped)


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
