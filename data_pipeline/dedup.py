"""Exact and near-duplicate detection, vectorized with NumPy.

Near duplicates are found with MinHash + LSH. Each document becomes a set of shingles (word n-grams
or character n-grams of its normalized text), each shingle a well-mixed 32-bit hash, and the document
a signature of `num_perm` minima of random permutations of the 32-bit space (x -> a*x + b mod 2^32,
a odd). Two documents agree on any one minimum with probability about their Jaccard similarity, so
documents that share a band of minima (LSH) are candidates; each candidate pair is then verified by the
exact Jaccard similarity of the two shingle sets, recomputed from the texts of the candidates only.
Everything per shingle is whole-array NumPy over a batch of documents: no Python loop per shingle or
per hash function. benchmarks/data_pipeline.py compares it with datasketch.
"""
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import xxhash

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # odd constant of the polynomial hashes over bytes and words
GOLDEN_INVERSE = np.uint64(pow(0x9E3779B97F4A7C15, -1, 2**64))  # odd, so invertible modulo 2^64
BYTE_UNITS = np.arange(1, 257, dtype=np.uint64)  # a byte's unit in the hashes: its value + 1, so that 0 counts
TEXTS_PER_BATCH = 1000  # candidate texts fetched and shingled at a time when verifying near duplicates
EncodedAt = Callable[[list[int]], list[bytes]]  # `normalized_bytes` of the documents at these positions (ascending)


def normalize(text: str) -> str:
    """Lowercase, whitespace runs collapsed to one space: what counts as 'the same text'."""
    return " ".join(text.lower().split())


def normalized_bytes(texts: list[str]) -> list[bytes]:
    """Each text normalized and UTF-8 encoded: what exact hashes and shingles are made of, computed once for both."""
    return [normalize(t).encode() for t in texts]


def bytes_hashes(encoded: list[bytes]) -> np.ndarray:
    """A 64-bit hash of each normalized, encoded text."""
    return np.fromiter(map(xxhash.xxh3_64_intdigest, encoded), dtype=np.uint64, count=len(encoded))


def text_hashes(texts: list[str]) -> np.ndarray:
    """A 64-bit hash of each normalized text."""
    return bytes_hashes(normalized_bytes(texts))


def repeated_mask(hashes: np.ndarray) -> np.ndarray:
    """True for every item whose hash appeared earlier (the first of each group is kept)."""
    _, first = np.unique(hashes, return_index=True)
    repeated = np.ones(len(hashes), dtype=bool)
    repeated[first] = False
    return repeated


def exact_duplicate_mask(texts: list[str]) -> np.ndarray:
    """True for every document whose normalized text appeared earlier in the list."""
    return repeated_mask(text_hashes(texts))


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every output bit depends on every input bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def index_in_segment(lengths: np.ndarray) -> np.ndarray:
    total = int(lengths.sum())
    dtype = np.int32 if total < 2**31 else np.int64  # per-byte arrays are the big ones: half the memory to touch
    starts = (np.cumsum(lengths) - lengths).astype(dtype)
    return np.arange(total, dtype=dtype) - np.repeat(starts, lengths)


