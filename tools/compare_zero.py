"""Run one recipe under several ZeRO settings on this machine, one after the other, and compare them.

    python tools/compare_zero.py --recipe tiny_llama --stages 0,1,2,3 --num-gpus 2
    python tools/compare_zero.py --recipe llama2_7b --stages 1,2,3,3_offload --num-gpus 8 --steps 30

Every stage runs the same recipe, seed and data through the real `deepspeed` launcher and train.py
(`deepspeed.config=zero<stage>`), for --steps steps, logging every step. Written to --output-dir:
  comparison.md / comparison.csv  per stage: tokens/s (mean after step 1), TFLOP/s and MFU (GPU), peak memory per
                                  rank (GPU: allocated and reserved; CPU: resident set size), model-state memory
                                  measured in the run, DeepSpeed's estimate for the same setting, final loss and
                                  the largest loss difference from the reference stage (0, else the first listed)
  comparison.png                  loss curves, throughput and memory bars
  zero<stage>/, zero<stage>.log   each run's own output folder and console log
A stage that cannot run (refused by the checks, or failing, e.g. out of memory) is a row with its error.
"""
import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from training.errors import ConfigError, exit_code, positive_int  # noqa: E402
from training.launch import failure_reason, launcher_command  # noqa: E402
from training.memory import ZERO_SETTINGS  # noqa: E402
from training.plan import planned_model_states  # noqa: E402
from training.recipe import load_recipe  # noqa: E402

import train  # noqa: E402

COLUMNS = ("stage", "status", "tokens_per_s", "tflops", "mfu", "peak_mem_bytes", "peak_mem_reserved_bytes",
           "model_states_bytes", "model_states_host_bytes", "estimated_model_states_bytes", "estimate_source",
           "final_loss", "max_loss_diff", "error")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--stages", default="0,1,2,3", help=f"comma-separated, of {', '.join(ZERO_SETTINGS)}")
    parser.add_argument("--num-gpus", type=positive_int, default=1, help="ranks on this machine (GPUs, or CPU processes)")
    parser.add_argument("--steps", type=positive_int, default=30, help="training steps per stage (default 30)")
    parser.add_argument("--output-dir", type=Path, help="default: outputs/compare_zero-<recipe>")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="applied to every stage")
    args = parser.parse_intermixed_args(argv)
    args.stages = args.stages.split(",")
    unknown = [stage for stage in args.stages if stage not in ZERO_SETTINGS]
    if unknown:
        parser.error(f"--stages: unknown {', '.join(unknown)}; choose from {', '.join(ZERO_SETTINGS)}")
    return args


def stage_overrides(args: argparse.Namespace, stage: str) -> list[str]:
    return [*args.overrides, f"deepspeed.config=zero{stage}", f"training.max_steps={args.steps}", "logging.every_steps=1"]


def check_stage(args: argparse.Namespace, stage: str) -> tuple[dict | None, str | None]:
    """train.py's own checks for this stage on --num-gpus ranks, before anything runs: (the estimate, None) or
    (None, the error)."""
    train_args = train.parse_args(["--recipe", args.recipe, "--dry-run", *stage_overrides(args, stage)])
    try:
        plan = train.make_plan(train_args, world_size=args.num_gpus)
    except ConfigError as error:
        return None, str(error)
    try:
        states = planned_model_states(plan)
        return {"estimated_model_states_bytes": states.device_bytes, "estimate_source": states.source}, None
    except ValueError:
        return {"estimate_source": f"none for {plan.precision}"}, None


def run_stage(args: argparse.Namespace, stage: str, output_dir: Path) -> str | None:
    """Train the stage through the deepspeed launcher, the console going to zero<stage>.log; the error or None."""
    command = launcher_command(args.num_gpus, str(REPO / "train.py"), [
        "--recipe", args.recipe, "--output-dir", str(output_dir / f"zero{stage}"), "--overwrite",
        *stage_overrides(args, stage)])
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.num_gpus)))
    log_path = output_dir / f"zero{stage}.log"
    print(f"ZeRO-{stage}: {' '.join(command)}", flush=True)
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
    checked = {stage: check_stage(args, stage) for stage in args.stages}  # all refusals before the first run
    if all(error for _, error in checked.values()):
        raise ConfigError("every stage is refused by train.py's checks:\n" + "\n".join(
            f"  ZeRO-{stage}: {error}" for stage, (_, error) in checked.items()))
    output_dir.mkdir(parents=True, exist_ok=True)
    rows, curves = [], {}
    for stage in args.stages:
        estimate, error = checked[stage]
        row = {"stage": stage, **(estimate or {})}
        error = error or run_stage(args, stage, output_dir)
        if error is None:
            measured, curves[stage] = read_run(output_dir / f"zero{stage}")
            row.update(measured)
        else:
            row.update(status="failed", error=error)
            print(f"ZeRO-{stage} failed: {error}", file=sys.stderr)
        rows.append(row)
    reference = reference_stage(curves)
    for row in rows:
        if row["stage"] in curves:
            steps = curves[reference].keys() & curves[row["stage"]].keys()
            row["max_loss_diff"] = max(abs(curves[row["stage"]][s] - curves[reference][s]) for s in steps)
    return rows, curves


