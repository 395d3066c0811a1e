"""The Hugging Face Trainer on what a train.py run trains: the baseline rows of benchmarks/gpu_throughput.py.

    deepspeed --num_gpus 1 benchmarks/hf_trainer.py --recipe tiny_llama --output-dir DIR [key.path=value ...]

It takes the recipe and overrides a train.py run takes and resolves them with train.py's own plan
(train.make_plan), so these are the run's: the model config (random weights from the training seed, built
in fp32 and handed to DeepSpeed as train.py hands its model), the packed rows (data_pipeline's prepare, the
same cache), micro-batch, accumulation and global batch, steps, learning-rate schedule, and the resolved
DeepSpeed config (written to DIR/ds_config.json and given to the Trainer whole: the Trainer checks every
value it also sets, such as the batch sizes, lr, betas and clipping, and refuses a mismatch). What is the
Trainer's own: transformers' default attention (sdpa), its data loader and default collator (which passes
position_ids, so the packed documents stay apart), its loop, and `torch_compile` where the recipe says
`compile: true`.

Measured as train.py measures: real (non-padding) tokens per second after step 1, TFLOP/s and MFU by
training/planning/flops.py, the peak memory, the loss. The clock (train.py's Stopwatch: the GPU synchronized
at both ends) runs from the start of training to each logged step and stops while the Trainer logs, as
train.py's stops while it logs; train.py logs at step 1, every logging.every_steps and at the last step, and
so does the Trainer here. The loss the Trainer logs is the mean over the steps since its last log, where
train.py logs the step's own. DIR/summary.json holds the keys of train.py's summary.json that
gpu_throughput.py reads, plus first_step_s; DIR/metrics.jsonl a line per logged step.
"""
import argparse
import json
import os
import sys
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments, default_data_collator  # noqa: E402

import train  # noqa: E402  (first: it imports training, whose compat settings must precede DeepSpeed's import)
from data_pipeline.loader import ROW_COLUMNS  # noqa: E402
from data_pipeline.prepare import prepare_dataset  # noqa: E402
from training.base.errors import ConfigError  # noqa: E402
from training.base.strict_json import dumps  # noqa: E402
from training.config.precision import Precision
from training.loop.metrics import Stopwatch, device_name, flops_meter, peak_memory_bytes, peak_reserved_bytes  # noqa: E402
from training.parallel import distributed  # noqa: E402
from training.planning.plan import RunPlan  # noqa: E402
from training.planning.precision import device_type  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="as train.py's --recipe")
    parser.add_argument("--output-dir", type=Path, required=True, help="summary.json, metrics.jsonl and "
                        "ds_config.json go here (those files are replaced)")
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # set by the launcher
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="as train.py's")
    return parser.parse_intermixed_args(argv)


def check_reproducible(plan: RunPlan) -> None:
    """The recipe settings this script cannot give the Trainer as train.py has them: refused before any work, so
    that a row never compares unlike runs."""
    recipe, parallelism = plan.recipe, plan.recipe.parallelism
    unlike = [
        *([f"precision={plan.precision}: the Trainer row runs DeepSpeed's bf16, fp16 or fp32"]
          if plan.precision == Precision.FP8 else []),
        *([f"training.objective={recipe.training.objective}"] if recipe.training.objective != "lm" else []),
        *(["training.epochs without training.max_steps"] if recipe.training.max_steps is None else []),
        *([f"optimizer.name={recipe.optimizer.name}: DeepSpeed's AdamW only"]
          if recipe.optimizer.name != "adamw" else []),
        *(["lora.enabled=true"] if recipe.lora.enabled else []),
        *(["data.streaming=true"] if recipe.data.streaming else []),
        *([f"model.name_or_path={recipe.model.name_or_path}: random weights from model.config only"]
          if recipe.model.name_or_path else []),
        *[f"parallelism.{name}={value}: data parallelism only" for name, value in parallelism.model_dump().items()
          if isinstance(value, int) and value > 1],
    ]
    if unlike:
        raise ConfigError(f"recipe settings benchmarks/hf_trainer.py cannot reproduce in the HF Trainer: "
                          f"{'; '.join(unlike)}")  # one line: gpu_throughput.py's error column shows it whole


