"""training/parallel/distributed.py's collectives on 2 real gloo ranks (torch.multiprocessing, no launcher): what a
single process cannot show."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.parallel.launch import free_port

pytestmark = pytest.mark.slow  # two interpreters start

LENGTHS = [(3, 5), (4, 0), (0, 0)]  # per case, each rank's count of values


def ragged_rank(rank: int, port: int, results: dict) -> None:
    from training.objectives.grpo_loss import entropy_threshold
    from training.parallel.distributed import all_gather_ragged
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for case, lengths in enumerate(LENGTHS):
            gathered = all_gather_ragged(torch.arange(lengths[rank], dtype=torch.float32) + 10 * rank)
            results[rank, case] = (gathered.tolist(), float(entropy_threshold(gathered, 0.3)))
    finally:
        dist.destroy_process_group()


def test_a_ragged_gather_concatenates_every_ranks_values_in_rank_order():
    """top_entropy_quantile's threshold is taken over every rank's completion tokens of a micro-batch, whose counts
    differ between the ranks (or are none: no token takes the policy loss)."""
    results = mp.Manager().dict()
    mp.spawn(ragged_rank, args=(free_port(), results), nprocs=2)
    for case, lengths in enumerate(LENGTHS):
        everyone = [float(i + 10 * rank) for rank, length in enumerate(lengths) for i in range(length)]
        expected = torch.quantile(torch.tensor(everyone), 0.7).item() if everyone else float("inf")
        for rank in range(2):
            assert results[rank, case][0] == everyone, (case, rank)
            assert results[rank, case][1] == pytest.approx(expected), (case, rank)
