"""Run one recipe under several settings of any recipe knob on this machine, one after the other, and compare.

    python tools/compare.py --recipe tiny_llama --vary optimizer.name=adamw,lion,muon --num-gpus 2
    python tools/compare.py --recipe tiny_llama --vary deepspeed.config=zero1,zero3 --vary precision=fp32,bf16
    python tools/compare.py --recipe llama2_7b --vary activation_checkpointing=false,true --num-gpus 8 --steps 30

Each --vary KEY=V1,V2,... is a recipe key and its values (commas inside [...] or {...} belong to the value);
several --vary make a grid, every combination a cell. Every cell runs the same recipe, seed and data through
the real `deepspeed` launcher and train.py, for --steps steps, logging every step. Written to --output-dir:
  comparison.md / comparison.csv  per cell: tokens/s (mean after step 1), TFLOP/s and MFU (GPU), peak memory per
                                  rank (GPU: allocated and reserved; CPU: resident set size), model-state memory
                                  measured in the run, the plan's estimate for the same cell, final loss and the
                                  largest loss difference from the first cell that ran
  comparison.png                  loss curves, throughput and memory bars
  <cell>/, <cell>.log             each run's own output folder and console log
A cell that cannot run (refused by train.py's checks, all of them made before the first launch, or failing,
e.g. out of memory) is a row with its error. tools/compare_zero.py is the short form for ZeRO stages.
"""
import argparse
import csv
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from training.errors import ConfigError, exit_code, positive_int  # noqa: E402
from training.launch import failure_reason, launcher_command  # noqa: E402
from training.plan import planned_model_states  # noqa: E402
from training.recipe import load_recipe  # noqa: E402

import train  # noqa: E402

COLUMNS = ("cell", "status", "tokens_per_s", "tflops", "mfu", "peak_mem_bytes", "peak_mem_reserved_bytes",
           "model_states_bytes", "model_states_host_bytes", "estimated_model_states_bytes", "estimate_source",
           "final_loss", "max_loss_diff", "error")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--vary", action="append", required=True, metavar="KEY=V1,V2,...",
                        help="a recipe key and the values to compare; repeat for a grid")
    parser.add_argument("--num-gpus", type=positive_int, default=1, help="ranks on this machine (GPUs, or CPU processes)")
    parser.add_argument("--steps", type=positive_int, default=30, help="training steps per cell (default 30)")
    parser.add_argument("--output-dir", type=Path, help="default: outputs/compare-<recipe>")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="applied to every cell")
    args = parser.parse_intermixed_args(argv)
    varied = []
    for vary in args.vary:
        key, _, values = vary.partition("=")
        if not key or not values:
            parser.error(f"--vary {vary}: write KEY=V1,V2,... (e.g. optimizer.name=adamw,lion)")
        varied.append([f"{key}={value}" for value in re.split(r",(?![^\[{]*[\]}])", values)])
    args.cells = [list(cell) for cell in itertools.product(*varied)]
    return args


def cell_name(cell: list[str]) -> str:
    return ", ".join(cell)


def cell_folder(cell: list[str]) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", "__".join(cell))


def cell_overrides(args: argparse.Namespace, cell: list[str]) -> list[str]:
    return [*args.overrides, *cell, f"training.max_steps={args.steps}", "logging.every_steps=1"]


def check_cell(args: argparse.Namespace, cell: list[str]) -> tuple[dict | None, str | None]:
    """train.py's own checks for this cell on --num-gpus ranks, before anything runs: (the estimate, None) or
    (None, the error)."""
    train_args = train.parse_args(["--recipe", args.recipe, "--dry-run", *cell_overrides(args, cell)])
    try:
        plan = train.make_plan(train_args, world_size=args.num_gpus)
    except ConfigError as error:
        return None, str(error)
    try:
        states = planned_model_states(plan)
        return {"estimated_model_states_bytes": states.device_bytes, "estimate_source": states.source}, None
    except ValueError:
        return {"estimate_source": f"none for {plan.precision}"}, None


