"""The recipe's validation errors as lines that name the key and the fix (training/config/recipe.py, validate)."""
import difflib
import typing
from typing import Any

from pydantic import BaseModel


def _model_at(loc: tuple, schema: type[BaseModel]) -> type[BaseModel] | None:
    """The schema section that the (parent) location of a pydantic error points into."""
    model = schema
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        model = _first_model(field.annotation) if field else None
        if model is None:
            return None
    return model


def _first_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, (_first_model(arg) for arg in typing.get_args(annotation))), None)


def describe_error(error: dict, schema: type[BaseModel]) -> str:
    """One line for one of pydantic's errors over `schema`: where, what, and the fix (a TRL name's place here, the
    closest known key)."""
    loc = tuple(part for part in error["loc"] if not isinstance(part, str) or not part.startswith("function-"))
    where = ".".join(str(part) for part in loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        section = _model_at(loc[:-1], schema)
        if here := getattr(section, "trl_names", {}).get(loc[-1]):
            return f"{where}: TRL's name, not this schema's: {here}"
        known = list(section.model_fields) if section else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"{where}: unknown key; {hint}valid keys here: {', '.join(known)}"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] not in ("missing", "value_error"):
        message += f" (got {error['input']!r})"
    return f"{where}: {message}"