def reference_stage(curves: dict[str, dict[int, float]]) -> str | None:
    """The stage the others' losses are compared with: ZeRO-0 when it ran, else the first that did."""
    return "0" if "0" in curves else next(iter(curves), None)


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.3f}"


def markdown(rows: list[dict], args: argparse.Namespace, reference: str | None) -> str:
    on_gpu = any(row.get("tflops") is not None for row in rows)
    memory = "peak alloc. / reserved GiB" if on_gpu else "peak RSS GiB"
    header = ["ZeRO", "tokens/s", *(["TFLOP/s", "MFU"] if on_gpu else []), memory, "model states GiB (measured)",
              "estimated GiB (by)", "final loss", f"max loss diff vs ZeRO-{reference}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"| {row['stage']} | failed: {row['error']} |" + " |" * (len(header) - 2))
            continue
        peak = gib(row["peak_mem_bytes"]) + (f" / {gib(row['peak_mem_reserved_bytes'])}" if on_gpu else "")
        states = gib(row["model_states_bytes"]) + (f" (+{gib(row['model_states_host_bytes'])} CPU)"
                                                   if row.get("model_states_host_bytes") else "")
        estimate = (f"{gib(row['estimated_model_states_bytes'])} ({row['estimate_source']})"
                    if row.get("estimated_model_states_bytes") is not None else row.get("estimate_source", "-"))
        cells = [row["stage"].replace("_", " + "), f"{row['tokens_per_s']:,.0f}",
                 *([f"{row['tflops']:.1f}", f"{row['mfu']:.1%}" if row.get("mfu") else "-"] if on_gpu else []),
                 peak, states, estimate, f"{row['final_loss']:.4f}", f"{row['max_loss_diff']:.2e}"]
        lines.append("| " + " | ".join(cells) + " |")
    command = " ".join(["python tools/compare_zero.py", "--recipe", args.recipe, "--stages", ",".join(args.stages),
                        "--num-gpus", str(args.num_gpus), "--steps", str(args.steps), *args.overrides])
    return (f"# ZeRO stages compared: {args.recipe}, {args.num_gpus} rank(s), {args.steps} steps\n\n`{command}`\n\n"
            + "\n".join(lines) + "\n\nModel states measured: every tensor the rank holds as its second optimizer "
            "step starts (weights, gradients, master weights, optimizer states), largest rank. Peak memory on a "
            "CPU is the process's resident set (libraries included).\n")


def plot(rows: list[dict], curves: dict[str, dict[int, float]], reference: str | None, path: Path,
         title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = [row for row in rows if row["status"] == "ok"]
    labels = [f"ZeRO-{row['stage'].replace('_', '+')}" for row in done]
    figure, ((losses, differences), (speed, memory)) = plt.subplots(2, 2, figsize=(14, 9))
    for label, row, style in zip(labels, done, ["-", "--", "-.", ":"] * 2):
        curve = curves[row["stage"]]
        steps = sorted(curve)
        losses.plot(steps, [curve[s] for s in steps], style, label=label)
        if row["stage"] != reference:
            differences.plot(steps, [max(abs(curve[s] - curves[reference][s]), 1e-9) for s in steps], style,
                             label=label)
    losses.set(title="training loss", xlabel="step", ylabel="loss")
    losses.legend()
    differences.set(title=f"|loss - loss of ZeRO-{reference}| (equal shown as 1e-9)", xlabel="step", yscale="log")
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
    load_recipe(args.recipe, args.overrides)  # what every stage shares is checked once, before anything runs
    args.output_dir = args.output_dir or REPO / "outputs" / f"compare_zero-{Path(args.recipe).name}"
    rows, curves = compare(args)
    reference = reference_stage(curves)
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
