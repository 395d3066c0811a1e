"""The run's parallel degrees (ParallelDims: built once, held by the plan) and its layout: what its checkpoints' states
belong to. One record, used by the plan, the run state a checkpoint
writes (training/state/run_state.py), the summary, and the resume and universal-checkpoint checks
(training/state/universal.py): resuming with any field changed goes through a universal checkpoint, or is refused.

Fields added after the first checkpoints were written default to the value those checkpoints were written with
(`sequence_parallel`, recorded last, to 1: a sequence-parallel checkpoint read so resumes through a universal
checkpoint, which loads into any layout of its run)."""
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, PositiveInt

EXPERT_PARALLEL_STAGES = (1, 2)  # the ZeRO stages expert parallelism runs under (training/parallel/expert_parallel.py)


@dataclass(frozen=True)
class ParallelDims:
    """Every parallel degree of a run over `world_size` ranks, and the data-parallel size and ranks they leave: the one
    owner of the degrees (torchtitan's ParallelDims). DeepSpeed numbers pipeline ranks stage-major; a sequence- or
    tensor-parallel group is N consecutive ranks; expert parallelism splits the data-parallel ranks' experts and
    leaves the data-parallel size as it is."""
    world_size: int
    pipeline_stages: int = 1
    tensor_parallel: int = 1
    sequence_parallel: int = 1
    expert_parallel: int = 1

    @classmethod
    def of(cls, parallelism, world_size: int) -> "ParallelDims":
        """The degrees of the recipe's parallelism section (training/config/recipe.py, ParallelismSection)."""
        return cls(world_size, parallelism.pipeline_stages, parallelism.tensor_parallel,
                   parallelism.sequence_parallel, parallelism.expert_parallel)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the world size over the pipeline stages, sequence- or tensor-parallel ranks."""
        return self.world_size // (self.pipeline_stages * self.sequence_parallel * self.tensor_parallel)

    def dp_rank(self, rank: int) -> int:
        """A rank's data-parallel rank."""
        group = self.sequence_parallel * self.tensor_parallel
        return rank // group if group > 1 else rank % self.dp_size

    def sequence_shard(self, rank: int) -> tuple[int, int]:
        """(the rank's slice of each row, slices per row)."""
        return rank % self.sequence_parallel, self.sequence_parallel

    def enabled(self) -> dict[str, int]:
        """The degrees above 1, by their recipe key (parallelism.<key>)."""
        return {key: size for key, size in (("pipeline_stages", self.pipeline_stages),
                                            ("tensor_parallel", self.tensor_parallel),
                                            ("sequence_parallel", self.sequence_parallel),
                                            ("expert_parallel", self.expert_parallel)) if size > 1}


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