def schedule(plan: RunPlan, steps: int) -> tuple[str, dict]:
    """The Trainer's name and arguments for train.py's learning-rate schedule (training/loop/optimizer.py's
    lr_schedule: the same transformers schedule functions)."""
    training = plan.recipe.training
    return {"cosine": ("cosine_with_min_lr", {"min_lr_rate": training.min_lr_ratio}),
            "linear": ("linear", {}),
            "wsd": ("warmup_stable_decay", {"num_decay_steps": max(1, round(training.decay_ratio * steps)),
                                            "min_lr_ratio": training.min_lr_ratio}),
            "constant": ("constant_with_warmup", {})}[training.schedule]


def trainer_arguments(plan: RunPlan, output_dir: Path) -> TrainingArguments:
    """The Trainer's defaults, except what the run decides: the resolved DeepSpeed config and the values the
    Trainer checks against it, the steps, schedule, seed, checkpointing and compile, and train.py's logging steps.
    No checkpoints and no trackers: train.py's rows save after the timed steps, which does not change them."""
    ds, training = plan.ds_config, plan.recipe.training
    optimizer = ds["optimizer"]["params"]
    steps = training.max_steps
    schedule_name, schedule_kwargs = schedule(plan, steps)
    return TrainingArguments(
        output_dir=str(output_dir), deepspeed=json.loads(json.dumps(ds)), max_steps=steps, seed=training.seed,
        per_device_train_batch_size=ds["train_micro_batch_size_per_gpu"],
        gradient_accumulation_steps=ds["gradient_accumulation_steps"],
        learning_rate=optimizer["lr"], adam_beta1=optimizer["betas"][0], adam_beta2=optimizer["betas"][1],
        adam_epsilon=optimizer["eps"], weight_decay=optimizer["weight_decay"],
        max_grad_norm=ds.get("gradient_clipping", 0.0),
        lr_scheduler_type=schedule_name, lr_scheduler_kwargs=schedule_kwargs, warmup_steps=training.warmup_steps,
        bf16=ds.get("bf16", {}).get("enabled", False), fp16=ds.get("fp16", {}).get("enabled", False),
        activation_checkpointing=plan.recipe.activation_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False},  # as train.py's
        torch_compile=plan.recipe.compile is True,
        logging_steps=plan.recipe.logging.every_steps, logging_first_step=True,
        save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=device_type() == "cpu",
        remove_unused_columns=False,  # the collator takes the rows' `length` off before the model sees them
    )


class CountingCollator:
    """The Trainer's default collator on the model's columns (input_ids, labels, position_ids); it keeps each
    micro-batch's real tokens (the rows' `length`) in the order the loader fetched them, which is the order the
    Trainer trains them (the loader may fetch one ahead)."""

    def __init__(self):
        self.tokens: list[int] = []

    def __call__(self, rows: list[dict]) -> dict:
        self.tokens.append(sum(int(row.pop("length")) for row in rows))
        return default_data_collator(rows)


class StepClock(TrainerCallback):
    """Training seconds and real tokens of each logged interval (step 1 alone, then every logging_steps, and the
    last step, which this callback also has the Trainer log)."""

    def __init__(self, collator: CountingCollator):
        self.collator, self.clock = collator, Stopwatch()
        self.trained = self.counted = 0  # micro-batches trained, and those already in a record
        self.steps = self.tokens = 0  # of the interval so far
        self.records: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.start()

    def on_substep_end(self, args, state, control, **kwargs):
        self.trained += 1  # a micro-batch that does not end an accumulation

    def on_step_end(self, args, state, control, **kwargs):
        self.trained += 1
        self.steps += 1
        self.tokens += sum(self.collator.tokens[self.counted:self.trained])
        self.counted = self.trained
        if state.global_step == state.max_steps:
            control.should_log = True
        if control.should_log:
            self.clock.stop()
            self.records.append({"step": state.global_step, "steps": self.steps, "tokens": self.tokens,
                                 "seconds": self.clock.take()})
            self.steps = self.tokens = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in (logs or {}) and self.records and "loss" not in self.records[-1]:
            self.records[-1].update(loss=logs["loss"], lr=logs.get("learning_rate"), grad_norm=logs.get("grad_norm"))
            self.clock.start()  # the Trainer's logging was not training time


