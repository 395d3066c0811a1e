"""The seconds a checkpoint save costs the step, synchronous against asynchronous (checkpointing.asynchronous), side
by side in one invocation, per model.

    python benchmarks/checkpoint_async.py [--models tiny_llama,llama_100m] [--num-gpus 2] [--steps 8]
        [--output benchmarks/results/checkpoint_async]

Each model trains `--steps` steps through the `deepspeed` launcher twice, once per mode, saving every 2 steps, logging
every step. A step's seconds without a save are the median of the logged steps' `step_time_s` (the loop's clock
leaves the save out); a save's are train.py's console line ("checkpoint global_stepN: M MiB in S s", with "(W s of
them in the step)" where it was written in the background). The seconds of a step that includes a save are the
step's plus the save's (synchronous) or plus what the step waited for it (asynchronous); the stall share is that
wait over the synchronous save's seconds. The steps right after an asynchronous save run while its files are
written, on the same cores here: their median is a column of its own. The periodic saves count, not the last one
(the run waits for it to end). Writes table.md (the printed table) to --output.
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.tables import write_table  # noqa: E402
from training.parallel.launch import launcher_command  # noqa: E402

MODELS = {  # name: train.py overrides
    "tiny_llama": [],
    "llama_100m": ["model.config=benchmarks/llama_100m/config.json", "training.global_batch_size=2",
                   "training.micro_batch_size=1"],
}
SAVE_LINE = re.compile(r"checkpoint global_step(\d+): ([\d,.]+) MiB in ([\d.]+) s(?: \(([\d.]+) s of them in the "
                       r"step\))?")


def run(model: str, asynchronous: bool, num_gpus: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        args = ["--recipe", "tiny_llama", "--output-dir", out, *MODELS[model], f"training.max_steps={steps}",
                "checkpointing.every_steps=2", "logging.every_steps=1", f"checkpointing.asynchronous={asynchronous}",
                f"data.cache_dir={out}/cache"]
        result = subprocess.run(launcher_command(num_gpus, "train.py", args), cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"train.py failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
        records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    step_s = {r["step"]: r["step_time_s"] for r in records if "step_time_s" in r}
    saves = {int(step): (float(mib.replace(",", "")), float(s), float(waited) if waited else float(s))
             for step, mib, s, waited in SAVE_LINE.findall(result.stdout + result.stderr) if int(step) < steps}
    after_save = [step_s[s + 1] for s in saves if s + 1 in step_s]
    away = [seconds for step, seconds in step_s.items() if step > 1 and step - 1 not in saves]
    return {"step_s": statistics.median(away), "after_save_s": statistics.median(after_save),
            "mib": statistics.median(m for m, _, _ in saves.values()),
            "save_s": statistics.median(s for _, s, _ in saves.values()),
            "waited_s": statistics.median(w for _, _, w in saves.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--num-gpus", type=int, default=2, help="ranks (CPU processes without a GPU)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks/results/checkpoint_async")
    args = parser.parse_args()
    lines = [f"{args.num_gpus} rank(s), {args.steps} steps, a save every 2 (medians of the periodic saves)", "",
             "| model | checkpoint | step, no save | sync save | step with a sync save | async: step waits | step "
             "with an async save | steps while written | stall share |", "|---|---|---|---|---|---|---|---|---|"]
    for model in args.models.split(","):
        sync, background = (run(model, mode, args.num_gpus, args.steps) for mode in (False, True))
        lines.append(f"| {model} | {sync['mib']:,.1f} MiB | {sync['step_s']:.2f} s | {sync['save_s']:.2f} s | "
                     f"{sync['step_s'] + sync['save_s']:.2f} s | {background['waited_s']:.2f} s | "
                     f"{background['step_s'] + background['waited_s']:.2f} s | {background['after_save_s']:.2f} s | "
                     f"{background['waited_s'] / sync['save_s']:.0%} |")
        print(lines[-1], flush=True)
    write_table(lines, args.output)


if __name__ == "__main__":
    main()