def run_cell(args: argparse.Namespace, cell: list[str], output_dir: Path) -> str | None:
    """Train the cell through the deepspeed launcher, the console going to <cell>.log; the error or None."""
    command = launcher_command(args.num_gpus, str(REPO / "train.py"), [
        "--recipe", args.recipe, "--output-dir", str(output_dir / cell_folder(cell)), "--overwrite",
        *cell_overrides(args, cell)])
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.num_gpus)))
    log_path = output_dir / f"{cell_folder(cell)}.log"
    print(f"{cell_name(cell)}: {' '.join(command)}", flush=True)
    with log_path.open("w") as log:
        returncode = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if returncode == 0:
        return None
    return f"exit {returncode}: {failure_reason(log_path.read_text())} (log: {log_path})"


def read_run(run_dir: Path) -> tuple[dict, dict[int, float]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = {record["step"]: record["loss"] for record in map(json.loads, (run_dir / "metrics.jsonl").open())
              if "event" not in record}  # stability events have lines of their own
    measured = summary.get("model_state_bytes") or {}
    device = "cuda" if "cuda" in measured else "cpu"
    row = {"status": "ok", "tokens_per_s": summary["mean_tokens_per_s"], "tflops": summary.get("tflops"),
           "mfu": summary.get("mfu"), "peak_mem_bytes": summary["peak_mem_bytes"],
           "peak_mem_reserved_bytes": summary.get("peak_mem_reserved_bytes"),
           "model_states_bytes": measured.get(device),
           "model_states_host_bytes": measured.get("cpu") if device == "cuda" else None,
           "final_loss": summary["final_loss"]}
    return row, losses


def compare(args: argparse.Namespace) -> tuple[list[dict], dict[str, dict[int, float]]]:
    output_dir = args.output_dir
    checked = [check_cell(args, cell) for cell in args.cells]  # all refusals before the first run
    if all(error for _, error in checked):
        raise ConfigError("every cell is refused by train.py's checks:\n" + "\n".join(
            f"  {cell_name(cell)}: {error}" for cell, (_, error) in zip(args.cells, checked)))
    output_dir.mkdir(parents=True, exist_ok=True)
    rows, curves = [], {}
    for cell, (estimate, error) in zip(args.cells, checked):
        name = cell_name(cell)
        row = {"cell": name, **(estimate or {})}
        error = error or run_cell(args, cell, output_dir)
        if error is None:
            measured, curves[name] = read_run(output_dir / cell_folder(cell))
            row.update(measured)
        else:
            row.update(status="failed", error=error)
            print(f"{name} failed: {error}", file=sys.stderr)
        rows.append(row)
    reference = reference_cell(curves)
    for row in rows:
        if row["cell"] in curves:
            steps = curves[reference].keys() & curves[row["cell"]].keys()
            row["max_loss_diff"] = max(abs(curves[row["cell"]][s] - curves[reference][s]) for s in steps)
    return rows, curves


def reference_cell(curves: dict[str, dict[int, float]]) -> str | None:
    """The cell the others' losses are compared with: the first that ran."""
    return next(iter(curves), None)


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.3f}"


