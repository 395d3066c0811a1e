"""Load the recipe's local data files into one `datasets.Dataset` with a single `text` column."""
from pathlib import Path

import json

import datasets

from data_pipeline import DataError
from data_pipeline.config import DataSource


# How each supported suffix maps to a `datasets` builder; a .txt file is one document.
BUILDERS = {".jsonl": ("json", {}), ".json": ("json", {}), ".parquet": ("parquet", {}), ".csv": ("csv", {}),
            ".txt": ("text", {"sample_by": "document"})}


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


def load_source(source: DataSource) -> datasets.Dataset:
    builder, options = BUILDERS[Path(source.path).suffix]
    try:
        table = datasets.load_dataset(builder, data_files=source.path, split="train", **options)
    except Exception as error:  # datasets wraps pyarrow's parse errors in several exception types
        if Path(source.path).suffix == ".jsonl":
            raise_on_bad_json_line(source.path)
        raise DataError(f"{source.path}: could not be read as {builder}: {error}") from error
    field = "text" if builder == "text" else source.text_field
    if field not in table.column_names:
        raise DataError(f"{source.path}: no field '{field}' (fields present: {', '.join(table.column_names)}); "
                        f"set text_field in the recipe's data source to one of them")
    table = table.select_columns([field])
    return table.rename_column(field, "text") if field != "text" else table


def load_documents(sources: list[DataSource]) -> datasets.Dataset:
    """All sources, in recipe order, as one data set of documents."""
    documents = datasets.concatenate_datasets([load_source(s) for s in sources])
    if len(documents) == 0:
        raise DataError(f"the data sources hold no documents: {', '.join(s.path for s in sources)}")
    return documents
