"""Self-healing steps: a step whose loss or gradient is not finite, or whose loss spikes, is not applied on any
rank, and the run goes on; repeated trouble saves and stops the run (exit code 3).

Where the decision is made. The step's loss (every rank's share, summed over the ranks: one all-reduce, so
that every rank reaches the same verdict) is known after the last micro-batch's forward pass, before its
backward pass, so before anything of the step is applied. To drop the step, that micro-batch's loss is
multiplied by NaN: the step's gradients, and so its gradient norm, become NaN on every rank, and DeepSpeed's
own overflow handling (ZeRO 1-3 and its bf16 and fp16 optimizers) discards the gradients, leaves weights,
optimizer states and the learning-rate schedule as they were, and counts the step in `engine.skipped_steps`.
The same handling drops a step whose gradient is not finite under a finite loss. Without ZeRO, DeepSpeed
steps a plain torch optimizer, which has no such check: there a non-finite gradient norm withholds the
optimizer's step (`withheld_step`, training/compat/deepspeed/engine_step.py). A pipeline's loss is known only once its
schedule has stepped: there non-finite gradients are dropped as above, and a loss spike can only be rewound.

A dropped step passes over its batch: the next batch is tried for the same step, so a run still makes
`training.max_steps` updates, and the data position (batches consumed, saved in every checkpoint) runs ahead
of the step. A gradient-norm spike shows only in DeepSpeed's step, which computes the norm and clips the
update by it: it is logged and, with `policy: rewind`, rewound. fp16's loss-scale overflows are DeepSpeed's
to handle; they are logged, not counted.

Rewind (PaLM's remedy for spikes): back to the last checkpoint, then on past every batch up to and including
the one that spiked, optionally with the learning rate lowered for a while.
"""
import math
import statistics
from collections import deque
from pathlib import Path

import torch
from deepspeed import DeepSpeedEngine

from data_pipeline.loader import StepBatches
from data_pipeline.stream import StreamingBatches
from training.config.sections import StabilitySection
from training.parallel import distributed
from training.planning.layout import Layout
from training.state.checkpoint import latest_tag, load_checkpoint
from training.state.run_state import RunState


def finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


def rewind(engine: DeepSpeedEngine, batches: StepBatches | StreamingBatches, checkpoint_dir: Path, position: int,
           layout: Layout) -> RunState:
    """Back to the latest checkpoint, every rank: weights, optimizer, schedule and RNG as they were there, and the
    data at `position`, past the batches since the checkpoint (the spike's included). The checkpoint may be the one
    this run resumed from in another `layout`: it loads through its universal conversion then. Returns the
    checkpoint's run state."""
    state, data_state = load_checkpoint(engine, checkpoint_dir, layout)
    batches.load_state_dict(data_state)
    batches.pass_over(position - state.data_position)
    return state


