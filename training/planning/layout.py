"""The run's layout: what its checkpoints' states belong to. One record, used by the plan, the run state a checkpoint
writes (training/state/run_state.py), the summary, and the resume and universal-checkpoint checks
(training/state/universal.py): resuming with any field changed goes through a universal checkpoint, or is refused.

Fields added after the first checkpoints were written default to the value those checkpoints were written with
(`sequence_parallel`, recorded last, to 1: a sequence-parallel checkpoint read so resumes through a universal
checkpoint, which loads into any layout of its run)."""
from typing import Literal

from pydantic import BaseModel, ConfigDict, PositiveInt

EXPERT_PARALLEL_STAGES = (1, 2)  # the ZeRO stages expert parallelism runs under (training/parallel/expert_parallel.py)


class Layout(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")
    world_size: PositiveInt
    zero_stage: Literal[0, 1, 2, 3]
    precision: Literal["bf16", "fp16", "fp32", "fp8"]
    pipeline_stages: PositiveInt = 1
    tensor_parallel: PositiveInt = 1
    sequence_parallel: PositiveInt = 1
    expert_parallel: PositiveInt = 1
    optimizer: str = "adamw"
    lora: bool = False

    def changes_to(self, other: "Layout") -> str:
        """`field old -> new` for each field that differs, e.g. 'world_size 2 -> 1, zero_stage 2 -> 3'."""
        return ", ".join(f"{key} {getattr(self, key)} -> {getattr(other, key)}" for key in Layout.model_fields
                         if getattr(self, key) != getattr(other, key))
