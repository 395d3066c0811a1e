"""GRPO's generation engines side by side (grpo.generation_engine: training/objectives/grpo/sampling.py).

    python benchmarks/generation_engines.py                     # a GPU: the 1.24B Llama in bf16, 8, 64, 512
    python benchmarks/generation_engines.py --model-config benchmarks/llama_100m/config.json \\
        --prompt-len 16 --completion-len 16 --grpo-steps 10     # a CPU (fp32): the ~100M Llama, and the GRPO runs

Part one samples with each engine at each batch, GRPO's `sample` under `decoding` as a run does: the same seeds, so
the same completions (tests/training/objectives/grpo/test_sampling.py). The model is built from its config with
random weights, so no completion ends early; the prompts are random tokens of one length. At each batch the engines
take turns at going first, each timed after an untimed call at that batch (the caching allocator and kernels
warmed for its shapes): seconds, completions/s, completion tokens/s, milliseconds per decoding pass, the ratio to
generate, and on a GPU of flops.py's table the floor (what the passes read at its bandwidth: grpo/memory.py,
decoding_reads) and each engine's ratio to it.

Part two (--grpo-steps N) runs train.py --recipe tiny_llama_grpo (its model: --grpo-model, else a random tiny_llama
checkpoint saved here) with each engine for N steps, the same steps and completions, engines in turn: the wall time
of the whole run, the mean step and the seconds a step generated (summary.json's generation_time_s), and the ratio
of wall times to generate's. Writes table.md to --output when given.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.generation_batch import seconds, write_table  # noqa: E402
from training.objectives.grpo.memory import decoding_reads  # noqa: E402
from training.objectives.grpo.sampling import decoding, sample  # noqa: E402
from training.objectives.grpo.spec import GrpoSection  # noqa: E402
from training.parallel.launch import launcher_command  # noqa: E402
from training.planning.flops import gpu_spec  # noqa: E402
from training.planning.shape import model_shape  # noqa: E402

ENGINES = ("generate", "static")


def sampler(model: torch.nn.Module, prompts: torch.Tensor, section: GrpoSection, eos_id: int) -> Callable[[], object]:
    rows = list(prompts)

    def call() -> None:
        with decoding(model, "sdpa"):
            sample(model, rows, list(range(len(rows))), section, eos_id, pad_id=0, synced=False)
    return call


def engine_table(args: argparse.Namespace) -> list[str]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(args.model_config)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    shape = model_shape(config)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    spec = gpu_spec(name)
    eos_id = config.vocab_size  # no token ends a completion early
    lines = [f"{args.model_config.parent.name}: {shape.parameters:,} parameters, {dtype}, {name}, "
             f"{torch.get_num_threads()} threads; prompts of {args.prompt_len} tokens, {args.completion_len} new "
             f"tokens each (decoding passes)", "",
             "| completions | engine | s | completions/s | tokens/s | ms per pass | vs generate | floor s "
             "| vs floor |", "|---|---|---|---|---|---|---|---|---|"]
    for turn, batch in enumerate(int(b) for b in args.batches.split(",")):
        prompts = torch.randint(3, config.vocab_size, (batch, args.prompt_len), device=device)
        timed = {}
        for engine in ENGINES[turn % 2:] + ENGINES[:turn % 2]:
            section = GrpoSection(max_completion_length=args.completion_len, generation_engine=engine)
            call = sampler(model, prompts, section, eos_id)
            call()
            timed[engine] = seconds(call, device)
        floor = decoding_reads(shape, dtype.itemsize, batch, args.prompt_len, args.completion_len) / spec.bandwidth \
            if spec else None
        for engine in ENGINES:
            took = timed[engine]
            floor_cells = f"{floor:.3f} | {took / floor:.1f}" if floor else "- | -"
            lines.append(f"| {batch} | {engine} | {took:.2f} | {batch / took:,.1f} | "
                         f"{batch * args.completion_len / took:,.0f} | {1000 * took / args.completion_len:.1f} | "
                         f"{timed['generate'] / took:.2f}x | {floor_cells} |")
            print(lines[-1], flush=True)
    return lines


def tiny_checkpoint(path: Path) -> Path:
    """tiny_llama's architecture and tokenizer with seeded random weights, saved as a user's checkpoint."""
    config = AutoConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer").save_pretrained(path)
    return path


def grpo_table(args: argparse.Namespace) -> list[str]:
    lines = ["", f"train.py --recipe tiny_llama_grpo, {args.grpo_steps} steps, {args.num_gpus} rank(s), each engine",
             "", "| engine | wall s | summary's wall s per step | generation s per step | wall vs generate |",
             "|---|---|---|---|---|"]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.grpo_model or tiny_checkpoint(Path(tmp) / "model")
        for turn in range(args.repeats):
            for engine in ENGINES[turn % 2:] + ENGINES[:turn % 2]:
                out = Path(tmp) / engine
                command = launcher_command(args.num_gpus, "train.py", [
                    "--recipe", "tiny_llama_grpo", "--output-dir", str(out), "--overwrite",
                    f"model.name_or_path={model}", f"training.max_steps={args.grpo_steps}",
                    "checkpointing.every_steps=null", "grpo.log_completions_every=null",
                    f"grpo.generation_engine={engine}"])
                started = time.perf_counter()
                result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                                        env=dict(os.environ, PYTHONUNBUFFERED="1"))
                wall = time.perf_counter() - started
                if result.returncode != 0:
                    sys.exit(f"train.py with {engine} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
                summary = json.loads((out / "summary.json").read_text())
                runs.setdefault(engine, []).append((wall, summary))
    best = {engine: min(runs[engine], key=lambda run: run[0]) for engine in ENGINES}
    for engine in ENGINES:
        wall, summary = best[engine]
        lines.append(f"| {engine} | {wall:.1f} | {summary['wall_time_s'] / args.grpo_steps:.2f} | "
                     f"{summary.get('generation_time_s', float('nan')):.2f} | "
                     f"{best['generate'][0] / wall:.2f}x |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", type=Path, default=REPO / "benchmarks/llama_1b/config.json")
    parser.add_argument("--batches", default="8,64,512", help="completions per generation, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--completion-len", type=int, default=128)
    parser.add_argument("--grpo-steps", type=int, default=0, help="also run tiny_llama_grpo this many steps")
    parser.add_argument("--grpo-model", help="the GRPO runs' model (default: a random tiny_llama)")
    parser.add_argument("--repeats", type=int, default=1, help="GRPO runs per engine (the fastest is shown)")
    parser.add_argument("--num-gpus", type=int, default=1, help="ranks per GRPO run (CPU ranks without a GPU)")
    parser.add_argument("--output", type=Path, help="a folder for table.md")
    args = parser.parse_args()
    write_table(engine_table(args) + (grpo_table(args) if args.grpo_steps else []), args.output)


if __name__ == "__main__":
    main()
