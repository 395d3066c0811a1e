import json
import random

import numpy as np
import pytest

from data_pipeline.dedup import (
    EncodedAt,
    MinHasher,
    NearDuplicates,
    candidate_pairs,
    exact_duplicate_mask,
    first_of_group,
    lsh_bands,
    normalize,
    normalized_bytes,
    segment_hashes,
    set_jaccard,
    word_hashes,
)
from training.config.recipe import RECIPES_DIR


def word_shingles(text: str, n: int = 5) -> set:
    words = normalize(text).split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: str, b: str) -> float:
    x, y = word_shingles(a), word_shingles(b)
    return len(x & y) / len(x | y)


def at(texts: list[str]) -> EncodedAt:
    return lambda rows: normalized_bytes([texts[i] for i in rows])


@pytest.fixture(scope="module")
def documents() -> list[str]:
    """300 real documents (Python's documentation) of 80+ words, no two with an exact word 5-gram
    Jaccard similarity above 0.3 (the corpus itself holds near duplicates: help topics repeated with
    other heading underlines)."""
    kept, kept_shingles = [], []
    for line in (RECIPES_DIR / "tiny_llama" / "corpus.jsonl").open():
        text = json.loads(line)["text"]
        shingles = word_shingles(text)
        if len(text.split()) >= 80 and all(len(shingles & s) / len(shingles | s) <= 0.3 for s in kept_shingles):
            kept.append(text)
            kept_shingles.append(shingles)
        if len(kept) == 300:
            return kept
    raise AssertionError("the corpus has fewer than 300 distinct long documents")


def edit(text: str, rng: random.Random, rate: float) -> str:
    words = text.split()
    for _ in range(max(1, int(rate * len(words)))):
        i = rng.randrange(len(words))
        match rng.randrange(3):
            case 0:
                words[i] = "replaced"
            case 1:
                del words[i]
            case 2:
                words.insert(i, "inserted")
    return " ".join(words)