def segment_hashes(units: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """One polynomial hash per segment of consecutive units (sum of unit * GOLDEN^(i+1), wrapping)."""
    powers = np.cumprod(np.full(int(lengths.max(initial=0)) + 1, GOLDEN, dtype=np.uint64))
    nonempty = lengths > 0
    hashes = np.zeros(len(lengths), dtype=np.uint64)
    if nonempty.any():
        terms = units * powers[index_in_segment(lengths)]
        starts = (np.cumsum(lengths) - lengths)[nonempty]
        hashes[nonempty] = np.add.reduceat(terms, starts)
    return hashes


@lru_cache(maxsize=1)
def golden_powers(size: int) -> tuple[np.ndarray, np.ndarray]:
    """GOLDEN^(i+1) for i < size, and GOLDEN^-i for i <= size: computed once per process (a cumulative product is
    sequential, slower than the hashing it serves), 16 bytes per byte of the largest chunk."""
    powers = np.cumprod(np.full(size, GOLDEN, dtype=np.uint64))
    inverse = np.ones(size + 1, dtype=np.uint64)
    np.cumprod(np.full(size, GOLDEN_INVERSE, dtype=np.uint64), out=inverse[1:])
    return powers, inverse


def word_hashes(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """segment_hashes of the byte runs data[start:end], from one prefix sum over the whole stream: there a run's
    terms carry an extra factor GOLDEN^start, which its inverse modulo 2^64 removes. Fewer passes over per-byte
    arrays than segment_hashes (no index within each run, no gather of powers), the same values."""
    powers, inverse = golden_powers(1 << max(18, (len(data) - 1).bit_length()))
    prefix = np.zeros(len(data) + 1, dtype=np.uint64)
    np.cumsum(BYTE_UNITS[data] * powers[:len(data)], out=prefix[1:])
    return (prefix[ends] - prefix[starts]) * inverse[starts]


def word_units(data: np.ndarray, doc_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A mixed 64-bit hash per space-separated word of the byte stream (documents of `doc_bytes` bytes joined by
    one space), and each word's document."""
    is_space = data == ord(" ")
    is_start = ~is_space
    is_start[1:] &= is_space[:-1]
    starts = np.flatnonzero(is_start)
    is_end = ~is_space
    is_end[:-1] &= is_space[1:]
    ends = np.flatnonzero(is_end) + 1
    doc_starts = np.cumsum(doc_bytes + 1) - (doc_bytes + 1)
    words_per_doc = np.diff(np.searchsorted(starts, doc_starts), append=len(starts))
    return mix64(word_hashes(data, starts, ends)), np.repeat(np.arange(len(doc_bytes), dtype=np.int32), words_per_doc)


def shingles(units: np.ndarray, doc_of_unit: np.ndarray, n_docs: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of every run of n consecutive units inside one document, grouped by document, and the
    count per document. A document with fewer than n units is one shingle of all of them."""
    per_doc = np.bincount(doc_of_unit, minlength=n_docs)
    m = max(len(units) - n + 1, 0)
    grams = np.zeros(m, dtype=np.uint64)
    for j in range(n):
        grams = grams * GOLDEN + units[j:j + m]
    inside = doc_of_unit[:m] == doc_of_unit[n - 1:n - 1 + m]
    grams, doc_of_gram = grams[inside], doc_of_unit[:m][inside]
    short = per_doc < n
    if short.any():
        in_short = np.repeat(short, per_doc)
        grams = np.concatenate([grams, segment_hashes(units[in_short], per_doc[short])])
        doc_of_gram = np.concatenate([doc_of_gram, np.flatnonzero(short)])
        order = np.argsort(doc_of_gram, kind="stable")
        grams, doc_of_gram = grams[order], doc_of_gram[order]
    return mix64(grams), np.bincount(doc_of_gram, minlength=n_docs)


def runs(sizes: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """(start, stop) of runs of consecutive items whose sizes add up to about `budget` (a larger item alone)."""
    ends = np.cumsum(sizes)
    bounds = (np.unique(np.searchsorted(ends, np.arange(budget, ends[-1] if len(ends) else 0, budget))) + 1).tolist()
    return [(start, stop) for start, stop in zip([0, *bounds], [*bounds, len(sizes)]) if start < stop]


def byte_chunks(encoded: list[bytes], chunk_bytes: int) -> list[tuple[int, int]]:
    """(start, stop) of runs of consecutive documents of about `chunk_bytes` bytes (a longer document alone)."""
    return runs(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), chunk_bytes)


@dataclass(frozen=True)
class MinHasher:
    """MinHash signatures; the same parameters always give the same signatures."""
    num_perm: int = 128
    shingle: str = "word"  # "word": word n-grams; "char": character (byte) n-grams of the normalized text
    ngram: int = 5
    seed: int = 1

    def permutations(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        a = rng.integers(0, 2**32, self.num_perm, dtype=np.uint32) | np.uint32(1)
        return a, rng.integers(0, 2**32, self.num_perm, dtype=np.uint32)

    def shingle_hashes(self, encoded: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """32-bit shingle hashes of a batch of normalized, encoded texts, grouped by document, and how many each
        document has."""
        data = np.frombuffer(b" ".join(encoded), dtype=np.uint8)
        doc_bytes = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        if self.shingle == "word":
            units, doc_of_unit = word_units(data, doc_bytes)
        else:
            doc_of_byte = np.repeat(np.arange(len(encoded), dtype=np.int32), doc_bytes + 1)[:len(data)]
            keep = data != ord(" ")
            units, doc_of_unit = data[keep].astype(np.uint64) + np.uint64(1), doc_of_byte[keep]
        hashes, counts = shingles(units, doc_of_unit, len(encoded), self.ngram)
        return (hashes >> np.uint64(32)).astype(np.uint32), counts

    def signatures(self, texts: list[str]) -> np.ndarray:
        """(documents, num_perm) uint32 signatures of the texts."""
        return self.normalized_signatures(normalized_bytes(texts))

    def normalized_signatures(self, encoded: list[bytes], chunk_bytes: int = 1 << 18) -> np.ndarray:
        """Signatures of texts already through `normalized_bytes`. Documents go through in chunks of about
        `chunk_bytes`, so that the per-byte arrays stay in cache and their memory is reused: touching fresh
        memory for whole-batch arrays cost more than the hashing on the development machine."""
        signatures = np.empty((len(encoded), self.num_perm), dtype=np.uint32)
        for start, stop in byte_chunks(encoded, chunk_bytes):
            signatures[start:stop] = self.chunk_signatures(encoded[start:stop])
        return signatures

    def chunk_signatures(self, encoded: list[bytes], max_cells: int = 1 << 22) -> np.ndarray:
        hashes, counts = self.shingle_hashes(encoded)
        a, b = self.permutations()
        ends = np.cumsum(counts)
        starts = ends - counts
        signatures = np.empty((len(encoded), self.num_perm), dtype=np.uint32)
        doc = 0
        while doc < len(encoded):
            last = max(doc + 1, int(np.searchsorted(ends, starts[doc] + max_cells // self.num_perm, "right")))
            values = np.multiply.outer(a, hashes[starts[doc]:ends[last - 1]])  # (num_perm, shingles): rows contiguous
            values += b[:, None]
            signatures[doc:last] = np.minimum.reduceat(values, starts[doc:last] - starts[doc], axis=1).T
            doc = last
        return signatures


def candidate_probability(similarity: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """LSH's S-curve: the chance that two documents of this Jaccard similarity share at least one band."""
    return 1 - (1 - similarity ** rows) ** bands


@lru_cache
def lsh_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) with bands x rows <= num_perm whose S-curve best separates similarities below
    `threshold` (false positives, area under the curve) from those above (false negatives, area over it)."""
    below, above = np.linspace(0, threshold, 200), np.linspace(threshold, 1, 200)
    best, best_error = (1, num_perm), np.inf
    for bands in range(1, num_perm + 1):
        rows = num_perm // bands
        error = (np.trapezoid(candidate_probability(below, bands, rows), below)
                 + np.trapezoid(1 - candidate_probability(above, bands, rows), above))
        if error < best_error:
            best, best_error = (bands, rows), error
    return best


def band_keys(signatures: np.ndarray, band: int, rows: int) -> np.ndarray:
    part = signatures[:, band * rows:(band + 1) * rows].astype(np.uint64)
    key = np.zeros(len(signatures), dtype=np.uint64)
    for column in range(rows):
        key = key * GOLDEN + part[:, column]
    return mix64(key)


def candidate_pairs(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(pairs, 2) documents that share a whole band: each document with the first one (lowest index) of
    its bucket, per band, without repeats."""
    found = []
    for band in range(bands):
        keys = band_keys(signatures, band, rows)
        order = np.argsort(keys, kind="stable")  # equal keys stay in document order
        sorted_keys = keys[order]
        opens_bucket = np.concatenate([[True], sorted_keys[1:] != sorted_keys[:-1]])
        first = order[np.maximum.accumulate(np.where(opens_bucket, np.arange(len(order)), 0))]
        found.append(np.stack([first[~opens_bucket], order[~opens_bucket]], axis=1))
    pairs = np.concatenate(found) if found else np.zeros((0, 2), dtype=np.int64)
    return np.unique(pairs, axis=0)


def first_of_group(n: int, pairs: np.ndarray) -> np.ndarray:
    """For each of n items, the lowest index in its connected component of the pair graph."""
    labels = np.arange(n)
    left, right = pairs[:, 0], pairs[:, 1]
    while True:
        low = np.minimum(labels[left], labels[right])
        before = labels.copy()
        np.minimum.at(labels, left, low)
        np.minimum.at(labels, right, low)
        labels = labels[labels]  # pointer jumping: follow each label to its own label
        if np.array_equal(labels, before):
            return labels


def shingle_sets(hasher: MinHasher, encoded: list[bytes], chunk_bytes: int = 1 << 18) -> tuple[np.ndarray, np.ndarray]:
    """Each document's distinct shingle hashes as sorted keys (document << 32 | hash), and how many each document
    has (at least one: a document too short for an n-gram is one shingle). Hashed in the signatures' chunks of
    bytes: they reuse the cached powers of word_hashes, which other sizes would recompute."""
    hashes, counts = map(np.concatenate, zip(*[hasher.shingle_hashes(encoded[start:stop])
                                               for start, stop in byte_chunks(encoded, chunk_bytes)]))
    keys = np.sort(np.repeat(np.arange(len(encoded), dtype=np.uint64), counts) << np.uint64(32) | hashes)
    keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]  # np.unique took 10 times longer (NumPy 2.4)
    return keys, np.bincount((keys >> np.uint64(32)).astype(np.int64), minlength=len(encoded))


def set_jaccard(keys: np.ndarray, counts: np.ndarray, pairs: np.ndarray, max_cells: int = 1 << 22) -> np.ndarray:
    """Exact Jaccard similarity of the shingle sets (`shingle_sets`' keys and counts) of each pair of documents:
    each shingle of the second document is looked up under the first's in the sorted keys. Pairs go through in
    chunks of about `max_cells` lookups, which bounds the memory when candidates are many."""
    starts = np.cumsum(counts) - counts
    lengths = counts[pairs[:, 1]]
    shared = np.zeros(len(pairs), dtype=np.int64)
    for start, stop in runs(lengths, max_cells):
        first, second, length = pairs[start:stop, 0], pairs[start:stop, 1], lengths[start:stop]
        hashes = keys[np.repeat(starts[second], length) + index_in_segment(length)] & np.uint64(0xFFFFFFFF)
        wanted = np.repeat(first.astype(np.uint64), length) << np.uint64(32) | hashes
        found = keys[np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)] == wanted
        shared[start:stop] = np.add.reduceat(found, np.cumsum(length) - length, dtype=np.int64)
    return shared / (counts[pairs].sum(axis=1) - shared)


@dataclass(frozen=True)
class NearDuplicates:
    """Finds near-duplicate documents from their MinHash signatures and texts.

    Candidates come from LSH bands tuned for `threshold - candidate_margin`, so that pairs just above
    the threshold are rarely missed; each candidate pair is then kept only if the exact Jaccard similarity
    of the two documents' shingle sets is at least `threshold`. The signatures' agreement would only
    estimate it (standard deviation about 0.035 at 0.8 with 128 permutations), dropping true pairs just
    above the threshold and keeping false ones just below. The exact sets need the texts again, but only
    the candidates' (an `EncodedAt` fetches them). `hasher` must be the one that made the signatures: its
    shingles make the sets."""
    threshold: float = 0.8
    hasher: MinHasher = field(default_factory=MinHasher)
    candidate_margin: float = 0.1

    def pairs(self, signatures: np.ndarray, encoded: EncodedAt) -> np.ndarray:
        """(pairs, 2) near duplicates: documents (rows of `signatures`) each with the first of an LSH bucket they
        share, where the two are at least `threshold` similar."""
        return self.verified(self.candidates(signatures), encoded)

    def candidates(self, signatures: np.ndarray) -> np.ndarray:
        bands, rows = lsh_bands(max(self.threshold - self.candidate_margin, 0.05), self.hasher.num_perm)
        return candidate_pairs(signatures, bands, rows)

    def verified(self, pairs: np.ndarray, encoded: EncodedAt) -> np.ndarray:
        """The pairs whose shingle sets are at least `threshold` similar."""
        if not len(pairs):
            return pairs
        docs, position = np.unique(pairs, return_inverse=True)
        keys, counts = self.candidate_sets(docs.tolist(), encoded)
        return pairs[set_jaccard(keys, counts, position.reshape(pairs.shape)) >= self.threshold]

    def candidate_sets(self, docs: list[int], encoded: EncodedAt) -> tuple[np.ndarray, np.ndarray]:
        """`shingle_sets` of the documents `docs`, fetched TEXTS_PER_BATCH at a time: only a batch's texts are
        held at once."""
        parts = [shingle_sets(self.hasher, encoded(docs[i:i + TEXTS_PER_BATCH]))
                 for i in range(0, len(docs), TEXTS_PER_BATCH)]
        return (np.concatenate([keys + (np.uint64(i * TEXTS_PER_BATCH) << np.uint64(32)) for i, (keys, _) in
                                enumerate(parts)]), np.concatenate([counts for _, counts in parts]))

    def duplicate_mask(self, signatures: np.ndarray, encoded: EncodedAt) -> np.ndarray:
        """True for every document in a group of near duplicates that is not the group's first."""
        return first_of_group(len(signatures), self.pairs(signatures, encoded)) != np.arange(len(signatures))

    def matching_mask(self, references: np.ndarray, references_encoded: EncodedAt, signatures: np.ndarray,
                      encoded: EncodedAt) -> np.ndarray:
        """True for every document of `signatures` that near-duplicates one of `references` (decontamination)."""
        n = len(references)

        def both(rows: list[int]) -> list[bytes]:  # rows ascend: the references' come first
            ours = [r - n for r in rows if r >= n]
            return [*references_encoded(rows[:len(rows) - len(ours)]), *encoded(ours)]

        pairs = self.candidates(np.concatenate([references, signatures]))
        pairs = self.verified(pairs[(pairs[:, 0] < n) & (pairs[:, 1] >= n)], both)  # a reference is its bucket's first
        mask = np.zeros(len(signatures), dtype=bool)
        mask[pairs[:, 1] - n] = True
        return mask
