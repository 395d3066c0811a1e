"""Canary of training/compat/lm_eval.py: lm-eval's HFLM still takes accelerate's rank and size only on a node of
several GPUs, and then the rank within the node."""
import lm_eval.models.huggingface as huggingface
import pytest
import torch

from tests.conftest import save_small_checkpoint
from training.compat.lm_eval import split_over_processes


def launched_process(processes: int, rank: int, local_rank: int) -> type:
    """What accelerate's Accelerator() is in process `rank` of a launch of `processes`."""
    class Accelerator:
        num_processes, process_index, local_process_index = processes, rank, local_rank
        device = torch.device("cpu")
        is_local_main_process = local_rank == 0

        def __init__(self, **kwargs):
            pass

        def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
            return model
    return Accelerator


@pytest.mark.parametrize("gpus, processes, rank, local_rank, upstream", [
    (0, 2, 1, 1, (0, 1)),  # two CPU processes: each keeps every request
    (1, 2, 1, 0, (0, 1)),  # two nodes of one GPU: the same
    (8, 16, 9, 1, (1, 16)),  # two nodes of 8 GPUs: the second node's ranks repeat the first's
])
def test_hflm_takes_the_launchs_rank_only_on_a_node_of_gpus(tmp_path, monkeypatch, gpus, processes, rank, local_rank,
                                                            upstream):
    save_small_checkpoint(tmp_path / "model")
    monkeypatch.setattr(huggingface, "Accelerator", launched_process(processes, rank, local_rank))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    model = huggingface.HFLM(pretrained=str(tmp_path / "model"), dtype="float32", batch_size=1, device="cpu")
    assert (model.rank, model.world_size) == upstream, \
        "lm-eval now takes the launch's rank and size itself: remove split_over_processes"
    split_over_processes(model)
    assert (model.rank, model.world_size) == (rank, processes)
