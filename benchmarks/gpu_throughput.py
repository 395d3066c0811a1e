"""Training throughput of a ~1B Llama on one GPU: bf16 vs fp8 x activation checkpointing x ZeRO-1/3 x eager or
compiled, each next to the Hugging Face Trainer on the same model, rows, batch and DeepSpeed config (and, on a
multi-GPU machine, the same with long rows split by sequence parallelism).

    python benchmarks/gpu_throughput.py                                   # all 24 runs, 30 steps each
    python benchmarks/gpu_throughput.py --only noac-zero1                 # a subset (see --only): the 6 runs
                                                                          # without checkpointing at ZeRO-1
    python benchmarks/gpu_throughput.py --allow-cpu --model-config recipes/tiny_llama/config.json \\
        --seq-len 256 --steps 4 --micro-batch-size 2                      # plumbing smoke on a CPU: not a measurement
    python benchmarks/gpu_throughput.py --num-gpus 8 --sequence-parallel 8 --seq-len 65536 --micro-batch-size 1 \\
        --only bf16-ac-zero3 long_context.tiled_mlp=true long_context.logits_tile_tokens=2048   # long rows, 8 GPUs

Each run is train.py through the real `deepspeed` launcher (1 GPU or --num-gpus, its own --output-dir and --master_port)
on recipe tiny_llama with the model swapped for benchmarks/llama_1b/config.json (Llama-3.2-1B's
architecture; tiny_llama's 4,096-token tokenizer and its ~300k-token corpus, repeated; fine for
throughput). The numbers are train.py's own summary.json: real tokens/s and TFLOP/s per GPU (mean after
step 1), MFU against the GPU's dense bf16 peak (training/planning/flops.py has the FLOPs formula and the peak
table), peak memory allocated and reserved. The hf-* runs are benchmarks/hf_trainer.py: transformers' Trainer
given the same recipe and overrides, resolved by train.py's plan, measured the same way into the same
summary.json keys (with one GPU it starts as plain `python`, the environment of one rank: the launcher's
start-up changes no number). A run that fails (out of memory, fp8 refused on a GPU without FP8) becomes a
row with its error; the others go on. The table goes to stdout and, as results.md and results.csv, to the
output folder; each run's output to <output>/<run>.log.

Every train.py run ends with its end-of-run checkpoint and hf/ export (no recipe key turns them off; they
come after the timed steps and do not change the numbers); they are deleted after each run unless
--keep-checkpoints, so that 16 runs of a 1B model (about 17 GB of checkpoint each) fit on the disk. The HF
Trainer's runs save nothing.
"""
import argparse
import csv
import datetime
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from training.parallel.launch import failure_reason, launcher_command  # noqa: E402

MODEL_CONFIG = "benchmarks/llama_1b/config.json"
CHECKPOINTING, ZERO, COMPILED = (False, True), (1, 3), (False, True)
TARGET_MFU, TARGET_FP8_SPEEDUP, TARGET_VS_TRAINER = 0.45, 1.25, 1.3
RUN_KEYS = ("precision", "activation_checkpointing", "deepspeed.config", "compile")  # set by each run's name


@dataclass(frozen=True)
class Run:
    precision: str
    checkpointing: bool
    zero: int
    compiled: bool = False
    trainer: bool = False  # the HF Trainer (benchmarks/hf_trainer.py) in place of train.py

    @property
    def name(self) -> str:
        return (f"{'hf-' if self.trainer else ''}{self.precision}-{'ac' if self.checkpointing else 'noac'}-"
                f"zero{self.zero}{'-compile' if self.compiled else ''}")

    @property
    def tokens(self) -> set[str]:
        """The name's tokens, and 'train' or 'hf', 'eager' or 'compile' (which the name leaves out for train.py's
        eager runs): what --only matches."""
        return set(self.name.split("-")) | {"hf" if self.trainer else "train", "compile" if self.compiled else "eager"}

    @property
    def baseline(self) -> "Run":
        """The bf16 run with the same checkpointing, ZeRO stage and compile: what an fp8 run's speed-up is against."""
        return replace(self, precision="bf16")

    @property
    def trainer_twin(self) -> "Run":
        """The HF Trainer with the same precision, checkpointing, ZeRO stage and compile (none for fp8)."""
        return replace(self, trainer=True)

    @property
    def trainer_defaults(self) -> "Run":
        """The HF Trainer with its defaults (eager, bf16) at the same checkpointing and ZeRO stage."""
        return Run("bf16", self.checkpointing, self.zero, compiled=False, trainer=True)


