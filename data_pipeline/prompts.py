"""Prompts (training.objective=grpo): read from TRL's prompt-only form, tokenized as TRL 1.16's GRPOTrainer does, and
fitted to the budget that leaves room for the completions.

A source's row holds `prompt` (data source `prompt_field`): a string, or chat messages. Its other fields (an answer, a
solution, test cases) go with it to the reward functions, as TRL passes them. A string prompt is tokenized with the
tokenizer's special tokens, chat messages through the chat template with the generation prompt. A prompt and its
longest completion (grpo.max_completion_length) must fit data.seq_len: a longer prompt is an error that names the
source and row, or, with data.long_documents=drop, dropped and counted.
"""
import json

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from data_pipeline import processes
from data_pipeline.config import DataConfig, DataSource
from data_pipeline.preference import field_text, is_conversation
from data_pipeline.sources import read_source
from training.base.errors import DataError

PROMPT_DOCUMENTS = datasets.Features({"text": datasets.Value("string"), "prompt": datasets.Value("string"),
                                      "fields": datasets.Value("string"), "source": datasets.Value("int32"),
                                      "row": datasets.Value("int64")})
TOKENIZED_PROMPTS = datasets.Features({"prompt_ids": datasets.List(datasets.Value("int32")),
                                       "prompt": datasets.Value("string"), "fields": datasets.Value("string"),
                                       "source": datasets.Value("int32")})


def prompt_documents(columns: dict, source: DataSource, index: int, first_row: int) -> dict:
    """One batch of a source's rows as prompt documents; a DataError names the source, row and field at fault."""
    out = {name: [] for name in PROMPT_DOCUMENTS}
    others = [name for name in columns if name != source.prompt_field]
    for offset, prompt in enumerate(columns[source.prompt_field]):
        if not (isinstance(prompt, str) or is_conversation(prompt)) or not prompt:
            raise DataError(f"{source.name}: row {first_row + offset + 1}: field '{source.prompt_field}' holds "
                            f"{type(prompt).__name__} {str(prompt)[:60]!r}, not a non-empty string or list of "
                            f"{{role, content}} messages")
        out["text"].append(field_text(prompt))
        out["prompt"].append(json.dumps(prompt))
        out["fields"].append(json.dumps({name: columns[name][offset] for name in others}, default=str))
        out["source"].append(index)
        out["row"].append(first_row + offset + 1)
    return out


def load_prompts(sources: list[DataSource]) -> datasets.Dataset:
    """All sources' prompts, in recipe order, as one data set of prompt documents."""
    loaded = []
    for index, source in enumerate(sources):
        table = read_source(source)
        if source.prompt_field not in table.column_names:
            raise DataError(f"{source.name}: no field '{source.prompt_field}' (fields present: "
                            f"{', '.join(table.column_names)}); set prompt_field in the recipe's data source")
        fields = table.column_names
        loaded.append(table.map(lambda *values: prompt_documents(dict(zip(fields, values[:-1])), source, index,
                                                                 values[-1][0]),  # the batch's row indices last
                                batched=True, with_indices=True, input_columns=fields, remove_columns=fields,
                                features=PROMPT_DOCUMENTS, desc=f"reading prompts of {source.name}"))
    prompts = datasets.concatenate_datasets(loaded)
    if len(prompts) == 0:
        raise DataError(f"the data sources hold no prompts: {', '.join(s.name for s in sources)}")
    return prompts


def tokenize_prompt(prompt, tokenizer: PreTrainedTokenizerBase, template_kwargs: dict) -> list[int]:
    """A string with the tokenizer's special tokens; chat messages through its chat template with the generation
    prompt and `template_kwargs` (grpo.chat_template_kwargs: e.g. Qwen3's enable_thinking), as TRL tokenizes them."""
    if is_conversation(prompt):
        return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False, **template_kwargs))
    return tokenizer(prompt, verbose=False)["input_ids"]


def tokenize_batch(batch: dict, tokenizer: PreTrainedTokenizerBase, budget: int, template_kwargs: dict) -> dict:
    """Tokenized prompts, None where a prompt is over `budget` tokens (`row` kept to name it)."""
    out = {name: [] for name in (*TOKENIZED_PROMPTS, "row")}
    for prompt, fields, source, row in zip(batch["prompt"], batch["fields"], batch["source"], batch["row"]):
        ids = tokenize_prompt(json.loads(prompt), tokenizer, template_kwargs)
        out["prompt_ids"].append(ids if len(ids) <= budget else None)
        out["row"].append(row if len(ids) <= budget else -len(ids))  # over budget: its length, to name it
        for name, value in (("prompt", prompt), ("fields", fields), ("source", source)):
            out[name].append(value)
    return out


def tokenize_prompts(documents: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, config: DataConfig,
                     sources: list[DataSource], stats: dict) -> datasets.Dataset:
    """Tokenize; a prompt over seq_len - max_completion_length tokens is an error naming it, or dropped and counted
    (long_documents_dropped) under data.long_documents=drop."""
    seq_len, max_completion_length, policy = config.seq_len, config.completion_tokens, config.long_documents
    budget = seq_len - max_completion_length
    tokenized = documents.map(tokenize_batch, batched=True, num_proc=processes(config.num_proc),
                              remove_columns=documents.column_names,
                              features=datasets.Features({**TOKENIZED_PROMPTS, "row": datasets.Value("int64")}),
                              fn_kwargs={"tokenizer": tokenizer, "budget": budget,
                                         "template_kwargs": config.chat_template_kwargs}, desc="tokenizing prompts")
    rows = np.asarray(tokenized["row"])
    over = np.flatnonzero(rows < 0)
    if len(over) and policy != "drop":
        first = documents[int(over[0])]
        raise DataError(f"{sources[first['source']].name}: row {first['row']}: the prompt is {-rows[over[0]]} tokens, "
                        f"over the {budget} that data.seq_len={seq_len} leaves beside grpo.max_completion_length="
                        f"{max_completion_length} ({len(over)} prompt(s) are over); raise data.seq_len, lower "
                        f"max_completion_length, or set data.long_documents=drop to drop such prompts")
    stats["long_documents_dropped"] = len(over)
    kept = tokenized.select(np.flatnonzero(rows >= 0)) if len(over) else tokenized
    return kept.remove_columns("row").flatten_indices()


def prompt_stats(prompts: datasets.Dataset) -> dict:
    lengths = prompts.data.table.column("prompt_ids").combine_chunks().value_lengths().to_numpy()
    return {"documents_out": len(prompts), "prompts": len(prompts), "prompt_tokens": int(lengths.sum()),
            "longest_prompt": int(lengths.max())}
