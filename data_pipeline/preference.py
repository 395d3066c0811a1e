"""Preference pairs (training.objective=dpo): read, tokenize as TRL's DPOTrainer does, fit to seq_len, and pack the
pairs of a micro-batch into rows.

A source holds TRL's standard preference form: `prompt`, `chosen` and `rejected`, each a string or a list of chat
messages (or, without a prompt, conversational chosen/rejected whose shared first messages are the prompt: TRL's
implicit prompt). A pair is read into one document: `text` (every field's text joined, which deduplication and
decontamination compare) and the three fields as JSON.

Tokenized as TRL 1.16's DPOTrainer: a string prompt with the tokenizer's special tokens and each completion followed
by EOS; messages through the chat template (the prompt with the generation prompt). The completion starts where the
tokenized prompt and prompt+completion first differ. A prepared pair keeps `chosen_ids` and `rejected_ids` (each the
whole sequence, prompt included) and `prompt_length`: the loss is taken on the tokens after it only.
"""
import json
import sys

import datasets
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from data_pipeline import processes
from data_pipeline.config import DataSource, matching_files
from data_pipeline.files import TEXT_SUFFIXES, check_utf8
from data_pipeline.pack import IGNORE_INDEX, best_fit_decreasing, place_documents
from data_pipeline.sources import read_source
from training.base.errors import DataError

PAIR_DOCUMENTS = datasets.Features({"text": datasets.Value("string"), "prompt": datasets.Value("string"),
                                    "chosen": datasets.Value("string"), "rejected": datasets.Value("string"),
                                    "source": datasets.Value("int32")})
TOKENIZED_PAIRS = datasets.Features({"chosen_ids": datasets.List(datasets.Value("int32")),
                                     "rejected_ids": datasets.List(datasets.Value("int32")),
                                     "prompt_length": datasets.Value("int32"), "source": datasets.Value("int32")})