class StabilityGuard:
    """One per run, on every rank: judges each step's loss before it is applied (`drop_if_bad`), then the
    step's outcome (`after_step`), and keeps the recent history that spikes are measured against."""

    def __init__(self, section: StabilitySection, fp16: bool, checkpoint_dir: Path):
        self.section, self.fp16, self.checkpoint_dir = section, fp16, checkpoint_dir
        self.losses, self.grad_norms = deque(maxlen=section.window), deque(maxlen=section.window)
        self.skipped_at, self.rewinds, self.events = deque(), 0, []
        self.loss, self.reason, self.judged, self.lower_lr_until = math.nan, None, False, 0

    def drop_if_bad(self, loss_share: torch.Tensor, last_loss: torch.Tensor) -> torch.Tensor:
        """Every rank calls it with its share of the step's loss before the last backward pass: the loss to
        backpropagate, poisoned with NaN when the step must not be applied."""
        self.loss = distributed.all_reduce(loss_share.detach().clone()).item()
        self.reason, self.judged = self.loss_verdict(self.loss), True
        return last_loss * math.nan if self.reason else last_loss

    def note_pipeline_loss(self, loss_share: torch.Tensor) -> None:
        """A pipeline's step loss, known only after its step."""
        self.loss = distributed.all_reduce(loss_share.detach().clone()).item()
        self.reason, self.judged = None, False

    def loss_verdict(self, loss: float) -> str | None:
        if not math.isfinite(loss):
            return "nonfinite_loss"
        if len(self.losses) >= self.section.min_history:
            mean, sigma = statistics.fmean(self.losses), statistics.pstdev(self.losses)
            if loss > mean + self.section.spike_sigma * sigma:
                return "loss_spike"
        return None

    def grad_spike(self, grad_norm: float) -> bool:
        factor = self.section.spike_grad_factor
        return bool(factor and len(self.grad_norms) >= self.section.min_history
                    and grad_norm > factor * statistics.median(self.grad_norms))

    def after_step(self, step: int, position: int, grad_norm: float | None, skipped: bool) -> dict | None:
        """The event of the attempt at `step` on the batch at data `position`, or None for a healthy step:
        `skip` (not applied: the next batch is tried), `spike` (applied, logged), `rewind` or `stop`.
        `skipped`: DeepSpeed did not apply the step (its skipped-step count went up)."""
        loss, reason = self.loss, self.reason if self.judged else self.loss_verdict(self.loss)
        if reason and self.judged and not skipped:
            raise RuntimeError(f"step {step} was applied with NaN gradients: this DeepSpeed optimizer does not drop "
                               f"non-finite steps (please report it)")
        if skipped and reason is None:  # dropped by DeepSpeed: the gradient was not finite
            reason = "fp16_overflow" if self.fp16 and math.isfinite(loss) else "nonfinite_grad"
        if reason is None and grad_norm is not None and self.grad_spike(grad_norm):
            reason = "grad_spike"
        if reason is None:
            self.losses.append(loss)
            if grad_norm is not None:
                self.grad_norms.append(grad_norm)
            return None
        found = {"step": step, "data_position": position, "reason": reason, "loss": loss,
                 **({"grad_norm": grad_norm} if grad_norm is not None and not skipped else {})}
        if reason == "loss_spike":
            found["threshold"] = (statistics.fmean(self.losses)
                                  + self.section.spike_sigma * statistics.pstdev(self.losses))
        if reason == "grad_spike":
            found["threshold"] = self.section.spike_grad_factor * statistics.median(self.grad_norms)
        return self.decide(found, applied=not skipped)

    def decide(self, evidence: dict, applied: bool) -> dict:
        section, step, message = self.section, evidence["step"], None
        if evidence["reason"] in ("loss_spike", "grad_spike") and section.policy == "rewind":
            self.rewinds += 1
            kind = "rewind"
            if self.rewinds > section.max_rewinds:
                kind, message = "stop", (f"{section.max_rewinds} rewinds did not get past the spikes "
                                         f"(stability.max_rewinds); look at the batches at the logged data positions")
            elif latest_tag(self.checkpoint_dir) is None:
                kind, message = "stop", ("a spike before the first checkpoint: there is nothing to rewind to yet; "
                                         "lower checkpointing.every_steps, or set stability.policy=skip")
        elif applied:
            kind = "spike"  # a gradient-norm spike is known once the step is applied (and clipped)
        else:
            kind = "skip"
            if evidence["reason"] != "fp16_overflow":
                self.skipped_at.append(step)
            while self.skipped_at and self.skipped_at[0] <= step - section.skip_window:
                self.skipped_at.popleft()
            if len(self.skipped_at) >= section.max_skips:
                kind, message = "stop", (f"{len(self.skipped_at)} batches skipped within {section.skip_window} steps "
                                         f"(stability.max_skips): the data or the settings need a look; the events "
                                         f"in metrics.jsonl name the steps and data positions")
        event = {"event": kind, **evidence, **({"message": message} if message else {})}
        self.events.append(event)
        return event

    def rewound(self, to_step: int) -> None:
        """The run is back at `to_step`: the lowered learning rate, if any, holds for the next steps. The history
        stays: its steps were healthy, and a second spike soon after must not find the detector unarmed."""
        self.lower_lr_until = to_step + self.section.rewind_lr_steps

    def set_lr(self, engine: DeepSpeedEngine, step: int) -> float:
        """The learning rate for `step`: the schedule's, lowered for a while after a rewind when so configured."""
        if self.section.rewind_lr_factor != 1.0:
            factor = self.section.rewind_lr_factor if step <= self.lower_lr_until else 1.0
            for group, scheduled in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
                group["lr"] = scheduled * factor
        return engine.get_lr()[0]

    def summary(self) -> dict:
        counts = {kind: sum(e["event"] == kind for e in self.events) for kind in ("skip", "spike", "rewind", "stop")}
        return {**counts, "events": self.events}