def reorder(text: str) -> str:
    """Swap the two halves: only the shingles across the cut change."""
    words = text.split()
    return " ".join(words[len(words) // 2:] + words[:len(words) // 2])


def whitespace_and_case(text: str) -> str:
    return "  " + text.upper().replace(" ", " \n\t ") + "\n"


def test_normalize():
    assert normalize("  Hello,\n\tWORLD  again ") == "hello, world again"


def test_exact_duplicates_keep_the_first_in_input_order():
    texts = ["a b c", "x y", "A  B\nc", "x y", "new"]
    assert exact_duplicate_mask(texts).tolist() == [False, False, True, True, False]


def test_the_corpus_own_near_duplicates_are_found():
    """The help() topics 'The "async for" statement' and its copy with another heading underline."""
    texts = [json.loads(line)["text"] for line in (RECIPES_DIR / "tiny_llama" / "corpus.jsonl").open()]
    pairs = [(i, j) for i, j in NearDuplicates().pairs(MinHasher().signatures(texts), at(texts)).tolist()]
    assert len(pairs) > 10
    assert all(jaccard(texts[i], texts[j]) >= 0.8 for i, j in pairs)  # verified exactly (on 32-bit shingle hashes)


@pytest.mark.slow
def test_planted_near_duplicates_are_found_and_originals_kept(documents):
    rng = random.Random(0)
    originals = documents[:100]
    shuffled_words = []  # same vocabulary, different text: must survive
    for text in documents[100:130]:
        words = text.split()
        rng.shuffle(words)
        shuffled_words.append(" ".join(words))
    planted = ([edit(t, rng, 0.01) for t in originals[:40]] + [reorder(t) for t in originals[40:70]]
               + [whitespace_and_case(t) for t in originals[70:100]])
    assert min(jaccard(a, b) for a, b in zip(originals, planted)) >= 0.85  # what "near duplicate" means here
    assert max(jaccard(a, b) for a, b in zip(documents[100:130], shuffled_words)) < 0.1
    corpus = originals + shuffled_words + documents[100:130] + planted
    signatures = MinHasher().signatures(corpus)
    duplicate = NearDuplicates(threshold=0.8).duplicate_mask(signatures, at(corpus))
    n_kept = len(originals) + len(shuffled_words) + 30
    assert not duplicate[:n_kept].any()
    assert duplicate[n_kept:].all()


@pytest.mark.slow
def test_character_shingles_find_the_same_plants(documents):
    rng = random.Random(1)
    corpus = documents[:50] + [edit(t, rng, 0.01) for t in documents[:50]]
    hasher = MinHasher(shingle="char", ngram=5)
    near = NearDuplicates(threshold=0.8, hasher=hasher)
    assert near.duplicate_mask(hasher.signatures(corpus), at(corpus)).tolist() == [False] * 50 + [True] * 50


def test_signatures_are_deterministic_and_independent_of_batching(documents):
    hasher = MinHasher(num_perm=64)
    whole = hasher.signatures(documents[:40])
    in_parts = np.concatenate([hasher.signatures(documents[:13]), hasher.signatures(documents[13:40])])
    np.testing.assert_array_equal(whole, in_parts)
    np.testing.assert_array_equal(whole, MinHasher(num_perm=64).signatures(documents[:40]))
    assert not np.array_equal(whole, MinHasher(num_perm=64, seed=2).signatures(documents[:40]))


def test_signature_agreement_estimates_jaccard(documents):
    """Over many edited pairs the estimate is unbiased, with the binomial spread of 256 permutations."""
    rng = random.Random(2)
    hasher = MinHasher(num_perm=256)
    errors = []
    for text in documents[:150]:
        other = edit(text, rng, rng.uniform(0.01, 0.2))
        a, b = hasher.signatures([text, other])
        errors.append((a == b).mean() - jaccard(text, other))
    assert abs(np.mean(errors)) < 0.01
    assert np.std(errors) < 0.04  # at most sqrt(0.25 / 256) = 0.031 plus hash noise


def test_word_hashes_from_prefix_sums_equal_segment_hashes():
    """The prefix-sum shortcut of the word hashes gives the polynomial hash of each run on its own."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 5000, dtype=np.uint8)
    bounds = np.sort(rng.choice(np.arange(1, 5000), 400, replace=False))
    starts, ends = bounds[::2], bounds[1::2]
    np.testing.assert_array_equal(word_hashes(data, starts, ends),
                                  segment_hashes(data[np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])]
                                                 .astype(np.uint64) + np.uint64(1), ends - starts))


def test_short_and_empty_documents_get_signatures():
    signatures = MinHasher().signatures(["one", "", "two words", "one", ""])
    np.testing.assert_array_equal(signatures[0], signatures[3])
    np.testing.assert_array_equal(signatures[1], signatures[4])
    assert not np.array_equal(signatures[0], signatures[2])


def test_lsh_bands_fit_the_permutations():
    for threshold in (0.5, 0.7, 0.8, 0.9):
        bands, rows = lsh_bands(threshold, 128)
        assert bands * rows <= 128
    assert lsh_bands(0.9, 128)[1] > lsh_bands(0.5, 128)[1]  # stricter threshold, longer bands


def test_candidates_pair_each_bucket_member_with_its_first():
    signatures = np.array([[1, 1], [2, 2], [1, 1], [3, 3], [1, 1], [2, 2]], dtype=np.uint32)
    assert candidate_pairs(signatures, bands=1, rows=2).tolist() == [[0, 2], [0, 4], [1, 5]]


def test_groups_keep_their_lowest_index():
    labels = first_of_group(7, np.array([[5, 6], [2, 5], [3, 4]]))
    assert labels.tolist() == [0, 1, 2, 3, 3, 2, 2]


def edited_pair(text: str, seed: int, similarity: tuple[float, float], agreeing: bool) -> str:
    """The first edit of `text` (seeds from `seed` on) whose exact Jaccard similarity to it lies in `similarity`,
    whose signature agrees with the original's on at least 0.8 of the positions exactly when `agreeing`, and that
    LSH makes a candidate."""
    for attempt in range(seed, seed + 500):
        rng = random.Random(attempt)
        other = edit(text, rng, rng.uniform(0.01, 0.04))
        signatures = MinHasher().signatures([text, other])
        if (similarity[0] <= jaccard(text, other) <= similarity[1]
                and ((signatures[0] == signatures[1]).mean() >= 0.8) == agreeing
                and NearDuplicates().candidates(signatures).tolist() == [[0, 1]]):
            return other
    raise AssertionError(f"no edit of the text from seed {seed} fits")


def test_pairs_are_verified_by_exact_jaccard_not_signature_agreement(documents):
    """A pair just above the threshold whose signatures agree on less than 0.8 of positions is kept; a pair just below
    whose signatures agree on more is dropped."""
    above = edited_pair(documents[0], 0, (0.81, 0.83), agreeing=False)
    below = edited_pair(documents[1], 0, (0.77, 0.79), agreeing=True)
    corpus = [documents[0], above, documents[1], below]
    near = NearDuplicates(threshold=0.8)
    assert near.candidates(MinHasher().signatures(corpus)).tolist() == [[0, 1], [2, 3]]
    assert near.pairs(MinHasher().signatures(corpus), at(corpus)).tolist() == [[0, 1]]
    assert near.duplicate_mask(MinHasher().signatures(corpus), at(corpus)).tolist() == [False, True, False, False]


def test_decontamination_matches_by_exact_jaccard(documents):
    above = edited_pair(documents[0], 0, (0.81, 0.83), agreeing=False)
    below = edited_pair(documents[1], 0, (0.77, 0.79), agreeing=True)
    references, corpus = [documents[2], documents[0], documents[1]], [below, documents[3], above]
    hasher = MinHasher()
    mask = NearDuplicates().matching_mask(hasher.signatures(references), at(references), hasher.signatures(corpus),
                                          at(corpus))
    assert mask.tolist() == [False, False, True]


def test_set_jaccard_is_exact_over_chunks():
    """Random sets with repeated hashes, pairs spread over several chunks: the same as Python's sets."""
    rng = np.random.default_rng(0)
    sets = [np.unique(rng.integers(0, 300, rng.integers(1, 200), dtype=np.uint32)) for _ in range(30)]
    pairs = rng.integers(0, 30, (100, 2))
    expected = [len(set(sets[i]) & set(sets[j])) / len(set(sets[i]) | set(sets[j])) for i, j in pairs]
    keys = np.concatenate([np.uint64(i) << np.uint64(32) | s for i, s in enumerate(sets)])
    counts = np.array([len(s) for s in sets])
    np.testing.assert_allclose(set_jaccard(keys, counts, pairs, max_cells=500), expected)