@dataclass
class Result:
    run: Run
    summary: dict = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0
    planned_bytes: float | None = None


# each bf16 run next to its fp8 counterpart and the HF Trainer's (bf16 only: it has no FP8 through DeepSpeed), so
# that drifts in machine speed hit them alike
ALL_RUNS = [Run(precision, c, z, compiled, trainer)
            for c, z, compiled in itertools.product(CHECKPOINTING, ZERO, COMPILED)
            for precision, trainer in (("bf16", False), ("fp8", False), ("bf16", True))]


def select_runs(only: str | None) -> list[Run]:
    """--only: comma-separated patterns. A run's name selects that run ('bf16-noac-zero1': train.py, eager;
    'hf-bf16-noac-zero1-compile'); any other pattern is a '-'-joined set of tokens (bf16|fp8, ac|noac,
    zero1|zero3, eager|compile, train|hf) and selects every run that has them all: 'fp8' = the 8 fp8 runs,
    'noac-zero1' = 6 runs, 'train-eager' = train.py's 8 eager runs, 'hf' = the 8 HF Trainer runs."""
    if not only:
        return ALL_RUNS
    names = {run.name for run in ALL_RUNS}
    known = set().union(*(run.tokens for run in ALL_RUNS))
    patterns = [item.strip() for item in only.split(",") if item.strip()]
    unknown = sorted(set().union(*(pattern.split("-") for pattern in patterns)) - known)
    if unknown:
        raise ValueError(f"--only: unknown token(s) {', '.join(unknown)}; use {', '.join(sorted(known))} joined by "
                         f"'-', or a run's name; patterns separated by ','")
    runs = [run for run in ALL_RUNS if any(pattern == run.name if pattern in names else
                                           set(pattern.split("-")) <= run.tokens for pattern in patterns)]
    if not runs:
        raise ValueError(f"--only {only} selects no run")
    return runs


