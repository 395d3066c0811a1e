"""GRPO's generation engines side by side (grpo.generation_engine: training/objectives/grpo/sampling.py, and
vllm_engine.py's server, from the environment `bash tools/vllm_env.sh` builds).

    python benchmarks/generation_engines.py                     # a GPU: the 1.24B Llama in bf16, 8, 64, 512
    python benchmarks/generation_engines.py --model-config benchmarks/llama_100m/config.json \\
        --prompt-len 16 --completion-len 16 --grpo-steps 10     # a CPU (fp32): the ~100M Llama, and the GRPO runs

Part one samples with each engine at each batch: the in-process engines through GRPO's `sample` under `decoding` as a
run does (the same seeds, so the same completions: tests/training/objectives/grpo/test_sampling.py), vllm through
Engine.sample, one seeded request per completion, from a server started here before any timing (its start is
reported, not timed in). The model is built from its config with random weights, and no completion ends early (no
EOS: vLLM's ignore_eos); the prompts are random tokens of one length, and the server's tokenizer has one word per
id of the model's vocabulary. At each batch the engines take turns at going first, each timed after an untimed call
at that batch (the caching allocator, kernels and the server warmed for its shapes): seconds, completions/s,
completion tokens/s, milliseconds per decoding pass, the ratio to generate, and on a GPU of flops.py's table the
floor (what the passes read at its bandwidth: grpo/memory.py, decoding_reads) and each engine's ratio to it.

Part two (--grpo-steps N) runs train.py --recipe tiny_llama_grpo (its model: --grpo-model, else a random tiny_llama
checkpoint saved here) with each engine for N steps, the same steps and completions, engines in turn (vllm's runs
connect to one server started here, which each run's first generation pushes its weights into): the wall time of the
whole run, the mean step and the seconds a step generated (summary.json's generation_time_s), the reward from the
first logged step to the last, and the ratio of wall times to generate's. Writes table.md to --output when given,
and curve.md, each engine's reward at every logged step side by side.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.generation_batch import seconds  # noqa: E402
from benchmarks.tables import write_table  # noqa: E402
from training.base.errors import EngineError  # noqa: E402
from training.config.precision import Precision  # noqa: E402
from training.config.recipe import load_recipe  # noqa: E402
from training.objectives.grpo.memory import decoding_reads  # noqa: E402
from training.objectives.grpo.sampling import decoding, sample  # noqa: E402
from training.objectives.grpo.spec import GrpoSection  # noqa: E402
from training.objectives.grpo.vllm_engine import SERVER_LOG, Engine, server_python  # noqa: E402
from training.parallel.launch import free_port, launcher_command  # noqa: E402
from training.planning.flops import gpu_spec  # noqa: E402
from training.planning.shape import model_shape  # noqa: E402

ENGINES = ("generate", "static", "compiled", "vllm")


def sampler(model: torch.nn.Module, prompts: torch.Tensor, section: GrpoSection, eos_id: int) -> Callable[[], object]:
    rows = list(prompts)

    def call() -> None:
        with decoding(model, "sdpa", section.engine):
            sample(model, rows, list(range(len(rows))), section, eos_id, pad_id=0, synced=False)
    return call


def word_per_id(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer of `vocab_size` words, one per id, for a server whose prompts are ids and whose text is not read."""
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2")


def started_server(model: torch.nn.Module, tokenizer, section: GrpoSection, precision: Precision, max_len: int,
                   folder: Path) -> Engine:
    """A vLLM server holding `model`'s weights, started and answering; its start's seconds printed."""
    if not server_python(section).exists():
        sys.exit(f"vllm: no {section.vllm_environment}: build it with `bash tools/vllm_env.sh`, or leave vllm out "
                 f"of --engines")
    engine = Engine(section, precision, max_len, folder / SERVER_LOG)
    started = time.perf_counter()
    engine.start(model, tokenizer, zero3=False)
    try:
        engine.wait()
    except EngineError as error:  # its log is in the work folder, which goes with the script
        sys.exit(f"{error}\n{(folder / SERVER_LOG).read_text()[-3000:]}")
    print(f"vLLM server started and answering in {time.perf_counter() - started:.0f} s (not timed in)", flush=True)
    return engine


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
    batches, engines = [int(b) for b in args.batches.split(",")], args.engines
    server = None
    if "vllm" in engines:
        kv_gib = math.ceil(2 * shape.num_layers * shape.kv_dim * dtype.itemsize * max(batches) *
                           (args.prompt_len + args.completion_len) / 2 ** 30 + 0.25)  # every completion at once
        section = GrpoSection(max_completion_length=args.completion_len, generation_engine="vllm",
                              vllm_server_port=free_port(), vllm_server_timeout=900, vllm_kv_cache_gib=kv_gib)
        server = started_server(model, word_per_id(config.vocab_size), section,
                                Precision.BF16 if dtype == torch.bfloat16 else Precision.FP32,
                                args.prompt_len + args.completion_len, args.work)
    try:
        for turn, batch in enumerate(batches):
            prompts = torch.randint(3, config.vocab_size, (batch, args.prompt_len), device=device)
            timed = {}
            for engine in engines[turn % len(engines):] + engines[:turn % len(engines)]:
                if engine == "vllm":
                    ids = prompts.tolist()

                    def call(ids=ids) -> None:
                        server.sample(ids, list(range(len(ids))), eos_id=None)
                else:
                    call = sampler(model, prompts, GrpoSection(max_completion_length=args.completion_len,
                                                               generation_engine=engine), eos_id)
                call()
                timed[engine] = seconds(call, device)
            lines += batch_rows(args, shape, spec, dtype, batch, timed)
    finally:
        if server:
            server.close()
    return lines


