"""The recipe's `data:` section: a typed schema, validated once, unknown keys rejected."""
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PositiveInt, ValidationInfo

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt")


class StrictModel(BaseModel):
    """A schema section in which a misspelt key is an error, not a silently ignored default."""

    model_config = ConfigDict(extra="forbid")


def resolve_path(value: str, info: ValidationInfo) -> str:
    """Make a path absolute. Relative paths count from `base_dir` in the validation context: the
    recipe file's folder for values written in the recipe, the current folder for command-line overrides."""
    path = Path(value).expanduser()
    base_dir = (info.context or {}).get("base_dir")
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return str(path.resolve())


def existing_data_file(value: str) -> str:
    if not Path(value).is_file():
        raise ValueError(f"file not found: {value}")
    if Path(value).suffix not in SUPPORTED_SUFFIXES:
        raise ValueError(f"{value}: unsupported file type; use one of {', '.join(SUPPORTED_SUFFIXES)}")
    return value


LocalPath = Annotated[str, AfterValidator(resolve_path)]


class DataSource(StrictModel):
    path: Annotated[LocalPath, AfterValidator(existing_data_file)]
    text_field: str = "text"


class DataConfig(StrictModel):
    sources: list[DataSource] = Field(min_length=1)
    seq_len: PositiveInt
    packing: Literal["concat"] = "concat"
    num_proc: PositiveInt = 1
    cache_dir: LocalPath = Field("~/.cache/deepspeed-recipes/data", validate_default=True)
