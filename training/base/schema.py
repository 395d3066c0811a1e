"""The base of every schema section, the recipe's (training/config/recipe.py) and its data section's
(data_pipeline/config.py)."""
from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A schema section in which a misspelt key is an error, not a silently ignored default, and a number is finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # .inf or .nan for a number is a mistake too
