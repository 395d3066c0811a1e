"""What annealing on a high-quality source in WSD's decay buys: two tiny_llama runs of the same steps and tokens,
one on a fixed mixture, one that switches to a mixture rich in the planted source for the decay (data.phases), with
the held-out loss on that source and on the rest.

    python benchmarks/anneal.py --output benchmarks/results/anneal_tiny_llama_cpu [--steps 200] [key.path=value ...]

The planted source: tiny_llama's corpus split by its documents' `source` field into the Python help topics (pydoc:
the language reference's prose, 193 documents) and the stdlib docstrings (1,577). A seeded tenth of each source's
documents is held out (never trained on) and scored at the end on each run's exported hf/: the token-mean loss of
every held-out document (its first data.seq_len tokens), per source. Both runs take the same first phase (docstrings
4 : pydoc 1); the anneal run's last phase (the decay's steps) reads docstrings 1 : pydoc 3. OMP_NUM_THREADS=2 on
this machine."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from training.base.strict_json import dumps  # noqa: E402

CORPUS = REPO / "recipes" / "tiny_llama" / "corpus.jsonl"
MIXTURES = {
    "fixed": "[{name: main, weights: {docstring: 4, pydoc: 1}}]",
    "anneal": "[{name: main, weights: {docstring: 4, pydoc: 1}}, {name: anneal, steps: decay, "
              "weights: {docstring: 1, pydoc: 3}}]",
}


def split(folder: Path, seed: int = 0) -> dict[str, Path]:
    """Each source's training file and held-out file."""
    folder.mkdir(parents=True, exist_ok=True)
    parts: dict[str, list[str]] = {"pydoc": [], "docstring": []}
    for line in CORPUS.read_text().splitlines():
        parts[json.loads(line)["source"].split(":")[0]].append(line + "\n")
    files = {}
    for name, lines in parts.items():
        held = set(np.random.default_rng([seed, len(name)]).choice(len(lines), len(lines) // 10, replace=False))
        files[name] = folder / f"{name}.jsonl"
        files[name].write_text("".join(line for i, line in enumerate(lines) if i not in held))
        files[f"heldout_{name}"] = folder / f"heldout_{name}.jsonl"
        files[f"heldout_{name}"].write_text("".join(line for i, line in enumerate(lines) if i in held))
    return files


@torch.no_grad()
def held_out_loss(model_dir: Path, documents: Path, seq_len: int) -> float:
    """The token-mean next-token loss over the documents, each its first seq_len tokens with the tokenizer's BOS."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    total, count = 0.0, 0
    for line in documents.read_text().splitlines():
        ids = tokenizer(json.loads(line)["text"] + tokenizer.eos_token, return_tensors="pt").input_ids[:, :seq_len]
        if ids.shape[1] < 2:
            continue
        loss = model(input_ids=ids, labels=ids).loss
        total, count = total + float(loss) * (ids.shape[1] - 1), count + ids.shape[1] - 1
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    args.output = args.output.resolve()
    files = split(args.output / "data")
    sources = f"data.sources=[{{path: {files['docstring']}}}, {{path: {files['pydoc']}}}]"
    rows = []
    for name, phases in MIXTURES.items():
        out = args.output / name
        command = [sys.executable, "train.py", "--recipe", "tiny_llama", "--output-dir", str(out), "--overwrite",
                   sources, f"data.phases={phases}", "training.schedule=wsd", "training.decay_ratio=0.2",
                   f"training.max_steps={args.steps}", *args.overrides]
        with open(args.output / f"console_{name}.txt", "w") as console:
            subprocess.run(command, cwd=REPO, stdout=console, stderr=subprocess.STDOUT, check=True)
        last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
        losses = {source: held_out_loss(out / "hf", files[f"heldout_{source}"], 256)
                  for source in ("pydoc", "docstring")}
        rows.append({"run": name, **losses, "source_tokens": last["source_tokens"], "train_loss": last["loss"]})
    (args.output / "results.json").write_text(dumps(rows, indent=2) + "\n")
    print(f"tiny_llama, {args.steps} steps x 16 rows x 256 tokens each run; held-out loss per source "
          f"(a tenth of each source's documents, never trained on)")
    print("| run | pydoc tokens | docstring tokens | held-out loss pydoc | held-out loss docstring |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['run']} | {row['source_tokens']['pydoc']:,} | {row['source_tokens']['docstring']:,} | "
              f"{row['pydoc']:.4f} | {row['docstring']:.4f} |")


if __name__ == "__main__":
    main()
