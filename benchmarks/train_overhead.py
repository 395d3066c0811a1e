"""How much train.py costs over a bare deepspeed.initialize loop: same model, batch and DeepSpeed config.

    python benchmarks/train_overhead.py [--recipe tiny_llama] [--steps 60] [--repeats 2] [--num-gpus 1]
        [key.path=value ...]

Runs train.py (as it comes, and with its stability guard off) and benchmarks/bare_loop.py through the
`deepspeed` launcher, taking turns at going first so that drifts in machine speed hit all three, and
prints a table of tokens/s (mean after the first step). train.py runs with its default logging (a
metrics line, metrics.jsonl and TensorBoard every 10 steps) and with periodic checkpoints off, since the
bare loop saves none.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from transformers import AutoTokenizer  # noqa: E402

from data_pipeline.prepare import cached_path, prepare_dataset  # noqa: E402
from training.config.recipe import load_recipe  # noqa: E402
from training.parallel.launch import launcher_command  # noqa: E402


def launch(script: str, args: list[str], num_gpus: int) -> None:
    result = subprocess.run(launcher_command(num_gpus, script, args), cwd=REPO, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if result.returncode != 0:
        sys.exit(f"{script} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")


def run_train(recipe: str, steps: int, num_gpus: int, overrides: list[str], out: Path) -> dict:
    launch("train.py", ["--recipe", recipe, "--output-dir", str(out), "--overwrite", f"training.max_steps={steps}",
                        "checkpointing.every_steps=null", *overrides], num_gpus)
    return json.loads((out / "summary.json").read_text())


def run_bare(model_config: str, ds_config: Path, rows: Path, steps: int, num_gpus: int, result: Path) -> float:
    launch("benchmarks/bare_loop.py", ["--model-config", model_config, "--ds-config", str(ds_config),
                                       "--rows", str(rows), "--steps", str(steps), "--result", str(result)], num_gpus)
    return json.loads(result.read_text())["mean_tokens_per_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny_llama")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-gpus", type=int, default=1, help="ranks per run (CPU ranks without a GPU)")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    if recipe.model.config is None:
        sys.exit("train_overhead.py builds the model from model.config; this recipe loads a checkpoint")

    tokenizer = AutoTokenizer.from_pretrained(recipe.tokenizer_path)
    prepare_dataset(recipe.data, tokenizer)  # once here, so neither timed run pays for it
    rows = cached_path(recipe.data, tokenizer)
    guard_off = ["stability.enabled=false"]  # the stability guard reads every step's loss: its cost on its own
    speeds = {"train.py": [], "train.py, stability off": [], "bare loop": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "train"
        for repeat in range(args.repeats):
            # each loop goes first in turn (train.py in the first repeat: its ds_config.json feeds the bare loop)
            names = list(speeds)
            for name in names[repeat % 3:] + names[:repeat % 3]:
                if name.startswith("train.py"):
                    overrides = args.overrides + (guard_off if name.endswith("off") else [])
                    summary = run_train(args.recipe, args.steps, args.num_gpus, overrides, out)
                    speeds[name].append(summary["mean_tokens_per_s"])
                else:
                    speeds[name].append(run_bare(recipe.model.config, out / "ds_config.json", rows, args.steps,
                                                 args.num_gpus, Path(tmp) / "bare.json"))
    baseline = statistics.median(speeds["bare loop"])
    print(f"{args.recipe}: {args.steps} steps x {recipe.training.global_batch_size} rows x "
          f"{recipe.data.seq_len} tokens, {summary['world_size']} rank(s), ZeRO-{summary['zero_stage']}, "
          f"{summary['precision']}")
    print("| loop | tokens/s per repeat | median tokens/s | vs bare loop |")
    print("|---|---|---|---|")
    for name, values in speeds.items():
        median = statistics.median(values)
        print(f"| {name} | {', '.join(f'{v:,.0f}' for v in values)} | {median:,.0f} | {median / baseline:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
