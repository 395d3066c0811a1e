"""Streaming: read, tokenize and pack on the fly, for data that does not fit on disk.

Each rank reads its own share of the sources (`datasets` streaming, split by rank), tokenizes one
document at a time and packs with `concat` into exactly the rows its micro-batches need, carrying the
unfinished tail into the next batch. Nothing is written to disk and memory stays bounded.

Quality filters (`data.filters`) judge each rank's documents as they are read; a stream writes no stats.json, so
what they removed is not counted (prepare the sources to see it). Limits, all checked by the recipe schema: `concat`
packing only (best-fit needs the whole data set);
no deduplication and no evaluation split (both need every document; deduplicate offline with
`python -m data_pipeline dedup`); source weights act as sampling probabilities (weights / sum) rather
than rates; the run length is `training.max_steps` (the number of rows is unknown in advance). Resume
restores the position after the last document used, plus the carried tail: exact without shuffling
(`shuffle_buffer: 0`), and with shuffling the documents in the shuffle buffer at the checkpoint are
skipped, as `datasets` documents for IterableDataset.state_dict.
"""
from functools import partial

import datasets
import numpy as np
import torch
from datasets.distributed import split_dataset_by_node
from transformers import PreTrainedTokenizerBase

from data_pipeline.config import DataConfig
from data_pipeline.pack import pack_concat
from data_pipeline.sources import load_source
from data_pipeline.tokenize import encode_batch
from training.base.errors import DataError


def stream_documents(config: DataConfig, tokenizer: PreTrainedTokenizerBase, dp_rank: int, dp_size: int,
                     seed: int) -> datasets.IterableDataset:
    """This rank's share of the mixed sources, as one iterable of documents, without those the quality filters
    remove."""
    streams = [load_source(source, index, streaming=True) for index, source in enumerate(config.sources)]
    if len(streams) > 1:
        total = sum(s.weight for s in config.sources)
        documents = datasets.interleave_datasets(streams, probabilities=[s.weight / total for s in config.sources],
                                                 seed=seed, stopping_strategy="all_exhausted")
    else:
        documents = streams[0]
    if config.shuffle_buffer:
        documents = documents.shuffle(seed=seed, buffer_size=config.shuffle_buffer)
    documents = split_dataset_by_node(documents, rank=dp_rank, world_size=dp_size)
    if config.filters:  # imports datatrove and spaCy: only for recipes that filter
        from data_pipeline.filters import FilterChain, check_models, kept_documents
        check_models([(f.type, f.parameters) for f in config.filters])
        chain = FilterChain([(f.type, f.parameters) for f in config.filters], tokenizer)
        documents = documents.map(partial(kept_documents, chain), batched=True, batch_size=256)
    return documents


class StreamingBatches:
    """The same interface as StepBatches (micro_batches(step), state_dict, load_state_dict), read
    sequentially: step s must follow step s - 1."""

    steps_per_epoch = None

    def __init__(self, config: DataConfig, tokenizer: PreTrainedTokenizerBase, micro_batch_size: int,
                 accumulation_steps: int, dp_rank: int, dp_size: int, seed: int):
        self.config, self.tokenizer = config, tokenizer
        self.micro_batch_size, self.accumulation_steps = micro_batch_size, accumulation_steps
        self.documents = stream_documents(config, tokenizer, dp_rank, dp_size, seed)
        self.epoch, self.iterator = 0, None
        self.carry = (np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64))  # tokens, labels, lengths

    def next_document(self) -> dict:
        for _ in range(2):  # at the end of an epoch, start the next one
            if self.iterator is None:
                self.documents.set_epoch(self.epoch)
                self.iterator = iter(self.documents)
            document = next(self.iterator, None)
            if document is not None:
                return document
            self.epoch, self.iterator = self.epoch + 1, None
        raise DataError("the streamed data sources hold no documents")

    def fill(self, tokens_needed: int) -> None:
        """Tokenize documents onto the carried tail until it holds tokens_needed tokens."""
        parts, held = [self.carry], len(self.carry[0])
        while held < tokens_needed:
            document = self.next_document()
            if not (document["text"] and document["text"].strip()):
                continue
            encoded = encode_batch({name: [value] for name, value in document.items()}, self.tokenizer)
            if encoded["input_ids"]:
                ids = np.asarray(encoded["input_ids"][0], dtype=np.int32)
                labels = np.asarray(encoded["labels"][0] or ids, dtype=np.int32)
                parts.append((ids, labels, np.array([len(ids)])))
                held += len(ids)
        self.carry = tuple(np.concatenate(arrays) for arrays in zip(*parts))

    def next_rows(self, count: int) -> dict[str, np.ndarray]:
        seq_len = self.config.seq_len
        used = count * seq_len
        self.fill(used)
        tokens, labels, lengths = self.carry
        head, tail = split_lengths(lengths, used)
        self.carry = (tokens[used:], labels[used:], tail)
        return pack_concat(tokens[:used], head, seq_len, labels[:used])

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        batches = []
        for _ in range(self.accumulation_steps):
            rows = self.next_rows(self.micro_batch_size)
            batches.append({name: torch.from_numpy(array.astype(np.int64)) for name, array in rows.items()})
        return batches

    def pass_over(self, count: int) -> None:
        """Read the next `count` global batches' shares of this rank and drop them."""
        for _ in range(count):
            self.micro_batches(0)

    def metrics(self, position: int) -> dict:
        """A stream's mixture is data.sources' weights throughout: no fields of its own in metrics.jsonl."""
        return {}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "documents": self.documents.state_dict(), "carry": self.carry}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.carry, self.iterator = state["epoch"], state["carry"], None
        self.documents.set_epoch(self.epoch)
        self.documents.load_state_dict(state["documents"])


def split_lengths(lengths: np.ndarray, at: int) -> tuple[np.ndarray, np.ndarray]:
    """Document lengths of the first `at` tokens and of the rest (a document cut at `at` is in both)."""
    ends = np.cumsum(lengths)
    cut = int(np.searchsorted(ends, at, side="right"))
    head = np.append(lengths[:cut], at - (ends[cut - 1] if cut else 0))
    tail = np.append(ends[cut] - at, lengths[cut + 1:]) if cut < len(lengths) else lengths[:0]
    return head[head > 0], tail[tail > 0]
