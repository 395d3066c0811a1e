"""Sequence packing as pure functions over token arrays.

Documents arrive laid end to end: `tokens` and `labels` (the same tokens, or -100 where no loss is
taken, e.g. on a chat prompt) plus each document's length. Every strategy returns rows of exactly
`seq_len` with:
- `input_ids`, and `labels` that are -100 on the first token of every document (and of every row),
  so that after the model's one-token shift no document is asked to predict the next one's start;
- `position_ids` that restart at 0 at every document start, so transformers keeps attention inside
  each document (padding counts as one more document of its own);
- `length`: the real (non-padding) tokens of the row, at its start.

Large arrays are few and written once (positions are built by a cumulative sum of a sparse step
array rather than from index temporaries): on big inputs, getting fresh memory costs as much as
computing (see `new_array`).
"""
import numpy as np
import pyarrow as pa

IGNORE_INDEX = -100


def new_array(size: int, dtype: type, fill: int | None = None) -> np.ndarray:
    """An array in memory from Arrow's pool, which the rows' Arrow columns then use without a copy.

    NumPy asks the kernel for transparent huge pages on large arrays, and where huge pages are scarce
    the kernel stalls to compact memory: a fresh 470 MB array took 0.14 to 1.0 s on the development
    machine, the same from Arrow's pool 0.05 s."""
    array = np.frombuffer(pa.allocate_buffer(size * np.dtype(dtype).itemsize), dtype=dtype)
    if fill is not None:
        array.fill(fill)
    return array


def position_dtype(seq_len: int) -> type:
    return np.int16 if seq_len <= np.iinfo(np.int16).max else np.int32


def index_dtype(size: int) -> type:
    """int32 indices where they fit: half the memory traffic of int64."""
    return np.int32 if size < 2**31 else np.int64


def document_starts(doc_lengths: np.ndarray) -> np.ndarray:
    starts = np.zeros(len(doc_lengths), dtype=np.int64)
    np.cumsum(doc_lengths[:-1], out=starts[1:])
    return starts


def counting_from(starts: np.ndarray, size: int, dtype: type) -> np.ndarray:
    """0, 1, 2, ... restarting at every index in `starts` (sorted, starts[0] == 0)."""
    steps = new_array(size, dtype, fill=1)
    if size == 0:
        return steps
    steps[starts[1:]] = 1 - np.diff(starts)
    steps[0] = 0
    return np.cumsum(steps, dtype=dtype, out=steps)


