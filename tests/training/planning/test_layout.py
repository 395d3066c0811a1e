"""ParallelDims: the one owner of the run's degrees. Its data-parallel ranks are DeepSpeed's: pipeline ranks
stage-major, a sequence- or tensor-parallel group of consecutive ranks; expert parallelism leaves them as they are."""
import pytest

from training.config.recipe import load_recipe
from training.planning.layout import ParallelDims


@pytest.mark.parametrize("dims, dp_size, dp_ranks", [
    (ParallelDims(4), 4, [0, 1, 2, 3]),
    (ParallelDims(4, pipeline_stages=2), 2, [0, 1, 0, 1]),  # stage 0 is ranks 0-1, stage 1 ranks 2-3
    (ParallelDims(4, sequence_parallel=2), 2, [0, 0, 1, 1]),
    (ParallelDims(8, tensor_parallel=2, sequence_parallel=2), 2, [0, 0, 0, 0, 1, 1, 1, 1]),
    (ParallelDims(4, expert_parallel=4), 4, [0, 1, 2, 3]),
])
def test_the_data_parallel_ranks_follow_deepspeeds_numbering(dims, dp_size, dp_ranks):
    assert dims.dp_size == dp_size
    assert [dims.dp_rank(rank) for rank in range(dims.world_size)] == dp_ranks


def test_the_degrees_come_from_the_recipe_once():
    recipe = load_recipe("tiny_llama", ["parallelism.sequence_parallel=2", "parallelism.expert_parallel=2"])
    dims = ParallelDims.of(recipe.parallelism, 4)
    assert dims == ParallelDims(4, sequence_parallel=2, expert_parallel=2)
    assert dims.enabled() == {"sequence_parallel": 2, "expert_parallel": 2}
    assert [dims.sequence_shard(rank) for rank in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
