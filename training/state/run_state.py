"""run_state.json: what a checkpoint records besides DeepSpeed's states. Where the run is (step, tokens, data
position) and what wrote it: the layout its states belong to and, for a fine-tune, the base model. One schema for
writing and reading, so that a damaged or hand-edited file is named with its fault instead of failing later.

Keys added after the first checkpoints were written default to the value those checkpoints were written with
(`sequence_parallel`, recorded last, to 1: a sequence-parallel checkpoint read so resumes through a universal
checkpoint, which loads into any layout of its run).
"""
from typing import Literal

from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt, ValidationError

# What a checkpoint's states belong to: resuming with any of these changed goes through a universal checkpoint, or
# is refused (training/state/universal.py).
LAYOUT_KEYS = ("world_size", "zero_stage", "precision", "pipeline_stages", "tensor_parallel", "sequence_parallel",
               "optimizer", "lora")


class BaseModelIdentity(BaseModel):
    """The checkpoint a fine-tune started from (model.name_or_path): a LoRA checkpoint holds only the adapters, so a
    resume must find the same base weights there."""
    model_config = ConfigDict(strict=True)
    name_or_path: str
    digest: str | None  # training.models.model.weights_digest; None where the weights were not on this machine


class RunState(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    step: NonNegativeInt
    tokens_seen: NonNegativeInt
    data_position: NonNegativeInt | None = None  # None: written before batches could be passed over (= step)
    recipe: str = ""
    world_size: PositiveInt
    zero_stage: Literal[0, 1, 2, 3]
    precision: Literal["bf16", "fp16", "fp32", "fp8"]
    pipeline_stages: PositiveInt = 1
    tensor_parallel: PositiveInt = 1
    sequence_parallel: PositiveInt = 1
    optimizer: str = "adamw"
    lora: bool = False
    base_model: BaseModelIdentity | None = None

    def layout(self) -> dict:
        return {key: getattr(self, key) for key in LAYOUT_KEYS}


def older_default(key: str):
    """The value of a layout key in run states written before the key was recorded."""
    return RunState.model_fields[key].default


def faults(error: ValidationError) -> str:
    """A validation error as `key: what is wrong (found value)`, each fault once."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}"
                     + ("" if e["type"] == "missing" else f" (found {e['input']!r})") for e in error.errors())
