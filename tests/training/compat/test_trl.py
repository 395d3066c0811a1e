"""training/compat/trl.py's canary: TRL's chunked divergence is where distill's loss imports it from, still not
exported (then the public name replaces the module path), and tiled as the memory plan counts it."""
import trl.kernels
import trl.kernels.chunked_divergence as kernel

from training.objectives.distill.spec import DIVERGENCE_TILE


def test_the_chunked_divergence_is_where_and_as_large_as_counted():
    assert "ChunkedDivergenceFunction" not in trl.kernels.__all__
    assert callable(kernel.ChunkedDivergenceFunction.apply)
    assert (kernel.TOKEN_CHUNK_SIZE, kernel.VOCAB_CHUNK_SIZE) == DIVERGENCE_TILE
