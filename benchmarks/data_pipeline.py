"""Packing and near-duplicate detection against the libraries people would otherwise use, side by side.

    pip install -r benchmarks/requirements.txt     # TRL and datasketch, the baselines
    python benchmarks/data_pipeline.py [--documents 200000] [--seq-len 2048] [--dedup-mb 10] [--sample 2000]
        [--repeats 5]

Packing: 200k documents with lognormal lengths (median 400 tokens, capped at seq_len) through our
`pack_bfd` / `pack_concat` and through TRL's `pack_dataset` ("bfd" with its default map batches of
1,000 documents, "bfd" over the whole data set in one batch, and "wrapped"). Each starts from the same
`datasets.Dataset` of token lists (loaded into memory) and ends with a packed in-memory `datasets.Dataset`;
tokens/s counts input tokens. Each packer runs `--repeats` times in a fresh process, the packers taking
turns, and twice in each process: the first run pays for touching fresh memory (on a virtual machine
that costs about as much as the packing itself), the second reuses it. The table shows medians.

Near duplicates, on three corpora of about `--dedup-mb` MB each with planted near copies (1% word edits,
halves swapped, case and whitespace changes): prose (2-8 paragraphs of Python's documentation, tiny_llama's
corpus), source code (the installed packages' .py files, code no one here wrote) and chat (tiny_llama_sft's
conversations rendered as "role: content" turns). Ours (NumPy MinHash + LSH + verification) against datasketch's
MinHash + MinHashLSH (query, then insert what is new), with the same shingles (word 5-grams of the normalized
text), 128 permutations and threshold 0.8, on one core, two ways: in-process on texts in memory (the margin),
and as a whole process from a JSONL file to a JSONL file (`python -m data_pipeline dedup` against
benchmarks/datasketch_dedup.py: start-up, imports, reading, exact and near dedup, writing). Each runs
`--repeats` times, taking turns. Precision and recall are measured on the first `--sample` documents
against exact Jaccard similarity of every pair.
"""
import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from itertools import combinations
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
from datasketch import MinHash, MinHashLSH
from trl import pack_dataset

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from corpora import source_files  # noqa: E402 (this folder)
from datasketch_dedup import word_shingles  # noqa: E402 (this folder: the whole-process baseline's shingles)

from data_pipeline.dedup import MinHasher, NearDuplicates, first_of_group, normalized_bytes  # noqa: E402
from data_pipeline.pack import pack_bfd, pack_concat  # noqa: E402
from data_pipeline.prepare import rows_to_dataset  # noqa: E402
from data_pipeline.tokenize import token_stream  # noqa: E402

THRESHOLD, NUM_PERM, NGRAM = 0.8, 128, 5


def timed(function):
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def token_documents(n: int, seq_len: int) -> datasets.Dataset:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(400), 1.0, n).astype(np.int64), 1, seq_len)
    tokens = rng.integers(0, 32_000, lengths.sum(), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return datasets.Dataset(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens))}))


def ours(documents: datasets.Dataset, seq_len: int, strategy: str) -> tuple[int, int]:
    tokens, _, lengths = token_stream(documents)
    rows = pack_bfd(tokens, lengths, seq_len, pad_id=0) if strategy == "bfd" else pack_concat(tokens, lengths, seq_len)
    packed = rows_to_dataset(rows, fingerprint=f"benchmark-{strategy}")
    return int(np.sum(rows["length"])), len(packed)


def trl(documents: datasets.Dataset, seq_len: int, strategy: str, batch_size: int) -> tuple[int, int]:
    packed = pack_dataset(documents, seq_len, strategy, map_kwargs={"batch_size": batch_size})
    lengths = packed.data.column("input_ids").combine_chunks().value_lengths().to_numpy()
    return int(lengths.sum()), len(packed)


PACKERS = {
    "ours bfd": lambda docs, seq_len: ours(docs, seq_len, "bfd"),
    "TRL bfd (map batches of 1,000)": lambda docs, seq_len: trl(docs, seq_len, "bfd", 1000),
    "TRL bfd (one batch)": lambda docs, seq_len: trl(docs, seq_len, "bfd", len(docs)),
    "ours concat": lambda docs, seq_len: ours(docs, seq_len, "concat"),
    "TRL wrapped": lambda docs, seq_len: trl(docs, seq_len, "wrapped", 1000),
}


def pack_once(packer: str, path: str, seq_len: int) -> None:
    """Run inside a fresh process, twice: print both times, real tokens and rows as JSON. The first run
    pays for memory the process touches for the first time; the second reuses it."""
    documents = datasets.load_from_disk(path, keep_in_memory=True)  # results stay in memory, as in the parent
    (real, rows), cold = timed(lambda: PACKERS[packer](documents, seq_len))
    _, warm = timed(lambda: PACKERS[packer](documents, seq_len))
    print(json.dumps({"cold": cold, "warm": warm, "real": real, "rows": rows}))


