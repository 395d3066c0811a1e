"""The product checked on one GPU in one command, each part within its own time budget.

    python benchmarks/gpu_validate.py --output outputs/gpu_validate            # on a GPU, at most 590 s
    python benchmarks/gpu_validate.py --smoke --output /tmp/gpu_validate       # on a CPU: the plumbing, tiny sizes

Parts, in order (--parts picks some); a part that outlives its budget (or what is left of --budget) is killed
with its process group, recorded as such, and the next one starts:

    tests       the GPU pytest files: packed rows on CUDA (fp32, bf16; sdpa, eager, flash where installed),
                fp16 resume with its loss scale, FP8 against bf16 and FP8 ZeRO-3 export, QLoRA (where bitsandbytes
                is installed). Without CUDA they skip, each with its reason.
    throughput  benchmarks/gpu_throughput.py (1.24B Llama, seq 2048) on THROUGHPUT_RUNS: tokens/s, TFLOP/s, MFU,
                FP8 speed-up, the speed against the HF Trainer (same model, rows, batch and DeepSpeed config, eager
                and compiled), and the plan's peak memory against the measured one, per run.
    stages      tools/compare_zero.py on tiny_llama in fp32, ZeRO 0, 1, 2, 3, 2+offload, 3+offload on one GPU:
                its table and picture, and the invariant that every stage's loss curve equals ZeRO-0's within
                1e-5 relative.
    grpo        (only when named: python benchmarks/gpu_validate.py --parts grpo ...) tools/compare.py on
                tiny_llama_grpo's prompts with the 1.24B Llama (random weights, so every completion runs to
                max_completion_length, beta 0) under ZeRO-2 and ZeRO-3: tokens/s, the seconds a step spends in
                transformers' generate, and peak memory, per cell. Packing stays none: with every completion at
                full length bfd packs nothing, and each cell's end-of-run checkpoint (about 20 GB with its
                optimizer states) leaves no room on a 64 GB disk for four cells.

validate.md in the output folder names the device and versions and says, per part, what ran, how long it took
and what it found; each part's own files are beside it. Nothing outside the output folder is written.
"""
import argparse
import csv
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPU_TESTS = ["tests/test_gpu_invariants.py", "tests/test_train_fp16_gpu.py", "tests/test_train_fp8_gpu.py",
             "tests/test_train_qlora_gpu.py"]
STAGES = "0,1,2,3,2_offload,3_offload"
# gpu_throughput.py's runs (--only): train.py and the HF Trainer side by side, eager and compiled; --throughput-runs
# replaces the list
# (on an H200: about 45 s for the Trainer's eager run, 120 s for each compiled train.py run with its end-of-run
# checkpoint, 70 s for the Trainer's compiled run)
THROUGHPUT_RUNS = ["hf-bf16-noac-zero1", "bf16-noac-zero1-compile", "fp8-noac-zero1-compile",
                   "hf-bf16-noac-zero1-compile"]
STAGE_TOLERANCE = 1e-5  # relative, fp32
PARTS = ("tests", "throughput", "stages", "grpo")


@dataclass
class Part:
    name: str
    budget_s: int
    command: list[str]
    seconds: float = 0.0
    status: str = "not run"
    found: str = ""