def is_conversation(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def field_text(value) -> str:
    return "\n".join(str(m["content"] or "") for m in value) if isinstance(value, list) else value


def implicit_prompt(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """The shared first messages of two conversations as the prompt, and what follows them in each."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def pair_documents(columns: dict, source: DataSource, index: int, first_row: int) -> dict:
    """One batch of a source's rows as pair documents; a DataError names the source, row and field at fault."""
    out = {name: [] for name in PAIR_DOCUMENTS}
    for offset, (chosen, rejected) in enumerate(zip(columns[source.chosen_field], columns[source.rejected_field])):
        prompt = columns[source.prompt_field][offset] if source.prompt_field in columns else None
        where = f"{source.name}: row {first_row + offset + 1}"
        for name, value in ((source.chosen_field, chosen), (source.rejected_field, rejected)):
            if not (isinstance(value, str) or is_conversation(value)) or not value:
                raise DataError(f"{where}: field '{name}' holds {type(value).__name__} {str(value)[:60]!r}, not a "
                                f"non-empty string or list of {{role, content}} messages")
        if is_conversation(chosen) != is_conversation(rejected):
            raise DataError(f"{where}: one of '{source.chosen_field}' and '{source.rejected_field}' is a string, the "
                            f"other chat messages; give both in the same form")
        if is_conversation(chosen) and not is_conversation(prompt):  # TRL's implicit prompt (a string one is ignored)
            prompt, chosen, rejected = implicit_prompt(chosen, rejected)
        elif not is_conversation(chosen) and not isinstance(prompt, str):
            raise DataError(f"{where}: field '{source.prompt_field}' is {type(prompt).__name__}: a string prompt "
                            f"goes with string completions, chat messages with chat messages (set prompt_field "
                            f"in the recipe's data source if the prompt is elsewhere)")
        for name, reply in ((source.chosen_field, chosen), (source.rejected_field, rejected)):
            if not field_text(reply).strip():
                raise DataError(f"{where}: field '{name}' holds an empty reply ({json.dumps(reply)[:80]}): a "
                                "preference for or against saying nothing is a broken row, not a pair to learn from; "
                                "give the reply its text, or remove the row")
            if is_conversation(reply) and reply[-1]["role"] != "assistant":
                raise DataError(f"{where}: field '{name}' ends in a {reply[-1]['role']!r} turn, not the 'assistant' "
                                f"reply the chat template renders after the prompt (another role moves where the "
                                f"completion starts, into the turn's header); give the reply the role 'assistant'")
        fields = (prompt, chosen, rejected)
        out["text"].append("\n".join(map(field_text, fields)))
        for name, value in zip(("prompt", "chosen", "rejected"), fields):
            out[name].append(json.dumps(value))
        out["source"].append(index)
    return out


def load_pairs(sources: list[DataSource]) -> datasets.Dataset:
    """All sources' pairs, in recipe order, as one data set of pair documents."""
    loaded = []
    for index, source in enumerate(sources):
        table = read_source(source)
        missing = [f for f in (source.chosen_field, source.rejected_field) if f not in table.column_names]
        if missing:
            raise DataError(f"{source.name}: no field '{missing[0]}' (fields present: "
                            f"{', '.join(table.column_names)}); set chosen_field and rejected_field in the recipe's "
                            "data source")
        fields = [f for f in (source.prompt_field, source.chosen_field, source.rejected_field)
                  if f in table.column_names]
        try:
            loaded.append(table.map(lambda *values: pair_documents(dict(zip(fields, values[:-1])), source, index,
                                                                   values[-1][0]),  # the batch's row indices last
                                    batched=True, with_indices=True, input_columns=fields,
                                    remove_columns=table.column_names, features=PAIR_DOCUMENTS,
                                    desc=f"reading pairs of {source.name}"))
        except UnicodeDecodeError as error:  # `datasets` reads such bytes into its strings; decoding them fails here
            for path in matching_files(source.path) if source.path else []:
                if path.endswith(TEXT_SUFFIXES):
                    check_utf8(path)  # names the file and line
            raise DataError(f"{source.name}: a pair holds text that is not UTF-8 ({error.reason}); convert the source "
                            f"to UTF-8") from None
    pairs = datasets.concatenate_datasets(loaded)
    if len(pairs) == 0:
        raise DataError(f"the data sources hold no preference pairs: {', '.join(s.name for s in sources)}")
    check_pairs_differ(pairs, sources)
    return pairs


def check_pairs_differ(pairs: datasets.Dataset, sources: list[DataSource]) -> None:
    """A pair whose chosen equals its rejected has no preference to learn (its loss is log 2 whatever the model, its
    gradient zero): refused when no pair differs, counted in a warning when some do not."""
    same = sum(chosen == rejected for chosen, rejected in zip(pairs["chosen"], pairs["rejected"]))
    names = ", ".join(s.name for s in sources)
    if same == len(pairs):
        raise DataError(f"{names}: in every pair ({same}) the chosen reply equals the rejected one, so DPO has nothing "
                        f"to learn; check chosen_field and rejected_field in the recipe's data source")
    if same:
        print(f"warning: {names}: {same} of {len(pairs)} pairs have the same chosen and rejected reply; they add "
              f"nothing to learn from but still count in the loss's mean", file=sys.stderr, flush=True)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def tokenize_pair(prompt, chosen, rejected, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int], int]:
    """The chosen and rejected sequences' token ids (prompt included) and the prompt's length in tokens."""
    if is_conversation(chosen):
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
        chosen_ids = tokenizer.apply_chat_template(prompt + chosen, tokenize=True, return_dict=False)
        rejected_ids = tokenizer.apply_chat_template(prompt + rejected, tokenize=True, return_dict=False)
    else:
        eos = tokenizer.eos_token or ""
        prompt_ids = tokenizer(prompt, verbose=False)["input_ids"]
        chosen_ids, rejected_ids = (tokenizer(prompt + text + ("" if text.endswith(eos) else eos), verbose=False)
                                    ["input_ids"] for text in (chosen, rejected))
    length = min(common_prefix_length(prompt_ids, chosen_ids), common_prefix_length(prompt_ids, rejected_ids))
    return chosen_ids, rejected_ids, length


def tokenize_batch(batch: dict, tokenizer: PreTrainedTokenizerBase, seq_len: int, policy: str) -> dict:
    """Tokenized pairs; a pair with a sequence over seq_len is truncated (each sequence keeps its first seq_len
    tokens) or dropped, and one whose prompt alone fills seq_len is dropped (no completion token would be left),
    as TRL does. `too_long` marks the pairs that were over."""
    out = {name: [] for name in (*TOKENIZED_PAIRS, "too_long")}
    for prompt, chosen, rejected, source in zip(batch["prompt"], batch["chosen"], batch["rejected"], batch["source"]):
        chosen_ids, rejected_ids, prompt_length = tokenize_pair(*map(json.loads, (prompt, chosen, rejected)), tokenizer)
        too_long = max(len(chosen_ids), len(rejected_ids)) > seq_len
        if too_long and (policy == "drop" or prompt_length >= seq_len):
            out["too_long"].append(True)
            for name in TOKENIZED_PAIRS:
                out[name].append(None)
            continue
        out["chosen_ids"].append(chosen_ids[:seq_len])
        out["rejected_ids"].append(rejected_ids[:seq_len])
        out["prompt_length"].append(prompt_length)
        out["source"].append(source)
        out["too_long"].append(too_long)
    return out


def tokenize_pairs(documents: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, seq_len: int, policy: str,
                   num_proc: int, stats: dict) -> datasets.Dataset:
    """Tokenize and fit to seq_len; counts the pairs that were too long in stats (long_documents_truncated or
    long_documents_dropped)."""
    tokenized = documents.map(tokenize_batch, batched=True, num_proc=processes(num_proc),
                              remove_columns=documents.column_names,
                              features=datasets.Features({**TOKENIZED_PAIRS, "too_long": datasets.Value("bool")}),
                              fn_kwargs={"tokenizer": tokenizer, "seq_len": seq_len, "policy": policy},
                              desc="tokenizing pairs")
    too_long = np.asarray(tokenized["too_long"])
    kept = tokenized.filter(lambda ids: [i is not None for i in ids], input_columns="chosen_ids", batched=True
                            ).flatten_indices()
    stats["long_documents_truncated"] = int(too_long.sum()) - (len(tokenized) - len(kept))
    stats["long_documents_dropped"] = len(tokenized) - len(kept)
    return kept.remove_columns("too_long")


def pair_stats(pairs: datasets.Dataset) -> dict:
    """What a prepared pair split holds: pairs and tokens (those the loss is taken on apart)."""
    table = pairs.data.table
    lengths = [table.column(name).combine_chunks().value_lengths().to_numpy()
               for name in ("chosen_ids", "rejected_ids")]
    prompts = table.column("prompt_length").to_numpy()
    tokens = int(sum(length.sum() for length in lengths))
    return {"documents_out": len(pairs), "pairs": len(pairs), "tokens_out": tokens,
            "completion_tokens": tokens - 2 * int(prompts.sum())}


def pack_pairs(chosen: list[np.ndarray], rejected: list[np.ndarray], prompt_lengths: np.ndarray, seq_len: int,
               pad_id: int, packing: str) -> dict[str, torch.Tensor]:
    """One micro-batch's pairs packed into rows of seq_len: best-fit decreasing (bfd) or one sequence per row (none).

    Sequence 2p is pair p's chosen, 2p + 1 its rejected; each keeps its own positions (restarting at 0), so no token
    attends to another sequence. Besides the usual row columns, `sequence_index` gives every token's sequence (-1 for
    padding) and `pairs` their count."""
    sequences = [s for pair in zip(chosen, rejected) for s in pair]
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    tokens = np.concatenate(sequences).astype(np.int32)
    labels = tokens.copy()
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for start, prompt in zip(starts, np.repeat(prompt_lengths, 2)):
        labels[start:start + prompt] = IGNORE_INDEX
    if packing == "bfd":
        bins, offsets = best_fit_decreasing(lengths, seq_len)
    else:
        bins, offsets = np.arange(len(lengths)), np.zeros(len(lengths), dtype=np.int64)
    rows = place_documents(tokens, labels, lengths, bins, offsets, seq_len, pad_id)
    owner = np.full(rows["input_ids"].size, -1, dtype=np.int64)
    for sequence, (slot, length) in enumerate(zip((bins * seq_len + offsets).tolist(), lengths.tolist())):
        owner[slot:slot + length] = sequence
    batch = {name: torch.from_numpy(array.astype(np.int64)) for name, array in rows.items()}
    batch["sequence_index"] = torch.from_numpy(owner.reshape(rows["input_ids"].shape))
    batch["pairs"] = len(chosen)
    return batch
