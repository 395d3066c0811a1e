"""The optimizer states the plan counts: fixed bytes per parameter for AdamW, Lion and Muon; for AdamW8bit and
Adafactor, share by share as ZeRO cuts the weights (the 2-rank measurement is tests/test_optimizers.py's)."""
import math

import pytest
from transformers import AutoConfig

from training.planning.optimizer_states import optimizer_state_bytes, rank_shares, share_state_bytes
from training.planning.shape import model_shape

TINY = model_shape(AutoConfig.from_pretrained("recipes/tiny_llama/config.json"))


def test_adamw_lion_and_muon_keep_fixed_bytes_per_parameter():
    assert optimizer_state_bytes("adamw", TINY) == 8 and optimizer_state_bytes("lion", TINY) == 4
    matrices = TINY.layer_matrix_parameters
    assert 0 < matrices < TINY.parameters
    assert optimizer_state_bytes("muon", TINY) * TINY.parameters == 4 * matrices + 8 * (TINY.parameters - matrices)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_the_ranks_shares_hold_every_value_once(stage, ranks):
    weights = [shape for group in TINY.trained_shapes for shape in group]
    held = [[] for _ in weights]
    for rank in range(ranks):
        for index, start, numel, shape in rank_shares(TINY.trained_shapes, stage, ranks, rank):
            assert math.prod(shape) == numel
            held[index].append((start, start + numel))
    for weight, parts in zip(weights, held):
        parts.sort()
        assert parts[0][0] == 0 and parts[-1][1] == math.prod(weight)
        assert all(end == next_start for (_, end), (next_start, _) in zip(parts, parts[1:]))


def test_what_a_share_keeps():
    assert share_state_bytes("adafactor", (4096, 1024)) == 4 * (4096 + 1024)
    assert share_state_bytes("adafactor", (4096,)) == 4 * 4096
    assert share_state_bytes("adamw8bit", (4096, 1024)) == 2 * (4096 * 1024 + 4096 * 1024 // 256 * 4 + 1024)
    assert share_state_bytes("adamw8bit", (4096, 1024), embedding=True) == 8 * 4096 * 1024
    assert share_state_bytes("adamw8bit", (64, 63)) == 8 * 64 * 63  # not whole 256-value blocks
    assert share_state_bytes("adamw8bit", (16, 128)) == 8 * 16 * 128  # under 4096 values


def test_llama3_8b_per_parameter():
    """Adafactor's factors are a rounding error of an 8B model; AdamW8bit keeps about 2 bytes, and 8 on the
    embedding (a 16th of the model); ZeRO-3's row blocks keep both close to that on 8 ranks."""
    shape = model_shape(AutoConfig.from_pretrained("recipes/llama3_8b/config.json"))
    embedding = shape.embedding_parameters / shape.parameters
    for stage, ranks in [(0, 1), (3, 8)]:
        assert optimizer_state_bytes("adafactor", shape, stage, ranks) < 0.01
        assert optimizer_state_bytes("adamw8bit", shape, stage, ranks) == pytest.approx(
            2.03 * (1 - embedding) + 8 * embedding, rel=0.01)