def parts(args: argparse.Namespace) -> list[Part]:
    out, python = args.output, sys.executable
    tiny = ["--allow-cpu", "--model-config", "recipes/tiny_llama/config.json", "--seq-len", "64", "--steps", "2",
            "--micro-batch-size", "2", "--only", "bf16-noac-zero1,hf-bf16-noac-zero1"] if args.smoke else \
        ["--only", args.throughput_runs, "--steps", str(args.throughput_steps), "--timeout", "300"]
    small = ["model.config_overrides={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}"]
    model = REPO / ("recipes/tiny_llama/config.json" if args.smoke else "benchmarks/llama_1b/config.json")
    grpo = ["--vary", "data.packing=bfd", "deepspeed.config=zero3", "data.seq_len=32",
            "grpo.max_completion_length=16"] if args.smoke else \
        ["--vary", "deepspeed.config=zero2,zero3", "data.packing=none", "data.seq_len=160",
         "grpo.max_completion_length=128"]
    return [
        Part("tests", args.tests_budget, [python, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", *GPU_TESTS,
                                          "--junitxml", str(out / "tests.xml")]),
        Part("throughput", args.throughput_budget, [python, "benchmarks/gpu_throughput.py", "--output",
                                                    str(out / "throughput"), *tiny]),
        Part("stages", args.stages_budget, [python, "tools/compare_zero.py", "--recipe", "tiny_llama", "--stages",
                                            "0,1" if args.smoke else STAGES, "--num-gpus", "1", "--steps",
                                            "3" if args.smoke else str(args.stage_steps), "--output-dir",
                                            str(out / "stages"), "precision=fp32", "checkpointing.every_steps=null",
                                            *(small if args.smoke else [])]),
        Part("grpo", args.grpo_budget, [python, "tools/compare.py", "--recipe", "tiny_llama_grpo", "--num-gpus", "1",
                                        "--steps", "2" if args.smoke else str(args.grpo_steps), "--output-dir",
                                        str(out / "grpo"), "model.name_or_path=null", f"model.config={model}",
                                        f"tokenizer.name_or_path={REPO / 'recipes/tiny_llama/tokenizer'}",
                                        "grpo.beta=0", *grpo]),
    ]