def probe_gpu() -> dict | None:
    """The GPU that runs will see, asked in a child process so that this one never holds a CUDA context
    (it would take memory from the runs): name and compute capability, or None without a usable GPU."""
    code = ("import json, torch; ok = torch.cuda.is_available(); print(json.dumps(ok and {"
            "'name': torch.cuda.get_device_name(0), 'capability': list(torch.cuda.get_device_capability(0)), "
            "'memory_gib': torch.cuda.get_device_properties(0).total_memory / 2**30, "
            "'count': torch.cuda.device_count(), "
            "'torch': torch.__version__, 'cuda': torch.version.cuda}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        return None
    return json.loads(result.stdout.strip().splitlines()[-1]) or None


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version
    found = []
    for name in ("torch", "deepspeed", "transformers", "accelerate", "torchao"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def overrides(args: argparse.Namespace, run: Run) -> list[str]:
    return [
        f"model.config={args.model_config}",
        f"data.seq_len={args.seq_len}",
        f"training.micro_batch_size={args.micro_batch_size}",
        # no accumulation
        f"training.global_batch_size={args.micro_batch_size * args.num_gpus // args.sequence_parallel}",
        f"parallelism.sequence_parallel={args.sequence_parallel}",
        f"training.max_steps={args.steps}",
        f"training.warmup_steps={min(5, args.steps - 1)}",
        "training.lr=3.0e-4",  # tiny_llama's 3e-3 suits a 5M model, not a 1B one; only the loss sanity column cares
        f"precision={run.precision}",
        f"activation_checkpointing={str(run.checkpointing).lower()}",
        f"deepspeed.config=zero{run.zero}",
        f"compile={str(run.compiled).lower()}",
        "logging.every_steps=5",
        "logging.report_to=[]",
        "checkpointing.every_steps=null",  # the end-of-run checkpoint is still written (see the docstring)
        "checkpointing.keep_last=1",
        *([f"logging.peak_tflops={args.peak_tflops}"] if args.peak_tflops else []),
        *([f"data.cache_dir={args.data_cache}"] if args.data_cache else []),
        *args.overrides,
    ]


def planned_peak_bytes(args: argparse.Namespace, run: Run) -> float | None:
    """--dry-run's estimate of this run's peak per GPU: its model states plus one micro-batch's activations
    (training/planning/memory.py planned_peak), or None where the plan has no estimate or refuses the run here."""
    import train
    from training.planning.memory import planned_model_states, planned_peak

    try:
        plan = train.make_plan(train.parse_args(["--recipe", "tiny_llama", "--dry-run", *overrides(args, run)]),
                               world_size=args.num_gpus)
        return planned_peak(plan, planned_model_states(plan))
    except ValueError:  # the plan's refusals (ConfigError) and settings it has no estimate for
        return None


def command(args: argparse.Namespace, run: Run, out: Path) -> list[str]:
    """train.py through the deepspeed launcher; the HF Trainer's script the same way on several GPUs, and as plain
    `python` on one (the launcher's own start-up, about 20 s on a loaded 2-core CPU, changes no number: the
    smoke in CI saves it)."""
    if not run.trainer:
        return launcher_command(args.num_gpus, "train.py", ["--recipe", "tiny_llama", "--output-dir", str(out),
                                                            "--overwrite", *overrides(args, run)])
    trainer_args = ["--recipe", "tiny_llama", "--output-dir", str(out), *overrides(args, run)]
    if args.num_gpus == 1:
        return [sys.executable, "benchmarks/hf_trainer.py", *trainer_args]
    return launcher_command(args.num_gpus, "benchmarks/hf_trainer.py", trainer_args)


def run_env(out: Path) -> dict[str, str]:
    """The environment of a run: torch.compile's and Triton's caches of its own, empty, so that a compiled run's
    first step never reuses what an earlier run of the invocation compiled (the same model in train.py and in
    the Trainer can give the same graphs): every first step is a cold compile, whatever the order."""
    cache = out / "compile_cache"
    return dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
                TRITON_CACHE_DIR=str(cache / "triton"))


def launch(args: argparse.Namespace, run: Run) -> Result:
    out = args.output / run.name
    argv, log = command(args, run, out), args.output / f"{run.name}.log"
    start = time.perf_counter()
    with log.open("w") as log_file:
        log_file.write(" ".join(argv) + "\n\n")
        log_file.flush()
        process = subprocess.Popen(argv, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, text=True,
                                   env=run_env(out), start_new_session=True)
        try:
            code = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the launcher and its ranks: the group it leads
            process.wait()
            code = None
    seconds = time.perf_counter() - start
    summary_file = out / "summary.json"
    if code == 0 and summary_file.exists():
        result = Result(run, json.loads(summary_file.read_text()), seconds=seconds,
                        planned_bytes=None if run.trainer else planned_peak_bytes(args, run))  # train.py's plan
    elif code is None:
        result = Result(run, error=f"timed out after {args.timeout} s", seconds=seconds)
    else:
        result = Result(run, error=f"exit {code}: {failure_reason(log.read_text(errors='replace'))}", seconds=seconds)
    shutil.rmtree(out / "compile_cache", ignore_errors=True)
    if not args.keep_checkpoints:
        for name in ("checkpoints", "hf"):
            shutil.rmtree(out / name, ignore_errors=True)
    return result


# (markdown header, CSV header, how the markdown shows a value); the CSV holds the raw values (empty: none)
COLUMNS = (
    ("runner", "runner", str),
    ("precision", "precision", str),
    ("activation ckpt", "activation_checkpointing", str),
    ("ZeRO", "zero_stage", str),
    ("compile", "compile", str),
    ("tokens/s", "tokens_per_s", "{:,.0f}".format),
    ("TFLOP/s (model)", "tflops", "{:.1f}".format),
    ("TFLOP/s (hardware)", "hardware_tflops", "{:.1f}".format),
    ("MFU", "mfu", "{:.1%}".format),
    ("first step s", "first_step_s", "{:.1f}".format),
    ("peak alloc GiB", "peak_alloc_gib", "{:.2f}".format),
    ("peak reserved GiB", "peak_reserved_gib", "{:.2f}".format),
    ("planned GiB", "planned_gib", "{:.2f}".format),
    ("plan / peak alloc", "plan_ratio", "{:.2f}".format),
    ("FP8 speed-up", "fp8_speedup", "{:.2f}x".format),
    ("vs HF Trainer", "vs_hf_trainer", "{:.2f}x".format),
    ("vs HF defaults", "vs_hf_defaults", "{:.2f}x".format),
    ("final loss", "final_loss", "{:.4f}".format),
    ("target", "target", str),
    ("error", "error", str),
)


def speed_ratio(result: Result, other: Result | None) -> float | None:
    """result's tokens/s over other's, where both ran."""
    if other is None or not result.summary or not other.summary:
        return None
    return result.summary["mean_tokens_per_s"] / other.summary["mean_tokens_per_s"]


def targets(run: Run, mfu: float | None, speedup: float | None, vs_defaults: float | None) -> str:
    """A train.py run's verdicts: bf16's MFU or fp8's speed-up, and its speed against the HF Trainer's defaults."""
    if run.precision == "bf16":
        first = (f"MFU >= {TARGET_MFU:.0%}: {'met' if mfu >= TARGET_MFU else 'NOT met'}" if mfu is not None
                 else f"MFU >= {TARGET_MFU:.0%}: no MFU (no GPU, or its peak unknown)")
    else:
        first = (f">= {TARGET_FP8_SPEEDUP}x bf16: {'met' if speedup >= TARGET_FP8_SPEEDUP else 'NOT met'}"
                 if speedup is not None else f">= {TARGET_FP8_SPEEDUP}x bf16: no bf16 run to compare with")
    second = (f">= {TARGET_VS_TRAINER}x HF defaults: {'met' if vs_defaults >= TARGET_VS_TRAINER else 'NOT met'}"
              if vs_defaults is not None else f">= {TARGET_VS_TRAINER}x HF defaults: no HF Trainer run to compare with")
    return f"{first}; {second}"


def rows(results: list[Result]) -> list[dict]:
    """One row per run, keyed by the CSV names, None where a value does not exist (failed run, no GPU, a ratio
    without its other run)."""
    by_run = {result.run: result for result in results}
    table = []
    for result in results:
        run, summary = result.run, result.summary
        tokens_per_s, mfu = summary.get("mean_tokens_per_s"), summary.get("mfu")
        speedup = speed_ratio(result, by_run.get(run.baseline)) if run.precision == "fp8" else None
        vs_trainer, vs_defaults = (None, None) if run.trainer else \
            (speed_ratio(result, by_run.get(run.trainer_twin)), speed_ratio(result, by_run.get(run.trainer_defaults)))
        target = None if result.error or run.trainer else targets(run, mfu, speedup, vs_defaults)
        reserved, peak = summary.get("peak_mem_reserved_bytes"), summary.get("peak_mem_bytes")
        planned = result.planned_bytes
        table.append({
            "runner": "HF Trainer" if run.trainer else "train.py", "precision": run.precision,
            "activation_checkpointing": "on" if run.checkpointing else "off", "zero_stage": run.zero,
            "compile": "on" if run.compiled else "off", "tokens_per_s": tokens_per_s, "tflops": summary.get("tflops"),
            "hardware_tflops": summary.get("hardware_tflops"), "mfu": mfu, "first_step_s": summary.get("first_step_s"),
            "peak_alloc_gib": peak / 2**30 if peak is not None else None,
            "peak_reserved_gib": reserved / 2**30 if reserved is not None else None,
            "planned_gib": planned / 2**30 if planned is not None else None,
            "plan_ratio": planned / peak if planned and peak else None,
            "fp8_speedup": speedup, "vs_hf_trainer": vs_trainer, "vs_hf_defaults": vs_defaults,
            "final_loss": summary.get("final_loss"), "target": target,
            "error": result.error or None,
        })
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| " + " | ".join(title for title, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in table:
        cells = ("-" if row[key] is None else show(row[key]) for _, key, show in COLUMNS)
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines)


