"""The datasketch baseline of `python -m data_pipeline dedup`, as a whole process: read a JSONL file, drop exact
duplicates of the normalized text, then near duplicates with datasketch's MinHash + MinHashLSH (query, then insert
what is new) over the same shingles, permutations and threshold, and write the kept lines unchanged.

    python benchmarks/datasketch_dedup.py IN.jsonl OUT.jsonl [--threshold 0.8] [--num-perm 128] [--ngram 5]
"""
import argparse
import hashlib
import json

from datasketch import MinHash, MinHashLSH


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def word_shingles(text: str, ngram: int) -> list[bytes]:
    words = normalize(text).split()
    grams = [" ".join(words[i:i + ngram]) for i in range(len(words) - ngram + 1)] or [" ".join(words)]
    return [gram.encode() for gram in grams]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input")
    parser.add_argument("output")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--num-perm", type=int, default=128)
    parser.add_argument("--ngram", type=int, default=5)
    args = parser.parse_args()
    lsh, seen, kept = MinHashLSH(threshold=args.threshold, num_perm=args.num_perm), set(), []
    with open(args.input, "rb") as file:
        for number, line in enumerate(file):
            text = json.loads(line)[args.text_field] or ""
            digest = hashlib.blake2b(normalize(text).encode(), digest_size=8).digest()
            if digest in seen:
                continue
            seen.add(digest)
            signature = MinHash(num_perm=args.num_perm, seed=1)
            signature.update_batch(word_shingles(text, args.ngram))
            if not lsh.query(signature):
                lsh.insert(number, signature)
                kept.append(line)
    with open(args.output, "wb") as file:
        file.writelines(kept)


if __name__ == "__main__":
    main()
