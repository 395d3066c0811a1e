"""What a run reports: a progress bar and a line every N steps, metrics.jsonl, TensorBoard and a summary."""
import gc
import json
import resource
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from training.base.strict_json import dumps
from training.compat.torch import is_fake
from training.loop.trackers import Trackers, flat
from training.parallel import distributed
from training.parallel.build import describe_kernels
from training.planning.flops import flops_per_token, peak_tflops
from training.planning.plan import RunPlan
from training.planning.precision import device_type


def peak_memory_bytes() -> int:
    """Peak GPU memory allocated by this process, or on a CPU-only machine its peak resident set size."""
    if device_type() == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_name() -> str:
    """What the run ran on: the GPU's name, or 'cpu' (DeepSpeed's CPU accelerator)."""
    return torch.cuda.get_device_name() if device_type() == "cuda" else "cpu"


def peak_reserved_bytes() -> int | None:
    """Peak GPU memory the caching allocator reserved (allocated + cached); None without a GPU."""
    if device_type() == "cuda":
        return torch.cuda.max_memory_reserved()
    return None


def held_tensor_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of every tensor this process holds, each storage once, by device type ('cuda', 'cpu').

    Measured as the optimizer step starts (see record_model_states), when the activations are freed and the
    weights, gradients, master weights and optimizer states all exist: the measured model-state memory. Found
    through the garbage collector (every tensor with a Python object) plus the gradients of the optimizer's
    parameters, which may have none."""
    tensors = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]  # no __class__ lookups
    tensors += [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    storages = {}
    for tensor in tensors:
        if tensor.device.type == "meta" or tensor.layout != torch.strided or is_fake(tensor):
            continue  # a fake tensor (torch.compile's, left for the collector) holds no memory
        try:
            storage = tensor.untyped_storage()
            storages[tensor.device.type, storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # a storage already freed ("invalid python storage"), found before the collector ran
            continue
    held = {}
    for (device, _), size in storages.items():
        held[device] = held.get(device, 0) + size
    return held


def record_model_states(optimizer: torch.optim.Optimizer, current_step: Callable[[], int], on_step: int,
                        into: dict, clock: "Stopwatch | None" = None) -> None:
    """Fill `into` with the most held_tensor_bytes seen while the optimizer steps with current_step() == on_step
    (pick the run's second step, so that optimizers that make their states at the first one have them). The
    census walks every Python object (a tenth of a second or more): the clock, when given, stops meanwhile, so
    that the step's time is training alone.

    DeepSpeed's ZeRO optimizers step the torch optimizer once per parameter group, each group with its own
    gradients, so every call during that step is measured and the largest kept. The collector runs first: a tensor
    in a reference cycle that it has not yet reached would count or not by when it last ran (the census of a
    4-step ZeRO-0 or ZeRO-2 run of tools/compare.py was 12-26% above the plan in 2 of 4 suite runs here, within 5%
    in the others; that garbage is the cause is likely, not proven)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO and bf16 optimizers wrap a torch one

    def measure(*_) -> None:
        if current_step() == on_step:
            with clock.paused() if clock else nullcontext():
                gc.collect()
                for device, size in held_tensor_bytes(inner).items():
                    into[device] = max(into.get(device, 0), size)
        elif current_step() > on_step:
            handle.remove()

    handle = inner.register_step_pre_hook(measure)


class Stopwatch:
    """Seconds of training only, for tokens/s, TFLOP/s and MFU. The host runs ahead of a GPU, so the clock is
    read once the accelerator has finished the work queued so far; and the time between stop() and start()
    (logging, evaluation, checkpoint saves) is not counted. train.py and benchmarks/bare_loop.py time alike."""

    def __init__(self):
        self.seconds, self.since = 0.0, None

    def start(self) -> None:
        get_accelerator().synchronize()
        self.since = time.perf_counter()

    def stop(self) -> None:
        get_accelerator().synchronize()
        self.seconds += time.perf_counter() - self.since

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Not counted: what runs inside (the clock was running)."""
        self.stop()
        yield
        self.start()

    def take(self) -> float:
        """The seconds counted since the last take, and the count starts again from 0."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


@dataclass(frozen=True)
class FlopsMeter:
    """TFLOP/s per GPU and MFU over a stretch of steps (the formula is in training/planning/flops.py)."""
    model_flops_per_step: float  # per GPU
    hardware_flops_per_step: float  # per GPU, recomputation included
    peak_tflops: float | None  # None: a GPU not in the table and no logging.peak_tflops

    def metrics(self, steps: int, seconds: float) -> dict:
        tflops = self.model_flops_per_step * steps / seconds / 1e12
        metrics = {"tflops": tflops, "hardware_tflops": self.hardware_flops_per_step * steps / seconds / 1e12}
        if self.peak_tflops:
            metrics["mfu"] = tflops / self.peak_tflops
        return metrics


def gpu_metrics(flops: FlopsMeter | None, steps: int, seconds: float) -> dict:
    """TFLOP/s, MFU and the allocator's peak reservation (max over the ranks): GPU runs only."""
    if flops is None:
        return {}
    reserved = distributed.all_reduce(torch.tensor(peak_reserved_bytes(), device="cuda"), dist.ReduceOp.MAX)
    return {**flops.metrics(steps, seconds), "peak_mem_reserved_bytes": int(reserved.item())}


def flops_meter(plan: RunPlan) -> FlopsMeter | None:
    """On NVIDIA GPUs, the FLOPs one step costs each GPU and the GPU's peak; on a CPU, None (tokens/s only)."""
    if device_type() != "cuda":
        return None
    recipe = plan.recipe
    model, hardware = flops_per_token(plan.shape, recipe.data.seq_len, recipe.activation_checkpointing)
    tokens_per_gpu = recipe.training.global_batch_size * recipe.data.seq_len / plan.dims.world_size
    name = torch.cuda.get_device_name()
    peak = recipe.logging.peak_tflops or peak_tflops(name)
    if peak is None and dist.get_rank() == 0:
        print(f"no bf16 peak known for {name}: MFU is not reported; set logging.peak_tflops=<dense bf16 TFLOP/s>",
              file=sys.stderr)
    return FlopsMeter(model * tokens_per_gpu, hardware * tokens_per_gpu, peak)


def measured_model_states(held: dict[str, int]) -> dict[str, int] | None:
    """The largest rank's model-state bytes per device type; None when the run had no second step to measure."""
    devices = ("cuda", "cpu")
    sizes = distributed.all_reduce_on_host([float(held.get(device, -1)) for device in devices], op=dist.ReduceOp.MAX)
    return {device: int(size) for device, size in zip(devices, sizes) if size >= 0} or None


@dataclass
class Throughput:
    """Tokens (real, padding excluded), optimizer steps and training seconds, summed: the interval since the last logged
    step, or every interval after the first step (summary.json's means)."""
    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0

    def add(self, other: "Throughput") -> None:
        self.tokens, self.steps, self.seconds = self.tokens + other.tokens, self.steps + other.steps, \
            self.seconds + other.seconds


@dataclass
class RunTotals:
    """A run's totals, summary.json's fields besides its layout and data: where it ended, the first and last logged
    losses, the throughput after the first step, the peaks, the checkpoint saves, and what the objective, the stability
    guard, the model states, the kernels and the benchmarks add."""
    last_step: int
    tokens_seen: int
    first_loss: float
    final_loss: float
    first_step_s: float  # the first logged record is the first step's alone (warm-up, compile)
    mean_tokens_per_s: float
    flops: dict  # tflops, hardware_tflops and mfu over the timed steps, where measured (GPU)
    peak_mem_bytes: int
    peak_mem_reserved_bytes: int | None
    checkpoint_bytes: int | None
    checkpoint_save_s: float | None
    objective: dict  # the objective's fields: its last logged evaluation and metrics, and its summary
    stability: dict | None  # the stability guard's counts, when it is on
    stopped: str | None  # why the stability guard stopped the run
    model_state_bytes: dict | None = None
    kernels: dict | None = None
    benchmarks: dict | None = None  # eval.benchmarks' scores of the exported model

    @classmethod
    def of(cls, last_step: int, tokens_seen: int, records: list[dict], timed: Throughput, saves: list[dict],
           flops: FlopsMeter | None, objective: dict, stability: dict | None, stopped: str | None) -> "RunTotals":
        """From the logged records, the timed intervals (after the first step) and the checkpoint saves."""
        return cls(last_step, tokens_seen, records[0]["loss"], records[-1]["loss"], records[0]["step_time_s"],
                   timed.tokens / timed.seconds if timed.seconds else records[0]["tokens_per_s"],
                   flops.metrics(timed.steps, timed.seconds) if flops and timed.seconds else {},
                   max(r["peak_mem_bytes"] for r in records),
                   max(r["peak_mem_reserved_bytes"] for r in records) if "peak_mem_reserved_bytes" in records[0]
                   else None,
                   saves[-1]["bytes"] if saves else None, max(s["seconds"] for s in saves) if saves else None,
                   objective, stability, stopped)

    def fields(self) -> dict:
        """summary.json's fields (those a run does not have left out)."""
        optional = {"peak_mem_reserved_bytes": self.peak_mem_reserved_bytes, "checkpoint_bytes": self.checkpoint_bytes,
                    "checkpoint_save_s": self.checkpoint_save_s, "stability": self.stability, "stopped": self.stopped,
                    "benchmarks": self.benchmarks}
        return {"last_step": self.last_step, "tokens_seen": self.tokens_seen, "first_loss": self.first_loss,
                "final_loss": self.final_loss, "first_step_s": self.first_step_s,
                "mean_tokens_per_s": self.mean_tokens_per_s, **self.flops, "peak_mem_bytes": self.peak_mem_bytes,
                **{key: value for key, value in optional.items() if value is not None}, **self.objective,
                "model_state_bytes": self.model_state_bytes, "kernels": self.kernels}


def format_line(record: dict, total_steps: int, objective_text: str) -> str:
    return (f"step {record['step']:>{len(str(total_steps))}}/{total_steps}  loss {record['loss']:.4f}  "
            f"lr {record['lr']:.2e}  grad_norm {record['grad_norm']:.3f}  "
            f"{record['tokens_per_s']:,.0f} tokens/s  "
            + (f"{record['tflops']:.1f} TFLOP/s  " if "tflops" in record else "")
            + (f"MFU {record['mfu']:.1%}  " if "mfu" in record else "")
            + f"peak mem {record['peak_mem_bytes'] / 2**30:.2f} GiB" + objective_text)


class MetricsLogger:
    """Rank 0's reporting; on other ranks every method does nothing."""

    def __init__(self, output_dir: Path, total_steps: int, start_step: int, tensorboard: bool, enabled: bool,
                 trackers: Trackers | None = None):
        self.enabled, self.total_steps = enabled, total_steps
        self.output_dir, self.tensorboard = output_dir, tensorboard
        self.trackers = trackers
        if not enabled:
            return
        self.file, self.writer = None, None
        self.open_at(start_step)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="training", unit="step", dynamic_ncols=True)

    def open_at(self, step: int) -> None:
        """Continue the files at `step`: a resumed or rewound run rewrites the steps after it (its events stay)."""
        path = self.output_dir / "metrics.jsonl"
        kept = [line for line in path.read_text().splitlines()
                if json.loads(line)["step"] <= step or "event" in json.loads(line)] if step and path.exists() else []
        path.write_text("".join(line + "\n" for line in kept))
        self.file = path.open("a")
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(self.output_dir / "tensorboard"), purge_step=step + 1)

    def rewind_to(self, step: int) -> None:
        if self.enabled:
            self.file.close()
            if self.writer:
                self.writer.close()
            self.open_at(step)
            self.bar.n = step
            self.bar.refresh()

    def event(self, event: dict) -> None:
        """A stability event (training/loop/stability.py): a line of its own in metrics.jsonl and on the console."""
        if self.enabled:
            self.file.write(dumps(event) + "\n")
            self.file.flush()
            if self.trackers:
                self.trackers.event(event)
            self.bar.write(f"step {event['step']}: {event['event']} ({event['reason']}, data position "
                           f"{event['data_position']}, loss {event['loss']})" + (f": {event['message']}" if
                                                                                  "message" in event else ""))

    def advance(self) -> None:
        if self.enabled:
            self.bar.update(1)

    def benchmarks(self, step: int, scores: dict[str, dict[str, float]] | None) -> None:
        """A checkpoint's benchmark scores (eval.benchmark_checkpoints): an event line of its own in metrics.jsonl
        (readers of the step records pass over events), `benchmarks/TASK/METRIC` in TensorBoard and the trackers, at
        the checkpoint's step. None: nothing to log."""
        if not self.enabled or scores is None:
            return
        record = {"event": "benchmark", "step": step, "benchmarks": scores}
        self.file.write(dumps(record) + "\n")
        self.file.flush()
        if self.trackers:
            self.trackers.log(record)
        if self.writer:
            for name, value in flat(record).items():
                self.writer.add_scalar(name, value, step)
        self.bar.write(f"step {step}: " + ", ".join(f"{task} {metric} {value:.4f}" for task, metrics in scores.items()
                                                    for metric, value in metrics.items()))

    def note(self, text: str) -> None:
        """A line on the console, above the progress bar."""
        if self.enabled:
            self.bar.write(text)

    def log(self, record: dict, objective_text: str = "") -> None:
        """objective_text: the objective's console text of the record's fields of its own."""
        if not self.enabled:
            return
        self.file.write(dumps(record) + "\n")
        self.file.flush()
        if self.trackers:
            self.trackers.log(record)
        if self.writer:
            for key, value in record.items():
                if key == "expert_tokens":  # by layer, each expert's
                    for layer, tokens in enumerate(value):
                        for expert, count in enumerate(tokens):
                            self.writer.add_scalar(f"experts/layer{layer:02d}/expert{expert:02d}", count,
                                                   record["step"])
                elif key == "source_tokens":  # data.phases: each source's tokens so far
                    for source, count in value.items():
                        self.writer.add_scalar(f"data/source_tokens/{source}", count, record["step"])
                elif key != "step" and not isinstance(value, str):  # a name (the data phase) is no scalar
                    name = f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"
                    self.writer.add_scalar(name, value, record["step"])
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        self.bar.write(format_line(record, self.total_steps, objective_text))

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.file.close()
            if self.writer:
                self.writer.close()


