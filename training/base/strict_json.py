"""JSON that every reader parses. Python's json writes a non-finite float as a bare NaN, Infinity or -Infinity,
which is not JSON: jq, JavaScript's JSON.parse and most other languages' parsers refuse the whole line. Every file
the commands write goes through `dumps`, which writes such a number as text, "nan", "inf" or "-inf"
(docs/outputs.md), and `number` reads it back.
"""
import json
import math
from typing import Any

NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def finite_or_text(value: Any) -> Any:
    """`value` with every non-finite float in it (nested in lists, tuples and dicts too) as its text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {key: finite_or_text(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_text(item) for item in value]
    return value


def dumps(value: Any, **options) -> str:
    """json.dumps of `value`, strict: non-finite numbers as text (a float that slips past is an error, not a line
    that readers refuse)."""
    return json.dumps(finite_or_text(value), allow_nan=False, **options)


def number(value: float | str | None) -> float | None:
    """A number that `dumps` wrote: the float back from its text form ("nan", "inf", "-inf")."""
    return NON_FINITE[value] if isinstance(value, str) else value
