"""Packing and near-duplicate detection against the libraries people would otherwise use, side by side.

    pip install -r benchmarks/requirements.txt     # TRL and datasketch, the baselines
    python benchmarks/data_pipeline.py [--documents 200000] [--seq-len 2048] [--dedup-mb 10] [--sample 2000] [--repeats 5]

Packing: 200k documents with lognormal lengths (median 400 tokens, capped at seq_len) through our
`pack_bfd` / `pack_concat` and through TRL's `pack_dataset` ("bfd" with its default map batches of
1,000 documents, "bfd" over the whole data set in one batch, and "wrapped"). Each starts from the same
`datasets.Dataset` of token lists (loaded into memory) and ends with a packed in-memory `datasets.Dataset`;
tokens/s counts input tokens. Each packer runs `--repeats` times in a fresh process, the packers taking
turns, and twice in each process: the first run pays for touching fresh memory (on a virtual machine
that costs about as much as the packing itself), the second reuses it. The table shows medians.

Near duplicates: documents made from Python's documentation (tiny_llama's corpus) with planted near
copies (1% word edits, halves swapped, case and whitespace changes), deduplicated on one core by our
MinHash + LSH and by datasketch's MinHash + MinHashLSH (query, then insert what is new), with the same
shingles (word 5-grams of the normalized text), 128 permutations and threshold 0.8. Precision and recall
are measured on the first `--sample` documents against exact Jaccard similarity of every pair. Each
method runs `--repeats` times, taking turns; the table shows the first run and the median of the others.
"""
import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import combinations
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
from datasketch import MinHash, MinHashLSH
from trl import pack_dataset

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from data_pipeline.dedup import MinHasher, NearDuplicates, normalize  # noqa: E402
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


def planted_corpus(target_mb: float) -> list[str]:
    """Documents of 2-8 paragraphs drawn from the corpus, each followed by a near copy one time in five."""
    rng = random.Random(0)
    paragraphs = [p for line in (REPO / "recipes" / "tiny_llama" / "corpus.jsonl").open()
                  for p in json.loads(line)["text"].split("\n\n") if len(p.split()) >= 8]
    corpus, size = [], 0
    while size < target_mb * 1e6:
        text = "\n\n".join(rng.sample(paragraphs, rng.randint(2, 8)))
        corpus.append(text)
        if rng.random() < 0.2:
            corpus.append(near_copy(text, rng))
        size += len(text)
    return corpus


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


def word_shingles(text: str) -> list[bytes]:
    words = normalize(text).split()
    grams = [" ".join(words[i:i + NGRAM]) for i in range(len(words) - NGRAM + 1)] or [" ".join(words)]
    return [gram.encode() for gram in grams]


def datasketch_dedup(texts: list[str]) -> np.ndarray:
    lsh = MinHashLSH(threshold=THRESHOLD, num_perm=NUM_PERM)
    duplicate = np.zeros(len(texts), dtype=bool)
    for i, text in enumerate(texts):
        signature = MinHash(num_perm=NUM_PERM, seed=1)
        signature.update_batch(word_shingles(text))
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
        signatures[-1].update_batch(word_shingles(text))
        lsh.insert(i, signatures[-1])
    return {(min(i, j), max(i, j)) for i, s in enumerate(signatures) for j in lsh.query(s) if j != i}


def ours_dedup(texts: list[str]) -> np.ndarray:
    return NearDuplicates(THRESHOLD, NUM_PERM).duplicate_mask(MinHasher(NUM_PERM, "word", NGRAM).signatures(texts))


def ours_pairs(texts: list[str]) -> set[tuple[int, int]]:
    pairs = NearDuplicates(THRESHOLD, NUM_PERM).pairs(MinHasher(NUM_PERM, "word", NGRAM).signatures(texts))
    return {tuple(pair) for pair in pairs.tolist()}


def true_pairs(texts: list[str]) -> set[tuple[int, int]]:
    sets = [set(word_shingles(t)) for t in texts]
    return {(i, j) for i, j in combinations(range(len(texts)), 2)
            if len(sets[i] & sets[j]) >= THRESHOLD * len(sets[i] | sets[j])}


def dedup_table(target_mb: float, sample: int, repeats: int) -> None:
    texts = planted_corpus(target_mb)
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    truth = true_pairs(texts[:sample])
    print(f"\nNear-duplicate detection, {len(texts):,} documents, {megabytes:.1f} MB, one core; precision and recall "
          f"on the first {sample:,} documents ({len(truth)} pairs with exact Jaccard >= {THRESHOLD})")
    print("| method | seconds, first run | MB/s | seconds, later runs (median) | MB/s | documents removed | "
          "pair precision | pair recall |")
    print("|---|---|---|---|---|---|---|---|")
    methods = {"ours (NumPy MinHash + LSH + verification)": (ours_dedup, ours_pairs),
               "datasketch MinHash + MinHashLSH": (datasketch_dedup, datasketch_pairs)}
    seconds = {name: [] for name in methods}
    for _ in range(repeats):  # taking turns; the first run of ours also pays for touching fresh memory
        for name, (dedup, _) in methods.items():
            removed, elapsed = timed(lambda: dedup(texts))
            seconds[name].append(elapsed)
    for name, (dedup, pairs) in methods.items():
        removed = dedup(texts)
        found = pairs(texts[:sample])
        precision = len(found & truth) / len(found) if found else 1.0
        first, later = seconds[name][0], statistics.median(seconds[name][1:])
        print(f"| {name} | {first:.2f} | {megabytes / first:.1f} | {later:.2f} | {megabytes / later:.1f} | "
              f"{int(removed.sum()):,} | {precision:.3f} | {len(found & truth) / len(truth):.3f} |")


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
