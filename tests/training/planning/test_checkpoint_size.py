"""The host memory an asynchronous save's copies hold (training/planning/checkpoint_size.py), and the plan's line."""
import pytest

from training.config.precision import Precision
from training.planning.checkpoint_size import async_host_bytes, checkpoint_bytes


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_node_holds_the_whole_checkpoint_and_two_hold_it_between_them(stage):
    size = checkpoint_bytes(1e9, stage, 8, Precision.BF16)
    assert async_host_bytes(size, 8, 8) == pytest.approx(size.total)
    first_node = async_host_bytes(size, 8, 4)
    others = size.total - size.largest_rank
    assert first_node == pytest.approx(size.largest_rank + 3 * others / 7)
    assert first_node >= size.total / 2  # the first node holds the busiest rank


def test_the_plan_prints_the_host_memory_of_background_saves(capsys):
    import train
    train.main(["--recipe", "tiny_llama", "--dry-run"])
    printed = capsys.readouterr().out
    assert "checkpoint saves in the background (checkpointing.asynchronous): their copies hold" in printed
    train.main(["--recipe", "tiny_llama", "--dry-run", "checkpointing.asynchronous=false"])
    assert "in the background" not in capsys.readouterr().out
