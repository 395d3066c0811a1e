import numpy as np
import pytest

from data_pipeline.pack import IGNORE_INDEX, best_fit_decreasing, fit_to_length, pack_bfd, pack_concat, pack_padded


def random_documents(seed: int, n: int = 200, max_length: int = 300, min_length: int = 1):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_length, max_length, size=n)
    return rng.integers(5, 50_000, size=lengths.sum()).astype(np.int32), lengths


def documents_in_rows(rows: dict, pad_id: int) -> list[tuple[tuple, tuple]]:
    """Read (tokens, labels) of each document back out of packed rows, using only position_ids and length."""
    found = []
    for ids, labels, positions, length in zip(rows["input_ids"], rows["labels"], rows["position_ids"], rows["length"]):
        for token, label, position in zip(ids[:length].tolist(), labels[:length].tolist(), positions[:length].tolist()):
            if position == 0:
                found.append(([], []))
            found[-1][0].append(token)
            found[-1][1].append(label)
        assert (ids[length:] == pad_id).all()
    return [(tuple(tokens), tuple(labels)) for tokens, labels in found]


def check_row_invariants(rows: dict, seq_len: int) -> None:
    n_rows = len(rows["length"])
    assert rows["input_ids"].shape == rows["labels"].shape == rows["position_ids"].shape == (n_rows, seq_len)
    starts = rows["position_ids"] == 0
    assert starts[:, 0].all()
    steps = np.diff(rows["position_ids"].astype(np.int64), axis=1)
    assert np.all((steps == 1) | starts[:, 1:])  # positions count up by one inside every document
    assert np.all(rows["labels"][starts] == IGNORE_INDEX)  # no target on a document's first token
    real = np.arange(seq_len)[None, :] < rows["length"][:, None]
    assert np.all(rows["labels"][~real] == IGNORE_INDEX)  # nor on padding


def test_concat_exact_small_example():
    rows = pack_concat(np.array([5, 6, 7, 8, 9, 10, 11, 12]), np.array([3, 5]), seq_len=4)
    assert rows["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 11, 12]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]
    assert rows["labels"].tolist() == [[-100, 6, 7, -100], [-100, 10, 11, 12]]
    assert rows["length"].tolist() == [4, 4]


def test_concat_drops_the_tail_shorter_than_a_row():
    rows = pack_concat(np.arange(1, 11), np.array([4, 6]), seq_len=4)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert rows["labels"].tolist() == [[-100, 2, 3, 4], [-100, 6, 7, 8]]


@pytest.mark.parametrize("seed", range(5))
def test_concat_keeps_every_token_in_order(seed):
    tokens, lengths = random_documents(seed)
    rows = pack_concat(tokens, lengths, 128)
    n_rows = len(tokens) // 128
    check_row_invariants(rows, 128)
    not_start = rows["position_ids"] != 0
    np.testing.assert_array_equal(rows["labels"][not_start], rows["input_ids"][not_start])
    np.testing.assert_array_equal(rows["input_ids"].reshape(-1), tokens[:n_rows * 128])
    doc_start = np.zeros(len(tokens), bool)
    doc_start[np.concatenate([[0], np.cumsum(lengths)[:-1]])] = True
    expected_start = doc_start[:n_rows * 128].reshape(n_rows, 128)
    expected_start[:, 0] = True
    np.testing.assert_array_equal(rows["position_ids"] == 0, expected_start)


def test_bfd_exact_small_example():
    assert [b.tolist() for b in best_fit_decreasing(np.array([3, 6, 2, 5]), 8)] == [[1, 0, 0, 1], [5, 0, 6, 0]]
    rows = pack_bfd(np.arange(1, 17), np.array([3, 6, 2, 5]), seq_len=8, pad_id=0)
    assert rows["input_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 1, 2, 3]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2]]
    assert rows["labels"].tolist() == [[-100, 5, 6, 7, 8, 9, -100, 11], [-100, 13, 14, 15, 16, -100, 2, 3]]


def test_padding_is_its_own_document_with_no_targets():
    rows = pack_padded(np.arange(1, 7), np.array([4, 2]), seq_len=5, pad_id=0)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4, 0], [5, 6, 0, 0, 0]]
    assert rows["labels"].tolist() == [[-100, 2, 3, 4, -100], [-100, 6, -100, -100, -100]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 0, 1, 2]]
    assert rows["length"].tolist() == [4, 2]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("packer", [pack_bfd, pack_padded])
def test_whole_documents_each_appear_exactly_once_with_their_labels(seed, packer):
    tokens, lengths = random_documents(seed)
    labels = np.where(np.random.default_rng(seed).random(len(tokens)) < 0.3, IGNORE_INDEX, tokens)  # e.g. prompts
    rows = packer(tokens, lengths, 300, pad_id=1, labels=labels)
    check_row_invariants(rows, 300)
    documents = zip(np.split(tokens, np.cumsum(lengths)[:-1]), np.split(labels, np.cumsum(lengths)[:-1]))
    expected = sorted((tuple(doc), (IGNORE_INDEX, *doc_labels[1:])) for doc, doc_labels in documents)
    assert sorted(documents_in_rows(rows, pad_id=1)) == expected
    assert rows["length"].sum() == len(tokens) and (rows["length"] <= 300).all()


def test_bfd_packs_lognormal_lengths_into_the_fewest_rows():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(400), 1.0, 5000).astype(np.int64), 1, 2048)
    rows = pack_bfd(np.ones(lengths.sum(), dtype=np.int32), lengths, 2048, pad_id=0)
    assert len(rows["length"]) <= -(-lengths.sum() // 2048) + 1  # within one row of the fewest the tokens allow
    assert rows["length"].sum() / (len(rows["length"]) * 2048) > 0.999


@pytest.mark.parametrize("policy, expected_lengths, expected_tokens", [
    ("split", [4, 4, 2, 3], list(range(1, 14))),
    ("truncate", [4, 3], [1, 2, 3, 4, 11, 12, 13]),
    ("drop", [3], [11, 12, 13]),
])
def test_fit_to_length(policy, expected_lengths, expected_tokens):
    tokens = np.arange(1, 14)
    new_tokens, new_labels, lengths, too_long = fit_to_length(tokens, tokens.copy(), np.array([10, 3]), 4, policy)
    assert lengths.tolist() == expected_lengths and too_long == 1
    assert new_tokens.tolist() == expected_tokens == new_labels.tolist()


@pytest.mark.parametrize("max_length", [20, 300])
def test_copy_per_document_and_scatter_per_token_agree(max_length, monkeypatch):
    """place_documents picks one of two implementations by mean document length; both give the same rows."""
    import data_pipeline.pack as pack
    tokens, lengths = random_documents(3, n=500, max_length=max_length)
    results = []
    for threshold in (0, 10**9):  # 0: always copy per document; huge: always scatter per token
        monkeypatch.setattr(pack, "COPY_PER_DOCUMENT_MIN_MEAN_LENGTH", threshold)
        results.append(pack_bfd(tokens, lengths, 512, pad_id=0))
    for name in results[0]:
        np.testing.assert_array_equal(results[0][name], results[1][name])