def batch_rows(args: argparse.Namespace, shape, spec, dtype: torch.dtype, batch: int, timed: dict) -> list[str]:
    """One batch's rows, an engine each, against generate's time (the first engine's where generate is left out)."""
    floor = decoding_reads(shape, dtype.itemsize, batch, args.prompt_len, args.completion_len) / spec.bandwidth \
        if spec else None
    baseline, lines = timed.get("generate", next(iter(timed.values()))), []
    for engine in args.engines:
        took = timed[engine]
        floor_cells = f"{floor:.3f} | {took / floor:.1f}" if floor else "- | -"
        lines.append(f"| {batch} | {engine} | {took:.2f} | {batch / took:,.1f} | "
                     f"{batch * args.completion_len / took:,.0f} | {1000 * took / args.completion_len:.1f} | "
                     f"{baseline / took:.2f}x | {floor_cells} |")
        print(lines[-1], flush=True)
    return lines


def tiny_checkpoint(path: Path) -> Path:
    """tiny_llama's architecture and tokenizer with seeded random weights, saved as a user's checkpoint."""
    config = AutoConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer").save_pretrained(path)
    return path


def grpo_table(args: argparse.Namespace, work: Path) -> tuple[list[str], list[str]]:
    """Part two's table, and each engine's reward curve (curve.md)."""
    engines = args.engines
    lines = ["", f"train.py --recipe tiny_llama_grpo, {args.grpo_steps} steps, {args.num_gpus} rank(s), each engine",
             "", "| engine | wall s | summary's wall s per step | generation s per step | reward first -> last | "
             "wall vs generate |", "|---|---|---|---|---|---|"]
    model = Path(args.grpo_model) if args.grpo_model else tiny_checkpoint(work / "model")
    runs, server, connect = {}, None, []
    if "vllm" in engines:
        seq_len = load_recipe("tiny_llama_grpo", [f"model.name_or_path={model.resolve()}"]).data.seq_len
        section = GrpoSection(generation_engine="vllm", vllm_server_port=free_port(), vllm_server_timeout=900)
        server = started_server(AutoModelForCausalLM.from_pretrained(model), AutoTokenizer.from_pretrained(model),
                                section, Precision.FP32 if not torch.cuda.is_available() else Precision.BF16,
                                seq_len, work)
        connect = ["grpo.vllm_server_host=127.0.0.1", f"grpo.vllm_server_port={section.vllm_server_port}"]
    try:
        for turn in range(args.repeats):
            for engine in engines[turn % len(engines):] + engines[:turn % len(engines)]:
                out = work / engine
                command = launcher_command(args.num_gpus, "train.py", [
                    "--recipe", "tiny_llama_grpo", "--output-dir", str(out), "--overwrite",
                    f"model.name_or_path={model}", f"training.max_steps={args.grpo_steps}",
                    "checkpointing.every_steps=null", "grpo.log_completions_every=null",
                    f"grpo.generation_engine={engine}", *(connect if engine == "vllm" else [])])
                started = time.perf_counter()
                result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                                        env=dict(os.environ, PYTHONUNBUFFERED="1"))
                wall = time.perf_counter() - started
                if result.returncode != 0:
                    sys.exit(f"train.py with {engine} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
                summary = json.loads((out / "summary.json").read_text())
                rewards = {record["step"]: record["reward"] for record in map(json.loads, (
                    out / "metrics.jsonl").read_text().splitlines()) if "reward" in record}
                runs.setdefault(engine, []).append((wall, summary, rewards))
    finally:
        if server:
            server.close()
    best = {engine: min(runs[engine], key=lambda run: run[0]) for engine in engines}
    baseline = best.get("generate", best[engines[0]])[0]
    for engine in engines:
        wall, summary, rewards = best[engine]
        first, last = rewards[min(rewards)], rewards[max(rewards)]
        lines.append(f"| {engine} | {wall:.1f} | {summary['wall_time_s'] / args.grpo_steps:.2f} | "
                     f"{summary.get('generation_time_s', float('nan')):.2f} | {first:.3f} -> {last:.3f} | "
                     f"{baseline / wall:.2f}x |")
        print(lines[-1], flush=True)
    steps = sorted(best[engines[0]][2])
    curve = ["tiny_llama_grpo's reward at each logged step (metrics.jsonl), each engine's fastest run", "",
             "| step | " + " | ".join(engines) + " |", "|---" * (len(engines) + 1) + "|",
             *(f"| {step} | " + " | ".join(f"{best[engine][2].get(step, float('nan')):.3f}" for engine in engines)
               + " |" for step in steps)]
    return lines, curve


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
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--output", type=Path, help="a folder for table.md (and curve.md)")
    args = parser.parse_args()
    args.engines = args.engines.split(",")
    if unknown := set(args.engines) - set(ENGINES):
        parser.error(f"--engines: {', '.join(sorted(unknown))} is not one of {', '.join(ENGINES)}")
    with tempfile.TemporaryDirectory() as work:
        args.work = Path(work)
        lines, curve = engine_table(args), []
        if args.grpo_steps:
            more, curve = grpo_table(args, args.work)
            lines += more
    write_table(lines, args.output)
    if curve and args.output:
        (args.output / "curve.md").write_text("\n".join(curve) + "\n")


if __name__ == "__main__":
    main()