def global_records(records: list[dict], device: torch.device) -> list[dict]:
    """Each record's tokens summed over the data-parallel ranks (train.py's tokens/s counts the global batch)."""
    tokens = torch.tensor([record["tokens"] for record in records], dtype=torch.float64, device=device)
    dist.all_reduce(tokens)
    return [{**record, "tokens": int(total), "tokens_per_s": total / record["seconds"]}
            for record, total in zip(records, tokens.tolist())]


def summarize(plan: RunPlan, trainer: Trainer, records: list[dict], wall_time_s: float) -> dict:
    """summary.json: train.py's keys that gpu_throughput.py reads (mean after step 1, as train.py's), and what ran."""
    timed = records[1:]
    steps, tokens, seconds = (sum(record[key] for record in timed) for key in ("steps", "tokens", "seconds"))
    flops = flops_meter(plan)
    peak = torch.tensor([peak_memory_bytes(), peak_reserved_bytes() or 0], dtype=torch.float64,
                        device=trainer.args.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {
        "runner": "transformers.Trainer", "recipe": plan.recipe.name, "device": device_name(),
        **({"peak_tflops": flops.peak_tflops} if flops else {}), "world_size": plan.dims.world_size,
        "zero_stage": plan.zero_stage, "precision": plan.precision,
        "activation_checkpointing": plan.recipe.activation_checkpointing, "torch_compile": trainer.args.torch_compile,
        "attn_implementation": trainer.model.config._attn_implementation, "steps": trainer.state.global_step,
        "first_step_s": records[0]["seconds"], "first_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
        "tokens_seen": sum(record["tokens"] for record in records),
        "mean_tokens_per_s": tokens / seconds,
        **(flops.metrics(steps, seconds) if flops else {}),
        "peak_mem_bytes": int(peak[0]), **({"peak_mem_reserved_bytes": int(peak[1])} if flops else {}),
        "wall_time_s": wall_time_s,
        "versions": {name: version(name) for name in ("transformers", "accelerate", "deepspeed")},
        "ds_config": trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config,
    }


def run(plan: RunPlan, output_dir: Path) -> int:
    """Inside the process group (as train.py's run): data, model, the Trainer, its summary."""
    start = time.perf_counter()
    if dist.get_rank() == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        for name in ("summary.json", "metrics.jsonl"):
            (output_dir / name).unlink(missing_ok=True)
        (output_dir / "ds_config.json").write_text(dumps(plan.ds_config, indent=2) + "\n")
    with distributed.local_main_first():
        prepared, _ = prepare_dataset(plan.recipe.data, plan.tokenizer)
    rows = prepared["train"].select_columns(list(ROW_COLUMNS))
    torch.manual_seed(plan.recipe.training.seed)
    # built before TrainingArguments exist: under ZeRO-3 transformers would otherwise build it inside zero.Init,
    # in another order of random draws (training/models/model.py's build_model says the same)
    model = AutoModelForCausalLM.from_config(plan.model_config, dtype=torch.float32)
    collator = CountingCollator()
    clock = StepClock(collator)
    trainer = Trainer(model=model, args=trainer_arguments(plan, output_dir), train_dataset=rows,
                      data_collator=collator, callbacks=[clock])
    trainer.train()
    records = global_records(clock.records, trainer.args.device)
    summary = summarize(plan, trainer, records, time.perf_counter() - start)
    if dist.get_rank() == 0:
        (output_dir / "metrics.jsonl").write_text("".join(dumps(record) + "\n" for record in records))
        (output_dir / "summary.json").write_text(dumps(summary, indent=2) + "\n")
        print(f"HF Trainer: {summary['mean_tokens_per_s']:,.0f} tokens/s after step 1, first step "
              f"{summary['first_step_s']:.1f} s, final loss {summary['final_loss']:.4f}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        plan = train.make_plan(train.parse_args(["--recipe", args.recipe, "--dry-run", *args.overrides]))
        check_reproducible(plan)
    except Exception as error:  # noqa: BLE001 (report_once raises again what is not a user error)
        return distributed.report_once(error)
    return distributed.run_in_process_group(lambda: run(plan, args.output_dir.resolve()))


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # as train.py: no interpreter teardown, which can abort a finished CPU run