def shown(path: str) -> str:
    """A path inside the repository relative to it, others as they are."""
    return str(Path(path).relative_to(REPO)) if Path(path).is_relative_to(REPO) else path


def header(args: argparse.Namespace, gpu: dict | None, runs: list[Run]) -> str:
    from transformers import AutoConfig

    from training.planning.flops import flops_per_token, peak_tflops
    from training.planning.shape import model_shape

    config = AutoConfig.from_pretrained(args.model_config)
    shape = model_shape(config)
    model_flops, _ = flops_per_token(shape, args.seq_len, False)
    device = (f"{gpu['name']} (compute capability {gpu['capability'][0]}.{gpu['capability'][1]}, "
              f"{gpu['memory_gib']:.0f} GiB, CUDA {gpu['cuda']})" if gpu
              else "NO GPU: CPU plumbing smoke, not a measurement")
    peak = args.peak_tflops or (peak_tflops(gpu["name"]) if gpu else None)
    lines = [
        f"gpu_throughput: {shown(args.model_config)} ({shape.parameters:,} parameters), {len(runs)} run(s) x "
        f"{args.steps} steps x {args.micro_batch_size} rows x {args.seq_len} tokens, {args.num_gpus} GPU(s), "
        f"sequence parallelism {args.sequence_parallel}, accumulation 1",
        f"device: {device}; {versions()}; {datetime.date.today().isoformat()}",
        "model FLOPs per token (training/planning/flops.py, 6N + 12 x layers x q_dim x seq_len): "
        f"{model_flops / 1e9:.2f} GFLOP"
        + (f"; dense bf16 peak {peak:,.0f} TFLOP/s, so MFU {TARGET_MFU:.0%} = "
           f"{TARGET_MFU * peak * 1e12 / model_flops:,.0f} tokens/s" if peak else ""),
        f"targets: bf16 MFU >= {TARGET_MFU:.0%}; fp8 tokens/s >= {TARGET_FP8_SPEEDUP}x the bf16 run with the same "
        f"activation checkpointing, ZeRO stage and compile; train.py tokens/s >= {TARGET_VS_TRAINER}x the HF Trainer "
        f"with its defaults",
        "HF Trainer rows (hf-*): benchmarks/hf_trainer.py, transformers' Trainer on the same model, rows, batch, "
        "steps, schedule and resolved DeepSpeed config, its default attention; 'vs HF Trainer' = tokens/s over the HF "
        "Trainer run with the same precision, checkpointing, ZeRO stage and compile, 'vs HF defaults' = over its eager "
        "run (its defaults) with the same checkpointing and ZeRO stage",
    ]
    return "\n".join(lines)


