"""Load the recipe's data sources into one `datasets.Dataset` of documents.

Every document gets `text` (for chat, the turns' contents joined: what deduplication compares),
`messages` (chat only, else null), `source` (its source's index in the recipe) and `score` (its source's
score_field, else NaN: the classifier filter may give it one).
"""
import math
from pathlib import Path

import datasets
import pyarrow as pa

from data_pipeline.config import DataSource, matching_files
from data_pipeline.files import check_lines
from training.base.errors import DataError

# How each local suffix maps to a `datasets` builder; a .txt file is one document.
BUILDERS = {".jsonl": ("json", {}), ".json": ("json", {}), ".parquet": ("parquet", {}), ".csv": ("csv", {}),
            ".txt": ("text", {"sample_by": "document"})}
MESSAGES = datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})
FEATURES = datasets.Features({"text": datasets.Value("string"), "messages": MESSAGES,
                              "source": datasets.Value("int32"), "score": datasets.Value("float32")})
NO_SCORE = math.nan


def read_source(source: DataSource, streaming: bool = False) -> datasets.Dataset | datasets.IterableDataset:
    """The source as `datasets` loads it, with its own columns."""
    if source.hub:
        try:
            return datasets.load_dataset(source.hub, source.subset, split=source.split, streaming=streaming)
        except Exception as error:  # network, authentication, unknown name or split
            raise DataError(f"hub data set {source.name}: {error}") from error
    files = matching_files(source.path)  # not all empty: the recipe's schema refuses such a source
    builder, options = BUILDERS[Path(source.path).suffix]
    try:
        return datasets.load_dataset(builder, data_files=source.path, split="train", streaming=streaming, **options)
    except Exception as error:  # datasets wraps pyarrow's parse errors in several exception types
        for path in files:
            check_lines(path, *source_field(source))
        raise DataError(f"{source.path}: could not be read as {builder}: {error}") from error


def source_field(source: DataSource) -> tuple[str, bool]:
    """The field that holds the source's documents, and whether they are conversations."""
    if source.path and source.path.endswith(".txt"):
        return "text", False
    return source.messages_field or source.text_field, source.messages_field is not None


def document_field(source: DataSource, columns: list[str]) -> str:
    field, chat = source_field(source)
    if field not in columns:
        kind = "messages_field" if chat else "text_field"
        raise DataError(f"{source.name}: no field '{field}' (fields present: {', '.join(columns)}); set {kind} "
                        f"in the recipe's data source to one of them")
    return field


def holds_documents(feature, chat: bool) -> bool:
    """A column of text (null: all empty) or, for chat, of lists of turns."""
    if chat:
        return isinstance(feature, (datasets.List, datasets.LargeList)) and isinstance(feature.feature, dict)
    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "null")


def check_column(table: datasets.Dataset, source: DataSource, field: str) -> None:
    """The field holds the recipe's kind of documents in valid UTF-8 (pyarrow reads JSON strings without checking it,
    and `datasets` turns a field of mixed types into JSON text), checked over the column in C++; the file and line at
    fault are looked for only when the check fails."""
    chat = source_field(source)[1]
    fits = holds_documents(table.features[field], chat)
    try:
        table.data.column(field).validate(full=True)
    except pa.ArrowInvalid:
        fits = False
    if fits:
        return
    for path in matching_files(source.path) if source.path else []:
        check_lines(path, field, chat)
    raise DataError(f"{source.name}: field '{field}' holds {table.features[field]} values, not "
                    f"{'conversations' if chat else 'text'} in UTF-8; fix the data, or set "
                    f"{'messages' if chat else 'text'}_field to the field that holds the documents")


def chat_document(conversation: list | None) -> tuple[list[dict], str]:
    """A conversation's turns as {role, content}, and its text: the contents joined (what dedup compares)."""
    messages = [{"role": m.get("role"), "content": m.get("content")} for m in conversation or []]
    return messages, "\n".join(str(m["content"] or "") for m in messages)


def to_documents(values: list, *scores: list, chat: bool, index: int) -> dict:
    """One column's values as documents, with the score field's values when the source has one (only those columns
    are decoded: another may hold anything)."""
    kept = {"source": [index] * len(values), "score": scores[0] if scores else [NO_SCORE] * len(values)}
    if not chat:
        return {"text": values, "messages": [None] * len(values), **kept}
    messages, texts = zip(*map(chat_document, values)) if values else ((), ())
    return {"text": list(texts), "messages": list(messages), **kept}


def check_score_field(table: datasets.Dataset, source: DataSource, columns: list[str]) -> None:
    """The source's score_field is a numeric field that every record has."""
    field = source.score_field
    if field not in columns:
        raise DataError(f"{source.name}: no field '{field}' (fields present: {', '.join(columns)}); set score_field "
                        f"in the recipe's data source to the numeric field that scores its documents")
    feature = table.features[field]
    if not (isinstance(feature, datasets.Value) and feature.dtype.startswith(("int", "uint", "float"))):
        kind = feature.dtype if isinstance(feature, datasets.Value) else type(feature).__name__
        raise DataError(f"{source.name}: score_field '{field}' holds {kind} values, not numbers; name a numeric "
                        f"field")
    if missing := table.data.column(field).null_count:
        raise DataError(f"{source.name}: score_field '{field}' is missing in {missing} of {len(table)} records; every "
                        f"document needs a score (fill them, or drop those records)")


def load_source(source: DataSource, index: int, streaming: bool = False) -> datasets.Dataset | datasets.IterableDataset:
    table = read_source(source, streaming)
    columns = list(table.column_names or table.features or [])
    field = document_field(source, columns)
    if not streaming:
        check_column(table, source, field)
        if source.score_field:
            check_score_field(table, source, columns)
    inputs = [field, source.score_field] if source.score_field else [field]
    return table.map(to_documents, batched=True, input_columns=inputs, remove_columns=columns, features=FEATURES,
                     fn_kwargs={"chat": source_field(source)[1], "index": index},
                     **({} if streaming else {"desc": f"reading {Path(source.name).name}"}))


def load_documents(sources: list[DataSource]) -> datasets.Dataset:
    """All sources, in recipe order, as one data set of documents."""
    documents = datasets.concatenate_datasets([load_source(s, i) for i, s in enumerate(sources)])
    if len(documents) == 0:
        raise DataError(f"the data sources hold no documents: {', '.join(s.name for s in sources)}")
    return documents
