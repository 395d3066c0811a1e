"""compare.py's reports of its cells: comparison.csv, comparison.md and comparison.png (its docstring says what
each holds)."""
import argparse
import csv
from pathlib import Path

from training.base.strict_json import dumps

COLUMNS = ("cell", "status", "tokens_per_s", "tflops", "mfu", "peak_mem_bytes", "peak_mem_reserved_bytes",
           "model_states_bytes", "model_states_host_bytes", "estimated_model_states_bytes", "estimate_source",
           "planned_peak_bytes", "generation_time_s", "first_reward", "final_reward", "source_tokens", "eval_loss",
           "final_loss", "max_loss_diff", "error")


def write_reports(rows: list[dict], curves: dict[str, dict[int, float]], reference: str | None,
                  args: argparse.Namespace) -> None:
    """The three reports in args.output_dir; `reference`: the cell the others' losses are compared with."""
    with (args.output_dir / "comparison.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({**row, "source_tokens": dumps(row["source_tokens"])} if row.get("source_tokens") else row
                         for row in rows)
    (args.output_dir / "comparison.md").write_text(markdown(rows, args, reference))
    plot(rows, curves, reference, args.output_dir / "comparison.png",
         f"{args.recipe}: {args.num_gpus} rank(s), {args.steps} steps")


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.3f}"


def markdown(rows: list[dict], args: argparse.Namespace, reference: str | None) -> str:
    on_gpu = any(row.get("tflops") is not None for row in rows)
    generating = any(row.get("generation_time_s") is not None for row in rows)
    phased, evaluated = (any(row.get(key) is not None for row in rows) for key in ("source_tokens", "eval_loss"))
    memory = "peak alloc. / reserved GiB" if on_gpu else "peak RSS GiB"
    header = ["setting", "tokens/s", *(["TFLOP/s", "MFU"] if on_gpu else []), memory, "planned peak GiB",
              "model states GiB (measured)", "estimated GiB (by)",
              *(["generation s/step", "reward (first -> last)"] if generating else []),
              *(["tokens per source"] if phased else []), *(["eval loss"] if evaluated else []),
              "final loss", f"max loss diff vs {reference}"]
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
                 peak, gib(row.get("planned_peak_bytes")), states, estimate,
                 *([f"{row['generation_time_s']:.2f}", f"{row['first_reward']:.3f} -> {row['final_reward']:.3f}"]
                   if generating else []),
                 *([", ".join(f"{label} {tokens:,}" for label, tokens in (row.get("source_tokens") or {}).items())
                    or "-"] if phased else []),
                 *([f"{row['eval_loss']:.4f}" if row.get("eval_loss") is not None else "-"] if evaluated else []),
                 f"{row['final_loss']:.4f}", f"{row['max_loss_diff']:.2e}"]
        lines.append("| " + " | ".join(cells) + " |")
    command = " ".join(["python tools/compare.py", "--recipe", args.recipe, *[f"--vary {vary}" for vary in args.vary],
                        "--num-gpus", str(args.num_gpus), "--steps", str(args.steps), *args.overrides])
    return (f"# {args.recipe} compared: {args.num_gpus} rank(s), {args.steps} steps\n\n`{command}`\n\n"
            + "\n".join(lines) + "\n\nModel states measured: every tensor the rank holds as its second optimizer "
            "step starts (weights, gradients, master weights, optimizer states), largest rank. Peak memory on a "
            "CPU is the process's resident set (libraries included); the planned peak (model states with one "
            "micro-batch's activations, or a GRPO generation where larger) compares with a GPU's allocated peak."
            + (" Generation s/step (GRPO): the seconds a step spent generating, the mean after step 1; "
               "reward: the first and the last logged step's mean reward (a GRPO loss is no measure of progress)."
               if generating else "") + "\n")


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