def run_part(part: Part, budget_s: float, log: Path) -> None:
    """The part's command with its output in `log`, killed with its process group after `budget_s`."""
    start = time.perf_counter()
    with log.open("w") as log_file:
        log_file.write(" ".join(part.command) + "\n\n")
        log_file.flush()
        process = subprocess.Popen(part.command, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        try:
            code = process.wait(timeout=max(1.0, budget_s))
            part.status = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            part.status = f"stopped at its budget ({budget_s:.0f} s)"
    part.seconds = time.perf_counter() - start


def test_counts(junit: Path) -> str:
    """'N passed, N failed, N skipped' from pytest's JUnit file, with each failure's and skip's reason."""
    if not junit.exists():
        return "no JUnit file (pytest did not finish)"
    import xml.etree.ElementTree as ElementTree
    cases = list(ElementTree.parse(junit).getroot().iter("testcase"))
    outcomes = {"passed": [], "failed": [], "skipped": []}
    for case in cases:
        name, skipped = case.get("name"), case.find("skipped")
        failure = next((found for found in (case.find("failure"), case.find("error")) if found is not None), None)
        if failure is not None:
            outcomes["failed"].append(f"{name}: {(failure.get('message') or '').splitlines()[0][:200]}")
        elif skipped is not None:
            outcomes["skipped"].append(f"{name}: {(skipped.get('message') or '')[:160]}")
        else:
            outcomes["passed"].append(name)
    lines = [", ".join(f"{len(names)} {outcome}" for outcome, names in outcomes.items())]
    lines += [f"- failed {line}" for line in outcomes["failed"]] + [f"- skipped {line}" for line in outcomes["skipped"]]
    return "\n".join(lines)


def stage_curves(stages_dir: Path) -> str:
    """Every stage's largest loss difference against ZeRO-0, relative to the loss, from compare.py's CSV and
    run folders: the invariant holds when each is within STAGE_TOLERANCE."""
    table = stages_dir / "comparison.csv"
    if not table.exists():
        return "no comparison.csv (the comparison did not finish)"
    lines, holds = [], True
    for row in csv.DictReader(table.open()):
        if row["status"] != "ok":
            lines.append(f"- {row['cell']}: {row['status']} {row.get('error', '')}")
            holds = False
            continue
        relative = float(row["max_loss_diff"]) / float(row["final_loss"])
        holds &= relative <= STAGE_TOLERANCE
        lines.append(f"- {row['cell']}: max loss difference vs ZeRO-0 {float(row['max_loss_diff']):.2e} "
                     f"({relative:.1e} relative), {float(row['tokens_per_s']):,.0f} tokens/s")
    verdict = (f"every stage equals ZeRO-0 within {STAGE_TOLERANCE:g} relative" if holds
               else f"NOT every stage equals ZeRO-0 within {STAGE_TOLERANCE:g} relative")
    return "\n".join([verdict, *lines])


def generation_share(grpo_dir: Path) -> str:
    """Per GRPO cell: tokens/s, the seconds a step spent generating and peak memory against the plan's, from
    compare.py's CSV and table."""
    table = grpo_dir / "comparison.csv"
    if not table.exists():
        return "no comparison.csv (the comparison did not finish)"
    lines = []
    for row in csv.DictReader(table.open()):
        if row["status"] != "ok":
            lines.append(f"- {row['cell']}: {row['status']} {row.get('error', '')}")
            continue
        planned = f" (planned {float(row['planned_peak_bytes']) / 2**30:.2f})" if row["planned_peak_bytes"] else ""
        lines.append(f"- {row['cell']}: {float(row['tokens_per_s']):,.0f} tokens/s, generation "
                     f"{float(row['generation_time_s']):.2f} s per step, peak memory "
                     f"{int(row['peak_mem_bytes']) / 2**30:.2f} GiB{planned}")
    return "\n".join(lines + ["", (grpo_dir / "comparison.md").read_text()])


def findings(part: Part, out: Path) -> str:
    if part.name == "tests":
        return test_counts(out / "tests.xml")
    if part.name == "throughput":
        results = out / "throughput" / "results.md"
        return results.read_text() if results.exists() else "no results.md (no run finished)"
    if part.name == "grpo":
        return generation_share(out / "grpo")
    return stage_curves(out / "stages")


def device() -> str:
    code = ("import json, torch, importlib.metadata as m; ok = torch.cuda.is_available(); print(json.dumps({"
            "'device': torch.cuda.get_device_name(0) if ok else 'cpu (no CUDA GPU)', 'torch': torch.__version__, "
            "'cuda': torch.version.cuda, **{name: m.version(name) for name in "
            "('deepspeed', 'transformers', 'torchao', 'accelerate', 'peft')}}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return result.stdout.strip().splitlines()[-1] if result.returncode == 0 else f"unknown: {result.stderr[-300:]}"


def report(out: Path, head: str, done: list[Part]) -> None:
    lines = [f"# gpu_validate: {head}", ""]
    for part in done:
        lines += [f"## {part.name}: {part.status}, {part.seconds:.0f} s of {part.budget_s} s", "",
                  f"`{' '.join(part.command)}` (log: {part.name}.log)", "", part.found, ""]
    (out / "validate.md").write_text("\n".join(lines))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="a new or empty folder for every result")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, runs on a CPU: checks the plumbing only")
    parser.add_argument("--parts", default="tests,throughput,stages",
                        help=f"comma-separated, run in the order {', '.join(PARTS)}")
    parser.add_argument("--budget", type=int, default=590, help="seconds for all parts together")
    parser.add_argument("--tests-budget", type=int, default=100)
    parser.add_argument("--throughput-budget", type=int, default=380)
    parser.add_argument("--stages-budget", type=int, default=110)
    parser.add_argument("--grpo-budget", type=int, default=400)
    parser.add_argument("--throughput-runs", default=",".join(THROUGHPUT_RUNS),
                        help=f"gpu_throughput.py's --only (default: {','.join(THROUGHPUT_RUNS)})")
    parser.add_argument("--throughput-steps", type=int, default=20)
    parser.add_argument("--stage-steps", type=int, default=20)
    parser.add_argument("--grpo-steps", type=int, default=3)
    args = parser.parse_args(argv)
    args.output = args.output.resolve()
    if args.output.exists() and any(args.output.iterdir()):
        parser.error(f"--output {args.output} is not empty: name a new folder")
    unknown = [name for name in args.parts.split(",") if name not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    return args


def main() -> int:
    args = parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    chosen = args.parts.split(",")
    start, done = time.perf_counter(), []
    head = device()
    print(f"gpu_validate: {head}", flush=True)
    for part in (part for part in parts(args) if part.name in chosen):
        left = args.budget - (time.perf_counter() - start)
        if left < 10:
            part.status = "not run: the total budget is spent"
        else:
            print(f"[{part.name}] up to {min(part.budget_s, left):.0f} s ...", flush=True)
            run_part(part, min(part.budget_s, left), args.output / f"{part.name}.log")
            part.found = findings(part, args.output)
        print(f"[{part.name}] {part.status} in {part.seconds:.0f} s\n{part.found}\n", flush=True)
        done.append(part)
        report(args.output, head, done)
    print(f"written: {args.output / 'validate.md'}")
    return 0 if all(part.status == "passed" for part in done) else 1


if __name__ == "__main__":
    sys.exit(main())
