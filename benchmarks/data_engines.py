"""The data stage in-process (`datasets`, num_proc) against the same stage as a datatrove job on this machine.

    python benchmarks/data_engines.py [--corpus prose|code] [--copies 30] [--code-mb 60] [--shards 8] [--cores 2]

The corpus, `--corpus prose`: tiny_llama's documents (Python's documentation) `--copies` times, each copy with 10% of
its words replaced at random (so copies are not near duplicates of each other: word 5-gram Jaccard about 0.4);
`--corpus code`: `--code-mb` MB of the installed packages' Python files (code no one here wrote). Either way plus 2%
exact duplicates and 2% near duplicates (one word changed), in `--shards` JSONL files. Both engines run tiny_llama's
recipe on it with exact and MinHash near dedup, tokenization and packing, on `--cores` cores (in-process:
data.num_proc; datatrove: --tasks = shards, --workers = cores), each through `python -m data_pipeline prepare` as users
run it, one after the other. The table shows wall time, documents/s and GB/hour; a second table shows where the
datatrove job's task time goes (each stage's task-seconds, summed over its tasks, per GB of input), from which the
1 TB arithmetic follows. A third table runs the MinHash signature stage alone on the same shards (read, sign, write
the bucket files; same tasks and workers), with datatrove's own MinhashDedupSignature (its permutations and
signature, one document at a time, on the recipe's shingles: its own shingle hashing fails with the installed
xxhash, which refuses str) and with the engine's BatchedMinhashSignature, side by side.

    python benchmarks/data_engines.py --task-memory --copies 25

instead runs the datatrove job as one task over one shard of the corpus, under `/usr/bin/time -v`, and
prints the text's size and the peak resident memory (the memory one task needs for that much text).

    python benchmarks/data_engines.py --check-sources --copies 100

instead times the datatrove engine's read of every source line before its job starts (scale.check_sources, in
one process), on the corpus written once and read once before timing (page cache warm): the median of 3 reads,
as MB/s and minutes per TB.
"""
import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repository's data_pipeline package, not benchmarks/data_pipeline.py beside this

from corpora import source_files  # noqa: E402 (this folder)


def prose_documents(copies: int, rng: np.random.Generator) -> list[str]:
    texts = [json.loads(line)["text"] for line in (REPO / "recipes/tiny_llama/corpus.jsonl").read_text().splitlines()]
    vocabulary = np.array(sorted({w for t in texts for w in t.split()}))
    documents = []
    for _ in range(copies):
        for text in texts:
            words = np.array(text.split(), dtype=object)
            changed = rng.random(len(words)) < 0.1
            words[changed] = rng.choice(vocabulary, changed.sum())
            documents.append(" ".join(words))
    return documents


def code_documents(megabytes: float) -> list[str]:
    documents, size = [], 0
    for text in source_files(random.Random(0)):
        if size >= megabytes * 1e6:
            break
        documents.append(text)
        size += len(text.encode())
    return documents


def write_corpus(folder: Path, copies: int, shards: int, corpus: str = "prose", code_mb: float = 60) -> tuple[int, int]:
    """(documents, bytes) of the corpus, written as shards part-00000.jsonl, ..."""
    rng = np.random.default_rng(0)
    documents = prose_documents(copies, rng) if corpus == "prose" else code_documents(code_mb)
    planted = rng.choice(len(documents), len(documents) // 25, replace=False)
    for i, index in enumerate(planted):
        words = documents[index].split()
        if i % 2:
            words[rng.integers(len(words))] = "CHANGED"
        documents.append(" ".join(words))
    order = rng.permutation(len(documents))
    size = 0
    for shard, part in enumerate(np.array_split(order, shards)):
        lines = "".join(json.dumps({"text": documents[i]}) + "\n" for i in part)
        (folder / f"part-{shard:05d}.jsonl").write_text(lines)
        size += len(lines.encode())
    return len(documents), size


def prepare(output: Path, engine: list[str], overrides: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "data_pipeline", "prepare", "--recipe", "tiny_llama", "--output",
                           str(output), *engine, *overrides], cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stdout[-2000:] + done.stderr[-4000:])
    return time.perf_counter() - start


def task_memory(scratch: Path, copies: int) -> None:
    documents, size = write_corpus(scratch, copies, 1)
    done = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "data_pipeline", "prepare", "--recipe",
                           "tiny_llama", "--output", str(scratch / "out"), "--engine", "datatrove", "--tasks", "1",
                           "--workers", "1", f"data.sources=[{{path: '{scratch}/part-*.jsonl'}}]",
                           "data.dedup.near=true"], cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr[-4000:])
    peak_kb = int(next(line for line in done.stderr.splitlines() if "Maximum resident set size" in line).split()[-1])
    print(f"one task, {documents:,} documents, {size / 1e6:.1f} MB of text: peak resident memory "
          f"{peak_kb / 1e6:.2f} GB")


def check_sources_rate(scratch: Path, copies: int, shards: int) -> None:
    from data_pipeline.scale import check_sources
    from training.config.recipe import load_recipe
    _, size = write_corpus(scratch, copies, shards)
    config = load_recipe("tiny_llama", [f"data.sources=[{{path: '{scratch}/part-*.jsonl'}}]"]).data
    check_sources(config)  # the page cache warm, as for the timed reads
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        check_sources(config)
        seconds.append(time.perf_counter() - start)
    median = sorted(seconds)[1]
    print(f"check_sources, {size / 1e6:.1f} MB of JSON lines in {shards} files, one process: {median:.2f} s (median of "
          f"3), {size / 1e6 / median:,.0f} MB/s, {1e12 / (size / median) / 60:,.0f} minutes per TB")


