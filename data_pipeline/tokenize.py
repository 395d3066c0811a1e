"""Tokenize documents with `datasets.map`, one token list per document."""
import datasets
import numpy as np
import pyarrow as pa
from transformers import PreTrainedTokenizerBase


def tokenize_documents(documents: datasets.Dataset, tokenizer: PreTrainedTokenizerBase,
                       num_proc: int = 1) -> datasets.Dataset:
    """Each document becomes `input_ids`: the tokenizer's own special tokens (e.g. a leading BOS)
    plus an EOS at the end when the tokenizer has one and did not add it, so that the model
    learns where documents stop once they are packed together."""
    eos = tokenizer.eos_token_id

    def encode(batch: dict) -> dict:
        ids = tokenizer(batch["text"], add_special_tokens=True, verbose=False)["input_ids"]
        if eos is not None:
            ids = [seq if seq and seq[-1] == eos else seq + [eos] for seq in ids]
        return {"input_ids": ids}

    documents = documents.filter(lambda batch: [bool(t and t.strip()) for t in batch["text"]], batched=True,
                                 num_proc=num_proc, desc="dropping empty documents")
    return documents.map(encode, batched=True, num_proc=num_proc, remove_columns=documents.column_names,
                         features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))}),
                         desc="tokenizing")


def token_stream(tokenized: datasets.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """The documents' tokens laid end to end, and each document's length, without Python loops."""
    column = tokenized.data.column("input_ids").combine_chunks()
    if isinstance(column, pa.ChunkedArray):  # an empty table stays chunked
        column = pa.array([], type=pa.list_(pa.int32()))
    return column.flatten().to_numpy(), column.value_lengths().to_numpy()