def write_results(args: argparse.Namespace, head: str, table: list[dict]) -> None:
    (args.output / "results.md").write_text(f"```\n{head}\n```\n\n{markdown(table)}\n")
    with (args.output / "results.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[key for _, key, _ in COLUMNS])
        writer.writeheader()
        writer.writerows(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated run names or patterns of bf16|fp8, ac|noac, zero1|zero3, "
                        "eager|compile, train|hf joined by '-', e.g. 'bf16-noac-zero1,hf-bf16-noac-zero1', "
                        "'noac-zero1', 'hf' (default: all 24 runs)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="rows per step (accumulation 1)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--num-gpus", type=int, default=1, help="GPUs per run (default 1)")
    parser.add_argument("--sequence-parallel", type=int, default=1, help="split each row over this many GPUs "
                        "(Ulysses, docs/parallelism.md); with --num-gpus")
    parser.add_argument("--model-config", default=MODEL_CONFIG, help=f"a config.json (default {MODEL_CONFIG})")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, for a GPU not in "
                        "training/planning/flops.py's table")
    parser.add_argument("--output", type=Path, default=REPO / "outputs" / "gpu_throughput",
                        help="runs, logs, results.md and results.csv go here")
    parser.add_argument("--data-cache", help="data.cache_dir for the runs (default: the recipe's)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run before it is killed")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep each run's checkpoints/ and hf/")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU: a smoke check of the plumbing "
                        "(use a tiny --model-config); fp8 runs are then refused by train.py and shown as errors")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="more overrides for every run "
                        "(train.py's and the HF Trainer's; the latter refuses what it cannot reproduce)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: tokens/s is the mean after step 1")
    named = [item for item in args.overrides if item.split("=")[0] in RUN_KEYS]
    if named:
        parser.error(f"{', '.join(named)}: each run's name sets {', '.join(RUN_KEYS)}; choose the runs with --only "
                     f"(e.g. --only bf16-noac-zero1-compile,hf-bf16-noac-zero1-compile)")
    try:
        runs = select_runs(args.only)
    except ValueError as error:
        parser.error(str(error))
    model_config = Path(args.model_config).expanduser()
    if not model_config.is_absolute() and not model_config.exists():
        model_config = REPO / model_config  # the default and the examples count from the repository
    if not model_config.exists():
        parser.error(f"--model-config: no file {args.model_config}")
    args.model_config = str(model_config.resolve())

    gpu = probe_gpu()
    if gpu is None and not args.allow_cpu:
        print("gpu_throughput: no CUDA GPU here (torch.cuda.is_available() is False); nothing was launched. "
              "Run this on a machine with an NVIDIA GPU (FP8 needs compute capability 8.9+: H100, H200, L4, L40S, "
              "B200), or pass --allow-cpu with a tiny --model-config for a smoke check of the plumbing.",
              file=sys.stderr)
        return 2
    if gpu and gpu["count"] > 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
        print(f"note: {gpu['count']} GPUs here; each run uses 1 (the launcher's --num_gpus 1: GPU 0)", file=sys.stderr)

    args.output = args.output.resolve()
    args.output.mkdir(parents=True, exist_ok=True)
    head = header(args, gpu, runs)
    print(head, flush=True)
    results = []
    for index, run in enumerate(runs, 1):
        print(f"[{index}/{len(runs)}] {run.name} ...", end=" ", flush=True)
        result = launch(args, run)
        results.append(result)
        if result.error:
            print(f"FAILED in {result.seconds:.0f} s: {result.error}", flush=True)
        else:
            print(f"{result.summary['mean_tokens_per_s']:,.0f} tokens/s ({result.seconds:.0f} s)", flush=True)
        write_results(args, head, rows(results))  # after each run: a long sweep that dies keeps what it had
    table = rows(results)
    print()
    print(markdown(table))
    print(f"\nwritten: {args.output / 'results.md'}, {args.output / 'results.csv'}; logs: {args.output}/<run>.log")
    return 0 if any(not result.error for result in results) else 1  # failed runs are rows; none succeeding is not


if __name__ == "__main__":
    sys.exit(main())
