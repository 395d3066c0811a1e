"""The quality filters (data.filters): what each removes, and what it costs beside deduplication and tokenization.

    python benchmarks/data_filters.py [--copies 3] > benchmarks/results/data_filters_cpu.txt

Removal: each filter alone, with the library's defaults (language: languages [en]; regex: an e-mail address), on the
planted corpus (tests/helpers/planted_corpus.py: prose paragraphs of Python's documentation, four to a document, and
20 documents of each junk kind): recall is the share of its planted kind it removes, "prose kept" the share of the
good documents it keeps. The same filters on tiny_llama's whole corpus (docstrings and reference pages, much of it
code) show how strict web-text heuristics are on technical text.

Speed: one process, one core, on tiny_llama's corpus and the planted one `--copies` times (a copy's words are
shuffled within each line, so spaCy and the tokenizer see new text): documents/s of each filter alone, of FineWeb's
chain (language, Gopher repetition, Gopher quality, C4 without its terminal punctuation rule, FineWeb quality, as
FineWeb ran them), of exact and near deduplication and of
tokenization as prepare runs them (data_pipeline/prepare.py, num_proc 1). "datatrove's own" is the same filter without
the warm spaCy pipeline (training/compat/datatrove.py warm_word_tokenizers); it decides the same.
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from data_pipeline.config import DataConfig, DedupConfig  # noqa: E402
from data_pipeline.filters import FilterChain, check_parameters  # noqa: E402
from data_pipeline.prepare import build_dataset, deduplicate  # noqa: E402
from data_pipeline.sources import FEATURES  # noqa: E402
from data_pipeline.tokenize import tokenize_documents  # noqa: E402
from tests.helpers.planted_corpus import CONTACT_PATTERN, KINDS, planted_corpus  # noqa: E402

SETTINGS = {"language": {"languages": ["en"]}, "regex": {"pattern": CONTACT_PATTERN}}
# FineWeb's C4: no punctuation rule
FINEWEB = ["language", "gopher_repetition", "gopher_quality", "c4", "fineweb_quality"]
TOKENIZER = AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer")


def settings(kinds: list[str]) -> list[dict]:
    """The filters' parameters as the benchmark runs them (FineWeb's chain: C4 without its punctuation rule)."""
    chosen = {**SETTINGS, "c4": {"filter_no_terminal_punct": False}} if kinds == FINEWEB else SETTINGS
    return [chosen.get(kind, {}) for kind in kinds]


def chain(kinds: list[str], warm: bool = True) -> FilterChain:
    return FilterChain([(kind, check_parameters(kind, parameters)) for kind, parameters in zip(kinds, settings(kinds))],
                       TOKENIZER, warm)


def removed(kinds: list[str], texts: list[str]) -> np.ndarray:
    return np.asarray(chain(kinds)(texts, [True] * len(texts))["removed_by"]) >= 0


def removal_table(texts: list[str], kinds: np.ndarray, shipped: list[str]) -> None:
    print("## What each filter removes (library defaults)\n")
    print("| filter | planted kind | recall | prose kept (of %d) | tiny_llama's corpus kept (of %d) |"
          % ((kinds == "prose").sum(), len(shipped)))
    print("|---|---|---|---|---|")
    for junk, kind in KINDS.items():
        gone = removed([kind], texts)
        print(f"| {kind} | {junk} | {gone[kinds == junk].mean():.0%} | {1 - gone[kinds == 'prose'].mean():.1%} | "
              f"{1 - removed([kind], shipped).mean():.1%} |")
    gone = removed(FINEWEB, texts)
    junk = (kinds != "prose") & (kinds != "contact")
    print(f"| FineWeb's chain | all but contact | {gone[junk].mean():.0%} | {1 - gone[kinds == 'prose'].mean():.1%} | "
          f"{1 - removed(FINEWEB, shipped).mean():.1%} |\n")


def shuffled_copies(texts: list[str], copies: int) -> list[str]:
    rng = np.random.default_rng(0)
    out = list(texts)
    for _ in range(copies - 1):
        out += ["\n".join(" ".join(rng.permutation(line.split())) for line in text.split("\n")) for text in texts]
    return out


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def preparation(texts: list[str], filters: list[dict]) -> float:
    """Seconds of a whole in-process preparation (read the JSONL, drop empties, filter, exact and near dedup, tokenize,
    pack into 256-token rows), as `prepare` builds it before writing."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder, "corpus.jsonl")
        source.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
        config = DataConfig(sources=[{"path": str(source)}], seq_len=256, filters=filters, cache_dir=folder,
                            dedup=DedupConfig(exact=True, near=True))
        return timed(lambda: build_dataset(config, TOKENIZER))


