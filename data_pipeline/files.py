"""Local data files read line by line, to name the file and the line at fault: not UTF-8, not JSON, not a JSON
object, or a document field of the wrong type; and files with nothing in them.

The in-process engine lets `datasets` read the files and reads the lines here only when a load fails or a
column is not what the recipe needs, so good data pays nothing (sources.py). The datatrove engine reads every
line here before its job starts, because datatrove's reader skips a line that does not parse with a warning
and stops reading a file at its first byte that is not UTF-8 (scale.check_sources).
"""
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from training.base.errors import DataError

TEXT_SUFFIXES = (".jsonl", ".json", ".csv", ".txt")  # files of UTF-8 lines


def utf8_line(raw: bytes, path: str, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}:{number}: not UTF-8 ({error.reason} at byte {error.start} of the line); convert the "
                        f"file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def strict_json(raw: bytes, path: str, number: int) -> Any:
    """The line's JSON value, or a DataError naming the line's fault."""
    try:
        return json.loads(utf8_line(raw, path, number).rstrip("\r\n"))  # so the column counts in this line
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno}); each line of a "
                        f".jsonl file must be one JSON object") from None


def json_lines(path: str, loads: Callable[[bytes], Any] = json.loads) -> Iterator[tuple[int, bytes, Any]]:
    """(number, line, value) of each non-blank line of a JSON-lines file; a DataError names the first line that is
    not UTF-8 or not JSON. `loads` parses a line's bytes: json.loads, or a faster parser such as orjson.loads
    (a line it refuses is judged again by the standard library)."""
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                value = loads(raw)
            except ValueError:  # not JSON, not UTF-8 (UnicodeDecodeError), or blank
                if not raw.strip():
                    continue
                value = strict_json(raw, path, number)
            yield number, raw, value


def describe(value: Any) -> str:
    shown = json.dumps(value, ensure_ascii=False)
    return f"a JSON {type(value).__name__} ({shown if len(shown) <= 40 else shown[:37] + '...'})"


def field_problem(value: Any, field: str, chat: bool, setting: str = "") -> str | None:
    """Why a record's field cannot be a document; None when it can (text, a conversation, or null: empty).
    `setting` names where the field is chosen (default: the recipe source's text_field or messages_field)."""
    setting = setting or ("messages_field" if chat else "text_field")
    if value is None:
        return None
    if chat and not (isinstance(value, list) and all(isinstance(turn, dict) for turn in value)):
        return (f"field '{field}' is {describe(value)}, not a list of {{\"role\": ..., \"content\": ...}} objects; fix "
                f"the line, or set {setting} to the field that holds the conversation")
    if not chat and not isinstance(value, str):
        return (f"field '{field}' is {describe(value)}, not a string; a document's text must be a JSON string: fix "
                f"the line, or set {setting} to the field that holds the text")
    return None


def record_problem(record: Any, field: str, chat: bool, setting: str = "") -> str | None:
    """Why a JSON line cannot be a document: not an object, or its field of the wrong type."""
    if not isinstance(record, dict):
        return (f"a JSON {type(record).__name__}, not an object; each line must be an object such as "
                f"{{\"{field}\": \"...\"}}")
    return field_problem(record.get(field), field, chat, setting)


def is_json_lines(path: str) -> bool:
    """A .jsonl file, or a .json file that is not one JSON array (`datasets` reads both)."""
    return path.endswith(".jsonl") or (path.endswith(".json") and first_content(path) != b"[")


def first_content(path: str) -> bytes:
    """The file's first byte that is not whitespace; b"" when it holds nothing else."""
    with open(path, "rb") as file:
        while chunk := file.read(1 << 16):
            if content := chunk.lstrip():
                return content[:1]
    return b""


def emptiness(path: str) -> str | None:
    """How a data file is empty ("0 bytes", "only whitespace"), or None when it holds something."""
    if os.path.getsize(path) == 0:
        return "0 bytes"
    return "only whitespace" if path.endswith(TEXT_SUFFIXES) and not first_content(path) else None


def check_lines(path: str, field: str, chat: bool, loads: Callable[[bytes], Any] = json.loads) -> None:
    """Read a local data file for its first fault, named with its line: a line that is not UTF-8; in JSON lines one
    that is not a JSON object or whose field is of the wrong type; in a JSON array, the place it stops parsing; in
    Parquet, a field of the wrong type."""
    if path.endswith(".parquet"):
        check_parquet_field(path, field, chat)
    elif is_json_lines(path):
        for number, _, record in json_lines(path, loads):
            if problem := record_problem(record, field, chat):
                raise DataError(f"{path}:{number}: {problem}")
    elif path.endswith(TEXT_SUFFIXES):
        check_utf8(path)
        if path.endswith(".json"):  # one JSON array
            try:
                json.loads(Path(path).read_text(encoding="utf-8"))
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{error.lineno}: not valid JSON ({error.msg} at column {error.colno}); fix "
                                f"it, or write the file as JSON lines") from None


def check_utf8(path: str) -> None:
    """A DataError naming the file's first line that is not UTF-8."""
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            utf8_line(raw, path, number)


def check_parquet_field(path: str, field: str, chat: bool) -> None:
    """A Parquet file's field is a column of text (or of lists, for chat), from its schema alone."""
    import pyarrow as pa  # here, not at the top: `python -m data_pipeline dedup` reads no Parquet file
    import pyarrow.parquet as pq
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowInvalid) as error:
        raise DataError(f"{path}: not a readable Parquet file ({error}); write it again") from None
    if field not in schema.names:
        return  # the recipe's check of the fields names it with the fields present
    kind = str(schema.field(field).type)
    if kind == "null" or (kind.startswith(("list", "large_list")) if chat else
                          kind in ("string", "large_string", "string_view")):
        return
    wanted = "lists of {role, content} objects" if chat else "strings"
    raise DataError(f"{path}: column '{field}' holds {kind} values, not {wanted}; write the documents' "
                    f"{'conversations' if chat else 'text'} there, or set {'messages' if chat else 'text'}_field "
                    f"to the column that holds them")