def packing_table(n: int, seq_len: int, repeats: int) -> None:
    documents = token_documents(n, seq_len)
    total = int(documents.data.column("input_ids").combine_chunks().value_lengths().to_numpy().sum())
    print(f"\nPacking {n:,} documents, {total:,} tokens, seq_len {seq_len}, median of {repeats} fresh processes")
    print("| packer | seconds, fresh process | M tokens/s | seconds, second run | M tokens/s | rows | efficiency "
          "(real tokens / slots) |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        documents.save_to_disk(tmp)
        runs = {packer: [] for packer in PACKERS}
        for _ in range(repeats):  # round robin, so that drifts in the machine's state hit every packer alike
            for packer in PACKERS:
                result = subprocess.run([sys.executable, __file__, "--pack-one", packer, "--path", tmp,
                                         "--seq-len", str(seq_len)], check=True, capture_output=True, text=True)
                runs[packer].append(json.loads(result.stdout.splitlines()[-1]))
    for packer, results in runs.items():
        cold, warm = (statistics.median(r[key] for r in results) for key in ("cold", "warm"))
        print(f"| {packer} | {cold:.2f} | {total / cold / 1e6:.1f} | {warm:.2f} | {total / warm / 1e6:.1f} | "
              f"{results[0]['rows']:,} | {results[0]['real'] / (results[0]['rows'] * seq_len):.4f} |")


def planted(documents: Iterable[str], target_mb: float, plants: int, rng: random.Random) -> list[str]:
    """Documents in their order up to `target_mb`, with `plants` of them followed by a near copy."""
    corpus, size = [], 0
    for text in documents:
        if size >= target_mb * 1e6:
            break
        corpus.append(text)
        size += len(text.encode())
    for index in sorted(rng.sample(range(len(corpus)), min(plants, len(corpus))), reverse=True):
        corpus.insert(index + 1, near_copy(corpus[index], rng))
    return corpus


def prose_corpus(target_mb: float) -> list[str]:
    """Documents of 2-8 paragraphs drawn from Python's documentation (tiny_llama's corpus)."""
    rng = random.Random(0)
    paragraphs = [p for line in (REPO / "recipes" / "tiny_llama" / "corpus.jsonl").open()
                  for p in json.loads(line)["text"].split("\n\n") if len(p.split()) >= 8]
    documents = ("\n\n".join(rng.sample(paragraphs, rng.randint(2, 8))) for _ in iter(int, 1))
    return planted(documents, target_mb, int(target_mb * 200), rng)


def code_corpus(target_mb: float) -> list[str]:
    """Source files of the installed packages (code no one here wrote), 1-50 KB each, in a random order."""
    rng = random.Random(0)
    return planted(source_files(rng), target_mb, int(target_mb * 12), rng)


def chat_corpus(target_mb: float) -> list[str]:
    """Conversations of 1-4 of tiny_llama_sft's exchanges, rendered as "role: content" turns."""
    rng = random.Random(0)
    chats = [json.loads(line)["messages"] for line in (REPO / "recipes" / "tiny_llama_sft" / "chat.jsonl").open()]
    documents = ("\n".join(f"{turn['role']}: {turn['content']}" for chat in rng.sample(chats, rng.randint(1, 4))
                           for turn in chat) for _ in iter(int, 1))
    return planted(documents, target_mb, int(target_mb * 200), rng)


CORPORA = {"prose": prose_corpus, "code": code_corpus, "chat": chat_corpus}


def near_copy(text: str, rng: random.Random) -> str:
    words = text.split()
    match rng.randrange(3):
        case 0:
            for _ in range(max(1, len(words) // 100)):
                words[rng.randrange(len(words))] = "edited"
            return " ".join(words)
        case 1:
            return " ".join(words[len(words) // 2:] + words[:len(words) // 2])
        case _:
            return text.upper().replace(" ", "  ")


def datasketch_dedup(texts: list[str]) -> np.ndarray:
    lsh = MinHashLSH(threshold=THRESHOLD, num_perm=NUM_PERM)
    duplicate = np.zeros(len(texts), dtype=bool)
    for i, text in enumerate(texts):
        signature = MinHash(num_perm=NUM_PERM, seed=1)
        signature.update_batch(word_shingles(text, NGRAM))
        if lsh.query(signature):
            duplicate[i] = True
        else:
            lsh.insert(i, signature)
    return duplicate


def datasketch_pairs(texts: list[str]) -> set[tuple[int, int]]:
    lsh = MinHashLSH(threshold=THRESHOLD, num_perm=NUM_PERM)
    signatures = []
    for i, text in enumerate(texts):
        signatures.append(MinHash(num_perm=NUM_PERM, seed=1))
        signatures[-1].update_batch(word_shingles(text, NGRAM))
        lsh.insert(i, signatures[-1])
    return {(min(i, j), max(i, j)) for i, s in enumerate(signatures) for j in lsh.query(s) if j != i}


OURS = NearDuplicates(THRESHOLD, MinHasher(NUM_PERM, "word", NGRAM))


def ours_dedup(texts: list[str]) -> np.ndarray:
    encoded = normalized_bytes(texts)
    return OURS.duplicate_mask(OURS.hasher.normalized_signatures(encoded), lambda rows: [encoded[i] for i in rows])


def ours_pairs(texts: list[str]) -> set[tuple[int, int]]:
    encoded = normalized_bytes(texts)
    pairs = OURS.pairs(OURS.hasher.normalized_signatures(encoded), lambda rows: [encoded[i] for i in rows])
    return {tuple(pair) for pair in pairs.tolist()}


def true_pairs(texts: list[str]) -> set[tuple[int, int]]:
    sets = [set(word_shingles(t, NGRAM)) for t in texts]
    return {(i, j) for i, j in combinations(range(len(texts)), 2)
            if len(sets[i] & sets[j]) >= THRESHOLD * len(sets[i] | sets[j])}


def whole_process(command: list[str], texts: list[str], tmp: Path) -> float:
    """Seconds of a fresh process deduplicating `texts` as a JSONL file, from start to exit."""
    source, output = tmp / "in.jsonl", tmp / "out.jsonl"
    if not source.exists():
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    output.unlink(missing_ok=True)
    start = time.perf_counter()
    subprocess.run([*command, str(source), str(output)], check=True, capture_output=True, cwd=REPO)
    return time.perf_counter() - start


WHOLE = {"ours": [sys.executable, "-m", "data_pipeline", "dedup"],
         "datasketch": [sys.executable, str(REPO / "benchmarks" / "datasketch_dedup.py")]}
MARGIN = {"ours": (ours_dedup, ours_pairs), "datasketch": (datasketch_dedup, datasketch_pairs)}


def dedup_row(corpus: str, target_mb: float, sample: int, repeats: int) -> list[str]:
    """One corpus: seconds in-process (warm, median of the runs after the first) and as a whole process (median),
    for ours and datasketch taking turns; pair precision and recall on the first `sample` documents."""
    texts = CORPORA[corpus](target_mb)
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    margin, whole = {name: [] for name in MARGIN}, {name: [] for name in WHOLE}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for name, (dedup, _) in MARGIN.items():
                margin[name].append(timed(lambda: dedup(texts))[1])
            for name, command in WHOLE.items():
                whole[name].append(whole_process(command, texts, Path(tmp)))
    truth = true_pairs(texts[:sample])
    cells = [corpus, f"{len(texts):,} docs, {megabytes:.1f} MB, {len(truth)} true pairs"]
    seconds = {name: (statistics.median(margin[name][1:]), statistics.median(whole[name])) for name in MARGIN}
    for name, (dedup, pairs) in MARGIN.items():
        found = pairs(texts[:sample])
        group = first_of_group(min(sample, len(texts)), np.array(sorted(found), dtype=np.int64).reshape(-1, 2))
        grouped = sum(group[i] == group[j] for i, j in truth)
        cells += [f"{seconds[name][0]:.2f} ({megabytes / seconds[name][0]:.1f})",
                  f"{seconds[name][1]:.2f} ({megabytes / seconds[name][1]:.1f})", f"{int(dedup(texts).sum()):,}",
                  f"{len(found & truth) / len(found) if found else 1.0:.3f} / "
                  f"{grouped / len(truth) if truth else 1.0:.3f}"]
    cells += [f"{seconds['datasketch'][0] / seconds['ours'][0]:.1f}x",
              f"{seconds['datasketch'][1] / seconds['ours'][1]:.1f}x"]
    return cells


def dedup_table(target_mb: float, sample: int, repeats: int) -> None:
    print(f"\nNear-duplicate detection vs datasketch (same word {NGRAM}-gram shingles, {NUM_PERM} permutations, "
          f"threshold {THRESHOLD}), one core. Seconds (MB/s): in-process = MinHash + LSH + verification on texts in "
          f"memory, warm, median of {repeats - 1}; whole process = a fresh `python -m data_pipeline dedup IN OUT` "
          f"against a fresh benchmarks/datasketch_dedup.py, median of {repeats}. On the first {sample:,} documents, "
          f"against exact Jaccard >= {THRESHOLD} of every pair: precision of the pairs each method reports, recall of "
          f"the true pairs it puts in one group (ours pairs each document with its bucket's first, so a group of k "
          f"copies is k - 1 pairs, not k(k-1)/2).")
    print("| corpus | size | ours in-process | ours whole process | ours removed | ours P / R | "
          "datasketch in-process | datasketch whole process | datasketch removed | datasketch P / R | "
          "in-process speedup | whole-process speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for corpus in CORPORA:
        print("| " + " | ".join(dedup_row(corpus, target_mb, sample, repeats)) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=200_000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--dedup-mb", type=float, default=10)
    parser.add_argument("--sample", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pack-one", choices=PACKERS, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--skip-packing", action="store_true", help="only the near-duplicate table")
    args = parser.parse_args()
    datasets.disable_progress_bars()
    if args.pack_one:
        return pack_once(args.pack_one, args.path, args.seq_len)
    if not args.skip_packing:
        packing_table(args.documents, args.seq_len, args.repeats)
    dedup_table(args.dedup_mb, args.sample, max(args.repeats, 2))


if __name__ == "__main__":
    main()
