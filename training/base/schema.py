"""The base of every schema section, the recipe's (training/config/recipe.py, the objectives' sections in their
folders' spec.py) and its data section's (data_pipeline/config.py), and the types they share."""
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo


class StrictModel(BaseModel):
    """A schema section in which a misspelt key is an error, not a silently ignored default, and a number is finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # .inf or .nan for a number is a mistake too


def local_path_or_hub_id(value: str, info: ValidationInfo) -> str:
    """A folder that exists relative to the recipe (or absolute), or a value written as a path (starting
    with `.`, `/` or `~`), becomes an absolute path; anything else is kept as written, as a Hugging Face
    hub id such as `meta-llama/Llama-2-7b-hf`."""
    base_dir = Path((info.context or {}).get("base_dir", "."))
    candidate = (base_dir / Path(value).expanduser())
    written_as_path = value.startswith((".", "/", "~"))  # a missing one is reported by the checks before a run
    return str(candidate.resolve()) if candidate.exists() or written_as_path else value


HubIdOrPath = Annotated[str, AfterValidator(local_path_or_hub_id)]