def speed_table(texts: list[str]) -> None:
    documents = datasets.Dataset.from_dict({"text": texts, "messages": [None] * len(texts), "source": [0] * len(texts)},
                                           features=FEATURES)
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    chain(FINEWEB)(texts[:50], [True] * 50)  # load spaCy and fastText once
    rows = []
    for kind in ["length", "regex", *FINEWEB]:
        warm, plain = chain([kind]), chain([kind], warm=False)
        rows.append((kind, timed(lambda: warm(texts, [True] * len(texts))),
                     timed(lambda: plain(texts, [True] * len(texts)))))
    fineweb = (timed(lambda: chain(FINEWEB)(texts, [True] * len(texts))),
               timed(lambda: chain(FINEWEB, warm=False)(texts, [True] * len(texts))))
    exact = timed(lambda: deduplicate(documents, DedupConfig(exact=True, near=False), 1, {}))
    near = timed(lambda: deduplicate(documents, DedupConfig(exact=False, near=True), 1, {}))
    tokenize = timed(lambda: tokenize_documents(documents, TOKENIZER, 1))
    fineweb_filters = [{"type": kind, **parameters} for kind, parameters in zip(FINEWEB, settings(FINEWEB))]
    unfiltered, filtered = preparation(texts, []), preparation(texts, fineweb_filters)
    print(f"## Speed: {len(texts):,} documents, {megabytes:.1f} MB, one core\n")
    print("| step | seconds | documents/s | datatrove's own: seconds | documents/s |")
    print("|---|---|---|---|---|")
    for name, seconds, plain in rows + [("FineWeb's chain", *fineweb)]:
        print(f"| {name} | {seconds:.2f} | {len(texts) / seconds:,.0f} | {plain:.2f} | {len(texts) / plain:,.0f} |")
    for name, seconds in (("exact dedup", exact), ("near dedup (MinHash)", near), ("tokenization", tokenize)):
        print(f"| {name} | {seconds:.2f} | {len(texts) / seconds:,.0f} | | |")
    rest = exact + near + tokenize
    print(f"\nFineWeb's chain takes {fineweb[0] / (fineweb[0] + rest):.0%} of chain + dedup + tokenization "
          f"({fineweb[1] / (fineweb[1] + rest):.0%} with datatrove's own tokenizer calls); the chain is "
          f"{fineweb[1] / fineweb[0]:.1f}x faster warm.")
    print(f"\nA whole preparation (read, filter, exact and near dedup, tokenize, pack): {unfiltered:.2f} s without "
          f"filters, {filtered:.2f} s with FineWeb's chain ({(filtered - unfiltered) / filtered:.0%} of it the chain's "
          f"cost, its documents/s {len(texts) / unfiltered:,.0f} and {len(texts) / filtered:,.0f}).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=3)
    args = parser.parse_args()
    texts, kinds = planted_corpus()
    shipped = [json.loads(line)["text"] for line in (REPO / "recipes/tiny_llama/corpus.jsonl").open()]
    print(f"# benchmarks/data_filters.py --copies {args.copies}\n")
    removal_table(texts, np.array(kinds), shipped)
    speed_table(shuffled_copies(shipped + texts, args.copies))


if __name__ == "__main__":
    main()
