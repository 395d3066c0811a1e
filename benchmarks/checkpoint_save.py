"""How long a checkpoint save takes here, and what that means for the model recipes when a run is preempted.

    python benchmarks/checkpoint_save.py [--recipe tiny_llama] [--num-gpus 2] [--steps 6]
        [--output benchmarks/results/checkpoint_save]

Trains the recipe for a few steps through the `deepspeed` launcher with a checkpoint after every step, reads
each save's size and seconds from the run's console (train.py prints them), and takes the write rate of
the busiest rank (rank 0: it also writes the weights). Then, for each model recipe on the GPUs it is
written for, the --dry-run's checkpoint size (training/planning/checkpoint_size.py, checked against DeepSpeed's files in
tests/test_train_distributed.py) and the seconds its busiest rank needs at that measured rate, against the
30 s DeepSpeed's launcher allows between SIGTERM and SIGKILL. The rate is this machine's disk: rerun on
the cluster's file system for its numbers. Writes table.md (the printed table) to --output.
"""
import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import train  # noqa: E402
from benchmarks.tables import write_table  # noqa: E402
from training.parallel.launch import launcher_command  # noqa: E402
from training.planning.checkpoint_size import LAUNCHER_GRACE_S, checkpoint_bytes  # noqa: E402
from training.planning.report import format_bytes  # noqa: E402

RECIPE_GPUS = {"llama2_7b": 8, "llama2_7b_sft": 8, "llama3_8b": 8, "mistral_7b": 8, "qwen2_5_1_5b": 1, "gpt2": 1}
SAVE_LINE = re.compile(r"checkpoint global_step(\d+): ([\d,.]+) MiB in ([\d.]+) s")


def measure(recipe: str, num_gpus: int, steps: int) -> tuple[float, float, float]:
    """(MiB per save, median seconds, the busiest rank's MiB/s), from every save but the first (warm-up)."""
    with tempfile.TemporaryDirectory() as out:
        args = ["--recipe", recipe, "--output-dir", out, f"training.max_steps={steps}", "checkpointing.every_steps=1",
                "logging.every_steps=1"]
        result = subprocess.run(launcher_command(num_gpus, "train.py", args), cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"train.py failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
        plan = train.make_plan(train.parse_args(["--recipe", recipe, "--dry-run", f"training.max_steps={steps}"]),
                               world_size=num_gpus)
    saves = [(float(mib.replace(",", "")), float(s)) for _, mib, s in SAVE_LINE.findall(result.stdout + result.stderr)]
    if len(saves) < 2:
        sys.exit(f"found {len(saves)} checkpoint lines in train.py's console; raise --steps")
    mib, seconds = saves[-1][0], statistics.median(s for _, s in saves[1:])
    size = checkpoint_bytes(plan.shape.parameters, plan.zero_stage, plan.dims.dp_size, plan.precision)
    busiest_share = size.largest_rank / size.total
    return mib, seconds, mib * busiest_share / seconds


def recipe_rows(rate_mib_s: float) -> list[list[str]]:
    rows = []
    for recipe, gpus in RECIPE_GPUS.items():
        plan = train.make_plan(train.parse_args(["--recipe", recipe, "--dry-run", "--num-gpus", str(gpus),
                                                 "--gpu-mem", "80"]))
        size = checkpoint_bytes(plan.shape.parameters, plan.zero_stage, plan.dims.dp_size,
                                plan.precision)
        seconds = size.largest_rank / 2**20 / rate_mib_s
        rows.append([recipe, f"{gpus} x ZeRO-{plan.zero_stage} {plan.precision}", format_bytes(size.total),
                     format_bytes(size.largest_rank), f"{seconds:,.0f}",
                     "yes" if seconds < LAUNCHER_GRACE_S else "no"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny_llama")
    parser.add_argument("--num-gpus", type=int, default=2, help="ranks (CPU processes without a GPU)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks/results/checkpoint_save")
    args = parser.parse_args()
    mib, seconds, rate = measure(args.recipe, args.num_gpus, args.steps)
    lines = [f"Measured: {args.recipe} on {args.num_gpus} rank(s), {mib:,.1f} MiB per save in {seconds:.2f} s "
             f"(median of {args.steps - 1} saves after the first): the busiest rank writes {rate:,.0f} MiB/s.", "",
             f"| recipe | run | checkpoint | busiest rank writes | seconds at {rate:,.0f} MiB/s | within the "
             f"launcher's {LAUNCHER_GRACE_S} s |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in recipe_rows(rate)]
    write_table(lines, args.output)


if __name__ == "__main__":
    main()
