"""Sequence packing as pure functions over token arrays."""
import numpy as np

IGNORE_INDEX = -100


def pack_concat(tokens: np.ndarray, doc_lengths: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """Concatenate documents and cut the stream into rows of exactly `seq_len` tokens.

    Documents may span rows; the tail that does not fill a last whole row is dropped.
    `position_ids` restart at 0 at every document start and at every row start, so
    transformers keeps attention inside each document (and learned absolute position
    embeddings never see a position >= seq_len). `labels` are -100 on the first token of
    every document and of every row: after the model's one-token shift, no token is asked
    to predict the first token of the next document.

    Example, seq_len=4, documents [5 6 7] and [8 9 10 11 12]:
        input_ids     [5, 6, 7, 8]          [9, 10, 11, 12]
        position_ids  [0, 1, 2, 0]          [0, 1, 2, 3]
        labels        [-100, 6, 7, -100]    [-100, 10, 11, 12]
    """
    n_rows = len(tokens) // seq_len
    used = n_rows * seq_len
    is_doc_start = np.zeros(len(tokens), dtype=bool)
    is_doc_start[np.cumsum(doc_lengths)[:-1]] = True
    is_doc_start[0] = True
    input_ids = tokens[:used].reshape(n_rows, seq_len).astype(np.int32)
    is_start = is_doc_start[:used].reshape(n_rows, seq_len)
    is_start[:, 0] = True
    index = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (n_rows, seq_len))
    last_start = np.maximum.accumulate(np.where(is_start, index, 0), axis=1)
    return {
        "input_ids": input_ids,
        "labels": np.where(is_start, IGNORE_INDEX, input_ids).astype(np.int32),
        "position_ids": (index - last_start).astype(np.int32),
    }