def pack_concat(tokens: np.ndarray, doc_lengths: np.ndarray, seq_len: int,
                labels: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Concatenate documents and cut the stream into rows of `seq_len` (pretraining).

    Documents may span rows, and a document's continuation restarts its positions at the row start
    (so learned absolute position embeddings never see a position >= seq_len). The tail that does not
    fill a last whole row is dropped.

    Example, seq_len=4, documents [5 6 7] and [8 9 10 11 12]:
        input_ids     [5, 6, 7, 8]          [9, 10, 11, 12]
        position_ids  [0, 1, 2, 0]          [0, 1, 2, 3]
        labels        [-100, 6, 7, -100]    [-100, 10, 11, 12]
    """
    n_rows = len(tokens) // seq_len
    used = n_rows * seq_len
    doc_starts = document_starts(doc_lengths)
    starts = np.union1d(doc_starts[doc_starts < used], np.arange(0, used, seq_len))
    row_labels = new_array(used, np.int32)
    row_labels[:] = (tokens if labels is None else labels)[:used]
    row_labels[starts] = IGNORE_INDEX
    return {
        "input_ids": np.asarray(tokens[:used], dtype=np.int32).reshape(n_rows, seq_len),
        "labels": row_labels.reshape(n_rows, seq_len),
        "position_ids": counting_from(starts, used, position_dtype(seq_len)).reshape(n_rows, seq_len),
        "length": np.full(n_rows, seq_len, dtype=np.int32),
    }


def best_fit_decreasing(doc_lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Bin-pack documents (each at most `capacity` long): longest first, each into the fullest bin it fits.

    Returns each document's bin and its offset inside the bin. Bins are found through a bitmask of the
    free-space values that some open bin has: bit r is set when a bin has exactly r slots free, so the
    best fit for length n is the lowest set bit at or above n: one shift and one lowest-bit query on a
    (capacity+1)-bit integer per document.

    Example, capacity 8, lengths [3, 6, 2, 5]: 6 opens bin 0, 5 opens bin 1, 3 best-fits bin 1 (3 free),
    2 best-fits bin 0 (2 free): bins [1, 0, 0, 1], offsets [5, 0, 6, 0].
    """
    bins = np.empty(len(doc_lengths), dtype=np.int64)
    offsets = np.empty(len(doc_lengths), dtype=np.int64)
    open_bins: list[list[int]] = [[] for _ in range(capacity + 1)]  # free space -> bins with exactly that free
    free_mask = 0
    fill: list[int] = []
    for doc in np.argsort(-doc_lengths, kind="stable").tolist():
        length = int(doc_lengths[doc])
        fits = free_mask >> length
        if fits:
            free = length + (fits & -fits).bit_length() - 1
            target = open_bins[free].pop()
            if not open_bins[free]:
                free_mask ^= 1 << free
        else:
            free, target = capacity, len(fill)
            fill.append(0)
        bins[doc], offsets[doc] = target, fill[target]
        fill[target] += length
        free -= length
        if free:
            if not open_bins[free]:
                free_mask |= 1 << free
            open_bins[free].append(target)
    return bins, offsets


# Below this many tokens per document on average, per-token indexing beats one slice copy per document.
COPY_PER_DOCUMENT_MIN_MEAN_LENGTH = 64


def place_documents(tokens: np.ndarray, labels: np.ndarray, doc_lengths: np.ndarray, bins: np.ndarray,
                    offsets: np.ndarray, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """Put whole documents at (row, offset) slots; the rest of each row is padding."""
    n_rows = int(bins.max()) + 1 if len(bins) else 0
    nonempty = doc_lengths > 0
    doc_lengths, first_slot = doc_lengths[nonempty], (bins * seq_len + offsets)[nonempty]
    dtype = position_dtype(seq_len)
    input_ids = new_array(n_rows * seq_len, np.int32, fill=pad_id)
    row_labels = new_array(n_rows * seq_len, np.int32, fill=IGNORE_INDEX)
    length = np.bincount(bins[nonempty], weights=doc_lengths, minlength=n_rows).astype(np.int32)
    position_ids = new_array(n_rows * seq_len, dtype)
    np.subtract(np.arange(seq_len, dtype=dtype)[None, :], length[:, None].astype(dtype),
                out=position_ids.reshape(n_rows, seq_len))  # padding gets positions 0, 1, ... of its own
    if len(tokens) >= COPY_PER_DOCUMENT_MIN_MEAN_LENGTH * len(doc_lengths):
        copy_per_document(tokens, labels, doc_lengths, first_slot, (input_ids, row_labels, position_ids))
    else:
        scatter_per_token(tokens, labels, doc_lengths, first_slot, (input_ids, row_labels, position_ids))
    row_labels[first_slot] = IGNORE_INDEX  # no target on a document's first token
    return {"input_ids": input_ids.reshape(n_rows, seq_len), "labels": row_labels.reshape(n_rows, seq_len),
            "position_ids": position_ids.reshape(n_rows, seq_len), "length": length}


def copy_per_document(tokens: np.ndarray, labels: np.ndarray, doc_lengths: np.ndarray, first_slot: np.ndarray,
                      out: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    """One memcpy-speed slice copy per document and array: fastest when documents are long."""
    input_ids, row_labels, position_ids = out
    counting = np.arange(int(doc_lengths.max(initial=0)), dtype=position_ids.dtype)
    for start, slot, length in zip(document_starts(doc_lengths).tolist(), first_slot.tolist(), doc_lengths.tolist()):
        input_ids[slot:slot + length] = tokens[start:start + length]
        row_labels[slot:slot + length] = labels[start:start + length]
        position_ids[slot:slot + length] = counting[:length]


def scatter_per_token(tokens: np.ndarray, labels: np.ndarray, doc_lengths: np.ndarray, first_slot: np.ndarray,
                      out: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    """Every token to its slot in whole-array operations: fastest when documents are short."""
    input_ids, row_labels, position_ids = out
    starts = document_starts(doc_lengths)
    destination = new_array(len(tokens), index_dtype(len(input_ids)), fill=1)  # first slot, then one more per token
    destination[starts[1:]] = first_slot[1:] - (first_slot[:-1] + doc_lengths[:-1] - 1)
    destination[:1] = first_slot[:1]
    np.cumsum(destination, out=destination)
    input_ids[destination] = tokens
    row_labels[destination] = labels
    position_ids[destination] = counting_from(starts, len(tokens), position_ids.dtype)


def pack_bfd(tokens: np.ndarray, doc_lengths: np.ndarray, seq_len: int, pad_id: int,
             labels: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Best-fit-decreasing packing of whole documents (SFT): no document is split, rows end in padding.

    Example, seq_len=8, documents of lengths [3, 6, 2, 5]: rows [doc1 doc2] and [doc3 doc0], each
    exactly full here; in general the padding after the last document has labels -100.
    """
    bins, offsets = best_fit_decreasing(doc_lengths, seq_len)
    return place_documents(tokens, tokens if labels is None else labels, doc_lengths, bins, offsets, seq_len, pad_id)


def pack_padded(tokens: np.ndarray, doc_lengths: np.ndarray, seq_len: int, pad_id: int,
                labels: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """No packing: one document per row, padded to seq_len."""
    bins = np.arange(len(doc_lengths), dtype=np.int64)
    return place_documents(tokens, tokens if labels is None else labels, doc_lengths, bins,
                           np.zeros_like(bins), seq_len, pad_id)


def fit_to_length(tokens: np.ndarray, labels: np.ndarray, doc_lengths: np.ndarray, seq_len: int,
                  policy: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Make every document at most seq_len long, for strategies that keep documents whole.

    `split` cuts a long document into seq_len pieces (tokens stay where they are; only the lengths
    change), `truncate` keeps its first seq_len tokens, `drop` removes it. Returns the new arrays and
    the number of documents that were too long.
    """
    too_long = doc_lengths > seq_len
    if not too_long.any():
        return tokens, labels, doc_lengths, 0
    if policy == "split":
        pieces = np.where(too_long, -(-doc_lengths // seq_len), 1)
        new_lengths = np.full(int(pieces.sum()), seq_len, dtype=doc_lengths.dtype)
        new_lengths[np.cumsum(pieces) - 1] = doc_lengths - (pieces - 1) * seq_len
        return tokens, labels, new_lengths, int(too_long.sum())
    if policy == "truncate":
        within = counting_from(document_starts(doc_lengths[doc_lengths > 0]), len(tokens), np.int64)
        keep, new_lengths = within < seq_len, np.minimum(doc_lengths, seq_len)
    else:  # drop
        keep, new_lengths = ~np.repeat(too_long, doc_lengths), doc_lengths[~too_long]
    return tokens[keep], labels[keep], new_lengths, int(too_long.sum())