def markdown(rows: list[dict], args: argparse.Namespace, reference: str | None) -> str:
    on_gpu = any(row.get("tflops") is not None for row in rows)
    memory = "peak alloc. / reserved GiB" if on_gpu else "peak RSS GiB"
    header = ["setting", "tokens/s", *(["TFLOP/s", "MFU"] if on_gpu else []), memory, "model states GiB (measured)",
              "estimated GiB (by)", "final loss", f"max loss diff vs {reference}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"| {row['cell']} | failed: {row['error']} |" + " |" * (len(header) - 2))
            continue
        peak = gib(row["peak_mem_bytes"]) + (f" / {gib(row['peak_mem_reserved_bytes'])}" if on_gpu else "")
        states = gib(row["model_states_bytes"]) + (f" (+{gib(row['model_states_host_bytes'])} CPU)"
                                                   if row.get("model_states_host_bytes") else "")
        estimate = (f"{gib(row['estimated_model_states_bytes'])} ({row['estimate_source']})"
                    if row.get("estimated_model_states_bytes") is not None else row.get("estimate_source", "-"))
        cells = [row["cell"], f"{row['tokens_per_s']:,.0f}",
                 *([f"{row['tflops']:.1f}", f"{row['mfu']:.1%}" if row.get("mfu") else "-"] if on_gpu else []),
                 peak, states, estimate, f"{row['final_loss']:.4f}", f"{row['max_loss_diff']:.2e}"]
        lines.append("| " + " | ".join(cells) + " |")
    command = " ".join(["python tools/compare.py", "--recipe", args.recipe, *[f"--vary {vary}" for vary in args.vary],
                        "--num-gpus", str(args.num_gpus), "--steps", str(args.steps), *args.overrides])
    return (f"# {args.recipe} compared: {args.num_gpus} rank(s), {args.steps} steps\n\n`{command}`\n\n"
            + "\n".join(lines) + "\n\nModel states measured: every tensor the rank holds as its second optimizer "
            "step starts (weights, gradients, master weights, optimizer states), largest rank. Peak memory on a "
            "CPU is the process's resident set (libraries included).\n")


def plot(rows: list[dict], curves: dict[str, dict[int, float]], reference: str | None, path: Path,
         title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = [row for row in rows if row["status"] == "ok"]
    labels = [row["cell"] for row in done]
    figure, ((losses, differences), (speed, memory)) = plt.subplots(2, 2, figsize=(14, 9))
    for label, row, style in zip(labels, done, ["-", "--", "-.", ":"] * 2):
        curve = curves[row["cell"]]
        steps = sorted(curve)
        losses.plot(steps, [curve[s] for s in steps], style, label=label)
        if row["cell"] != reference:
            differences.plot(steps, [max(abs(curve[s] - curves[reference][s]), 1e-9) for s in steps], style,
                             label=label)
    losses.set(title="training loss", xlabel="step", ylabel="loss")
    losses.legend()
    differences.set(title=f"|loss - loss of {reference}| (equal shown as 1e-9)", xlabel="step", yscale="log")
    if len(done) > 1:
        differences.legend()
    speed.bar(labels, [row["tokens_per_s"] for row in done], color="tab:blue")
    speed.set(title="throughput (mean after step 1)", ylabel="tokens/s")
    x = range(len(done))
    for offset, key, label in ((-0.27, "peak_mem_bytes", "peak"), (0, "model_states_bytes", "model states, measured"),
                               (0.27, "estimated_model_states_bytes", "model states, estimated")):
        memory.bar([i + offset for i in x], [(row.get(key) or 0) / 2**30 for row in done], width=0.27, label=label)
    memory.set_xticks(list(x), labels)
    memory.set(title="memory per rank", ylabel="GiB")
    memory.legend(fontsize="small")
    for axes in (speed, memory):
        axes.tick_params(axis="x", labelrotation=20)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return exit_code(lambda: compare_and_report(args))


def compare_and_report(args: argparse.Namespace) -> int:
    load_recipe(args.recipe, args.overrides)  # what every cell shares is checked once, before anything runs
    args.output_dir = args.output_dir or REPO / "outputs" / f"compare-{Path(args.recipe).name}"
    rows, curves = compare(args)
    reference = reference_cell(curves)
    with (args.output_dir / "comparison.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (args.output_dir / "comparison.md").write_text(markdown(rows, args, reference))
    plot(rows, curves, reference, args.output_dir / "comparison.png",
         f"{args.recipe}: {args.num_gpus} rank(s), {args.steps} steps")
    print((args.output_dir / "comparison.md").read_text())
    print(f"written: {args.output_dir}/comparison.md, comparison.csv, comparison.png")
    return 0 if curves else 1


if __name__ == "__main__":
    sys.exit(main())