def write_summary(plan: RunPlan, totals: RunTotals, start_step: int, total_steps: int, wall_time_s: float, data: dict,
                  flops: FlopsMeter | None, objective_rows: Callable[[dict], list[tuple[str, str]]]) -> dict | None:
    """summary.json (the run's layout, totals, data statistics and DeepSpeed config) and its table, with the
    objective's rows of summary.json's fields; rank 0, which gets it back (for the trackers)."""
    if dist.get_rank() != 0:
        return None
    summary = {"recipe": plan.recipe.name, "device": device_name(),
               **({"peak_tflops": flops.peak_tflops} if flops else {}), **plan.layout().model_dump(),
               "activation_checkpointing": plan.recipe.activation_checkpointing, "steps": total_steps,
               "start_step": start_step, **totals.fields(), "wall_time_s": wall_time_s,
               "output_dir": str(plan.output_dir), "data": data, "ds_config": plan.ds_config}
    (plan.output_dir / "summary.json").write_text(dumps(summary, indent=2) + "\n")
    print_summary(summary, objective_rows(summary))
    return summary


def print_summary(summary: dict, objective_rows: list[tuple[str, str]]) -> None:
    table = Table(title=f"{summary['recipe']}: {summary['steps']} steps", show_header=False)
    rows = [
        ("device", summary["device"]),
        ("ranks x ZeRO stage x precision",
         f"{summary['world_size']} x ZeRO-{summary['zero_stage']} x {summary['precision']}"),
        *([("pipeline stages x data-parallel", f"{summary['pipeline_stages']} x "
            f"{summary['world_size'] // summary['pipeline_stages']}")] if summary["pipeline_stages"] > 1 else []),
        ("loss (first -> final)", f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}"),
        *objective_rows,
        ("tokens seen", f"{summary['tokens_seen']:,}"),
        ("mean tokens/s (after step 1)", f"{summary['mean_tokens_per_s']:,.0f}"),
        ("first step (warm-up, compile)", f"{summary['first_step_s']:.1f} s"),
        *([("kernels", describe_kernels(summary["kernels"]))] if "kernels" in summary else []),
        *([("TFLOP/s per GPU (model / with recomputation)", f"{summary['tflops']:.1f} / "
            f"{summary['hardware_tflops']:.1f}")] if "tflops" in summary else []),
        *([("MFU", f"{summary['mfu']:.1%}")] if "mfu" in summary else []),
        *([("skipped batches / spikes / rewinds", "{skip} / {spike} / {rewind}".format(**summary["stability"]))]
          if "stability" in summary else []),
        ("peak memory per rank", f"{summary['peak_mem_bytes'] / 2**30:.2f} GiB"),
        *([("model states per rank (measured)", ", ".join(f"{size / 2**30:.2f} GiB on {device}" for device, size
                                                          in summary["model_state_bytes"].items()))]
          if summary.get("model_state_bytes") else []),
        *[(f"benchmark {task} (lm-eval)", ", ".join(f"{metric} {value:.3f}" for metric, value in values.items()))
          for task, values in summary.get("benchmarks", {}).items()],
        ("wall time", f"{summary['wall_time_s']:.0f} s"),
        ("output", summary["output_dir"]),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
