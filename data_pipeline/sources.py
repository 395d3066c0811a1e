"""Load the recipe's data sources into one `datasets.Dataset` of documents.

Every document gets `text` (for chat, the turns' contents joined: what deduplication compares),
`messages` (chat only, else null) and `source` (its source's index in the recipe).
"""
import json
from pathlib import Path

import datasets

from data_pipeline import DataError
from data_pipeline.config import DataSource, matching_files

# How each local suffix maps to a `datasets` builder; a .txt file is one document.
BUILDERS = {".jsonl": ("json", {}), ".json": ("json", {}), ".parquet": ("parquet", {}), ".csv": ("csv", {}),
            ".txt": ("text", {"sample_by": "document"})}
MESSAGES = datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})
FEATURES = datasets.Features({"text": datasets.Value("string"), "messages": MESSAGES, "source": datasets.Value("int32")})


def raise_on_bad_json_line(path: str) -> None:
    """Find the line the JSON reader choked on; only runs after a failed load, so big files pay nothing."""
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                try:
                    json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as error:
                    raise DataError(f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno}); "
                                    f"each line of a .jsonl file must be one JSON object") from None


def read_source(source: DataSource, streaming: bool = False) -> datasets.Dataset | datasets.IterableDataset:
    """The source as `datasets` loads it, with its own columns."""
    if source.hub:
        try:
            return datasets.load_dataset(source.hub, source.subset, split=source.split, streaming=streaming)
        except Exception as error:  # network, authentication, unknown name or split
            raise DataError(f"hub data set {source.name}: {error}") from error
    builder, options = BUILDERS[Path(source.path).suffix]
    try:
        return datasets.load_dataset(builder, data_files=source.path, split="train", streaming=streaming, **options)
    except Exception as error:  # datasets wraps pyarrow's parse errors in several exception types
        if Path(source.path).suffix == ".jsonl":
            for path in matching_files(source.path):
                raise_on_bad_json_line(path)
        raise DataError(f"{source.path}: could not be read as {builder}: {error}") from error


def document_field(source: DataSource, columns: list[str]) -> str:
    field = "text" if source.path and source.path.endswith(".txt") else source.messages_field or source.text_field
    if field not in columns:
        kind = "messages_field" if source.messages_field else "text_field"
        raise DataError(f"{source.name}: no field '{field}' (fields present: {', '.join(columns)}); set {kind} "
                        f"in the recipe's data source to one of them")
    return field


def chat_document(conversation: list | None) -> tuple[list[dict], str]:
    """A conversation's turns as {role, content}, and its text: the contents joined (what dedup compares)."""
    messages = [{"role": m.get("role"), "content": m.get("content")} for m in conversation or []]
    return messages, "\n".join(str(m["content"] or "") for m in messages)


def to_documents(batch: dict, field: str, chat: bool, index: int) -> dict:
    values = batch[field]
    if not chat:
        return {"text": values, "messages": [None] * len(values), "source": [index] * len(values)}
    messages, texts = zip(*map(chat_document, values)) if values else ((), ())
    return {"text": list(texts), "messages": list(messages), "source": [index] * len(values)}


def load_source(source: DataSource, index: int, streaming: bool = False) -> datasets.Dataset | datasets.IterableDataset:
    table = read_source(source, streaming)
    columns = list(table.column_names or table.features or [])
    field = document_field(source, columns)
    return table.map(to_documents, batched=True, remove_columns=columns, features=FEATURES,
                     fn_kwargs={"field": field, "chat": source.messages_field is not None, "index": index},
                     **({} if streaming else {"desc": f"reading {Path(source.name).name}"}))


def load_documents(sources: list[DataSource]) -> datasets.Dataset:
    """All sources, in recipe order, as one data set of documents."""
    documents = datasets.concatenate_datasets([load_source(s, i) for i, s in enumerate(sources)])
    if len(documents) == 0:
        raise DataError(f"the data sources hold no documents: {', '.join(s.name for s in sources)}")
    return documents