def stage_seconds(work: Path, pattern: str = "logs/*") -> dict[str, tuple[float, int]]:
    """Each stage's task-seconds (every step's time, summed over the stage's tasks) and its task count."""
    stages = {}
    for logs in sorted(path for path in work.glob(pattern) if path.is_dir()):
        tasks = [json.loads(p.read_text()) for p in (logs / "stats").glob("*.json")]
        stages[logs.name] = (sum(step["time_stats"]["total"] for task in tasks for step in task), len(tasks))
    return stages


def signature_stage(scratch: Path, tasks: int, workers: int, batched: bool) -> float:
    """Task-seconds of the MinHash signature stage alone over the shards (reading included), with datatrove's own
    step or the engine's batched one, both with the recipe's bands and rows."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import MinhashDedupSignature
    from datatrove.pipeline.readers import JsonlReader

    from data_pipeline.dedup import MinHasher, normalized_bytes
    from data_pipeline.scale import minhash_config, recipe_signatures
    from training.compat.datatrove import BatchedMinhashSignature
    from training.config.recipe import load_recipe
    config = load_recipe("tiny_llama", ["data.dedup.near=true"]).data
    name = "batched" if batched else "datatrove"
    output = str(scratch / "signatures" / name)
    hasher = MinHasher(1, config.dedup.shingle, config.dedup.ngram)

    class RecipeShingles(MinhashDedupSignature):  # datatrove's own shingles fail: see the docstring
        def get_shingles(self, text: str) -> np.ndarray:
            return hasher.shingle_hashes(normalized_bytes([text]))[0].astype(np.uint64).reshape(-1, 1)

    step = (BatchedMinhashSignature(output, minhash_config(config), recipe_signatures(config)) if batched
            else RecipeShingles(output, minhash_config(config)))
    LocalPipelineExecutor([JsonlReader(str(scratch), glob_pattern="part-*.jsonl"), step], tasks=tasks, workers=workers,
                          logging_dir=str(scratch / "signatures" / f"logs-{name}")).run()
    return stage_seconds(scratch / "signatures", f"logs-{name}")["logs-" + name][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", choices=("prose", "code"), default="prose")
    parser.add_argument("--copies", type=int, default=30, help="prose: copies of tiny_llama's corpus")
    parser.add_argument("--code-mb", type=float, default=60, help="code: megabytes of source files")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--task-memory", action="store_true", help="one task's peak memory instead (see above)")
    parser.add_argument("--check-sources", action="store_true", help="the read of every line before the job (above)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        if args.task_memory:
            return task_memory(scratch, args.copies)
        if args.check_sources:
            return check_sources_rate(scratch, args.copies, args.shards)
        documents, size = write_corpus(scratch, args.copies, args.shards, args.corpus, args.code_mb)
        overrides = [f"data.sources=[{{path: '{scratch}/part-*.jsonl'}}]", "data.dedup.near=true",
                     f"data.cache_dir={scratch / 'cache'}"]
        runs = {"in-process (datasets)": prepare(scratch / "in_process", [],
                                                 [*overrides, f"data.num_proc={args.cores}"]),
                "datatrove, local executor": prepare(scratch / "datatrove", [
                    "--engine", "datatrove", "--tasks", str(args.shards), "--workers", str(args.cores)], overrides)}
        stats = {name: json.loads((scratch / folder / "stats.json").read_text())
                 for name, folder in zip(runs, ("in_process", "datatrove"))}
        stages = stage_seconds(scratch / "datatrove.datatrove")
        signing = {name: signature_stage(scratch, args.shards, args.cores, batched)
                   for name, batched in (("datatrove MinhashDedupSignature", False),
                                         ("BatchedMinhashSignature (ours)", True))}
    gigabytes = size / 1e9
    print(f"{args.corpus}: {documents:,} documents, {size / 1e6:.1f} MB in {args.shards} shards, "
          f"{args.cores} cores; exact and near "
          f"dedup, tokenize, pack (tiny_llama's recipe)\n")
    print("| engine | wall s | documents/s | GB/hour | exact removed | near removed | tokens out |")
    print("|---|---|---|---|---|---|---|")
    for name, seconds in runs.items():
        s = stats[name]
        print(f"| {name} | {seconds:.1f} | {documents / seconds:,.0f} | {gigabytes / seconds * 3600:.3f} | "
              f"{s['exact_duplicates_removed']:,} | {s['near_duplicates_removed']:,} | {s['tokens_out']:,} |")
    print("\nratio datatrove / in-process wall time: "
          f"{runs['datatrove, local executor'] / runs['in-process (datasets)']:.2f}")
    print("\n| datatrove stage | tasks | task-seconds | task-seconds per GB |")
    print("|---|---|---|---|")
    for name, (seconds, tasks) in stages.items():
        print(f"| {name} | {tasks} | {seconds:.1f} | {seconds / gigabytes:,.0f} |")
    parallel = sum(s for name, (s, tasks) in stages.items() if tasks > 1)
    serial = sum(s for name, (s, tasks) in stages.items() if tasks == 1)
    print(f"\nper core: {documents / parallel:,.0f} documents/s, {gigabytes / parallel * 3600:.3f} GB/hour in the "
          f"split stages; single-task stages {serial:.1f} s for {documents:,} documents")
    print("\n| MinHash signature stage alone (read, sign, write buckets) | task-seconds | task-seconds per GB "
          "| ratio |")
    print("|---|---|---|---|")
    stock = signing["datatrove MinhashDedupSignature"]
    for name, seconds in signing.items():
        print(f"| {name} | {seconds:.1f} | {seconds / gigabytes:,.0f} | {seconds / stock:.3f} |")


if __name__ == "__main__":
    main()
