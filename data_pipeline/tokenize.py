"""Tokenize documents with `datasets.map`: token ids and labels per document."""
import datasets
import numpy as np
import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from data_pipeline import processes
from data_pipeline.chat import render_chat

TOKENIZED = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                               "labels": datasets.List(datasets.Value("int32")), "source": datasets.Value("int32"),
                               "score": datasets.Value("float32")})


def encode_batch(batch: dict, tokenizer: PreTrainedTokenizerBase) -> dict:
    """Text: the tokenizer's own special tokens (e.g. a leading BOS) plus an EOS at the end when the
    tokenizer has one and did not add it, so the model learns where documents stop once packed; labels
    are the tokens themselves, stored as an empty list. Chat: the template's rendering, labels -100
    except on the assistant replies; a conversation with no assistant reply is left out."""
    eos = tokenizer.eos_token_id
    out = {"input_ids": [], "labels": [], "source": [], "score": []}
    texts = [t for t, m in zip(batch["text"], batch["messages"]) if m is None]
    encoded = iter(tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"] if texts else [])
    for messages, source, score in zip(batch["messages"], batch["source"], batch["score"]):
        if messages is None:
            ids = next(encoded)
            ids = ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids
            labels = []
        else:
            rendered = render_chat(messages, tokenizer)
            if rendered is None:
                continue
            ids, labels = rendered
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["source"].append(source)
        out["score"].append(score)
    return out


def tokenize_documents(documents: datasets.Dataset, tokenizer: PreTrainedTokenizerBase,
                       num_proc: int = 1) -> datasets.Dataset:
    return documents.map(encode_batch, batched=True, num_proc=processes(num_proc),
                         remove_columns=documents.column_names, features=TOKENIZED,
                         fn_kwargs={"tokenizer": tokenizer}, desc="tokenizing")


def token_stream(tokenized: datasets.Dataset,
                 rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The documents' tokens and labels laid end to end, and each document's length, without Python
    loops; `rows` picks (and may repeat) documents. Without a `labels` column, every token is a label."""
    table = tokenized.data.table if rows is None else tokenized.data.table.take(pa.array(rows))
    ids = table.column("input_ids").combine_chunks()
    if isinstance(ids, pa.ChunkedArray):  # an empty table stays chunked
        ids = pa.array([], type=pa.list_(pa.int32()))
    tokens, lengths = ids.flatten().to_numpy(), ids.value_lengths().to_numpy()
    if "labels" not in table.column_names:
        return tokens, tokens, lengths
    labels = table.column("labels").combine_chunks()
    has_labels = labels.value_lengths().to_numpy() > 0  # chat documents; text documents learn every token
    if not has_labels.any():
        return tokens, tokens, lengths
    all_labels = tokens.copy()
    all_labels[np.repeat(has_labels, lengths)] = labels.flatten().to_numpy()
    return tokens, all_labels, lengths
