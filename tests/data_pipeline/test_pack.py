import numpy as np
import pytest

from data_pipeline.pack import IGNORE_INDEX, pack_concat


def test_exact_small_example():
    rows = pack_concat(np.array([5, 6, 7, 8, 9, 10, 11, 12]), np.array([3, 5]), seq_len=4)
    assert rows["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 11, 12]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]
    assert rows["labels"].tolist() == [[-100, 6, 7, -100], [-100, 10, 11, 12]]


def test_tail_shorter_than_a_row_is_dropped():
    rows = pack_concat(np.arange(1, 11), np.array([4, 6]), seq_len=4)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert rows["labels"].tolist() == [[-100, 2, 3, 4], [-100, 6, 7, 8]]


@pytest.mark.parametrize("seed", range(5))
def test_random_documents_keep_every_token_in_order(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, size=200)
    tokens = rng.integers(0, 50_000, size=lengths.sum())
    seq_len = 128
    rows = pack_concat(tokens, lengths, seq_len)
    n_rows = len(tokens) // seq_len
    assert rows["input_ids"].shape == rows["labels"].shape == rows["position_ids"].shape == (n_rows, seq_len)
    # no token lost, duplicated or reordered (up to the dropped tail)
    np.testing.assert_array_equal(rows["input_ids"].reshape(-1), tokens[:n_rows * seq_len])
    # position_ids restart exactly at document starts and row starts, and count up by one otherwise
    doc_start = np.zeros(len(tokens), bool)
    doc_start[np.concatenate([[0], np.cumsum(lengths)[:-1]])] = True
    expected_start = doc_start[:n_rows * seq_len].reshape(n_rows, seq_len)
    expected_start[:, 0] = True
    np.testing.assert_array_equal(rows["position_ids"] == 0, expected_start)
    steps = np.diff(rows["position_ids"], axis=1)
    assert np.all((steps == 1) | expected_start[:, 1:])
    # labels are the tokens themselves except at document and row starts
    np.testing.assert_array_equal(rows["labels"] == IGNORE_INDEX, expected_start)
    np.testing.assert_array_equal(rows["labels"][~expected_start], rows["input_ids"][~expected_start])
