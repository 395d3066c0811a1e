"""run_state.json: what a checkpoint records besides DeepSpeed's states. Where the run is (step, tokens, data
position, the objective's own state) and what wrote it: the layout its states belong to (training/planning/layout.py,
its fields at the top level of the file) and, for a fine-tune, the base model. One schema for writing and reading, so
that a damaged or hand-edited file is named with its fault instead of failing later, and a key the writer misspells is
an error there instead of a key no reader looks at.
"""
from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt, ValidationError

from training.base.strict_json import dumps
from training.planning.layout import Layout


class BaseModelIdentity(BaseModel):
    """The checkpoint a fine-tune started from (model.name_or_path): a LoRA checkpoint holds only the adapters, so a
    resume must find the same base weights there."""
    model_config = ConfigDict(strict=True)
    name_or_path: str
    digest: str | None  # training.models.model.weights_digest; None where the weights were not on this machine


class RunState(Layout):
    model_config = ConfigDict(strict=True, frozen=False, extra="ignore")
    step: NonNegativeInt
    tokens_seen: NonNegativeInt
    data_position: NonNegativeInt | None = None  # None: written before batches could be passed over (= step)
    recipe: str = ""
    base_model: BaseModelIdentity | None = None
    trackers: dict[str, str] = {}  # logging.report_to's run ids (training/loop/trackers.py): a resume continues them
    # training.micro_batch_size=auto keeps it on --resume; None: not recorded
    micro_batch_size: PositiveInt | None = None
    objective: dict[str, float | None] = {}  # Objective.state_dict: what the objective carries from step to step
    # (docs/objectives.md), e.g. an adaptive coefficient

    @classmethod
    def written(cls, **fields) -> "RunState":
        """The run state a checkpoint writes: a key that is no field is an error here, where a reader (which ignores
        keys it does not know, so that files of other versions load) would drop it without a word."""
        return cls.model_validate(fields, extra="forbid")

    def file_text(self) -> str:
        """run_state.json's text. A run without a base model (pretraining) writes no base_model key."""
        return dumps(self.model_dump(exclude={"base_model"} if self.base_model is None else None), indent=2) + "\n"

    def layout(self) -> Layout:
        return Layout(**{key: getattr(self, key) for key in Layout.model_fields})


def faults(error: ValidationError) -> str:
    """A validation error as `key: what is wrong (found value)`, each fault once."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}"
                     + ("" if e["type"] == "missing" else f" (found {e['input']!r})") for e in error.errors())
