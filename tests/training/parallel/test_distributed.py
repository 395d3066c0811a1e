"""training/parallel/distributed.py: its collectives on 2 real gloo ranks (torch.multiprocessing, no launcher: slow,
two interpreters start), what a single process cannot show; the start's checks in this process."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import train
from tests.conftest import main_in_process
from training.base.errors import ConfigError
from training.parallel.distributed import check_master_port
from training.parallel.launch import free_port

LENGTHS = [(3, 5), (4, 0), (0, 0)]  # per case, each rank's count of values


def ragged_rank(rank: int, port: int, results: dict) -> None:
    from training.objectives.grpo.loss import entropy_threshold
    from training.parallel.distributed import all_gather_ragged
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for case, lengths in enumerate(LENGTHS):
            gathered = all_gather_ragged(torch.arange(lengths[rank], dtype=torch.float32) + 10 * rank)
            results[rank, case] = (gathered.tolist(), float(entropy_threshold(gathered, 0.3)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
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


def slow_first_rank(rank: int, port: int, wait: str, results: dict) -> None:
    """Local rank 0 works 4 s in a process group whose timeout is 1.5 s while rank 1 waits (`wait`: how). The ranks
    meet through a store of their own that waits a minute for them: the group's short timeout is for its
    collectives, and a rank that starts 2 s late on a loaded machine (seen in CI) would time the rendezvous out."""
    import os
    import time
    from datetime import timedelta

    from training.parallel.distributed import local_main_first
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=1.5))
    try:
        if wait == "collective barrier":
            if rank == 0:
                time.sleep(4)
            dist.barrier()
        else:
            with local_main_first():
                if rank == 0:
                    time.sleep(4)  # a data preparation
        results[rank] = dist.all_reduce(torch.ones(1)) or "the group still works"
    except RuntimeError as error:
        results[rank] = str(error)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("wait", ["collective barrier", "local_main_first"])
def test_ranks_wait_for_local_rank_0_past_the_process_groups_timeout(wait):
    """A collective barrier fails once the process group's timeout passes (DeepSpeed's is 30 minutes: a longer data
    preparation ended the run); local_main_first's patient barrier waits for as long as the work takes."""
    results = mp.Manager().dict()
    mp.spawn(slow_first_rank, args=(free_port(), wait, results), nprocs=2)
    if wait == "collective barrier":
        assert "Timed out" in results[1]
    else:
        assert dict(results) == {0: "the group still works", 1: "the group still works"}


@pytest.fixture
def taken_port(monkeypatch) -> int:
    """A port another process's store listens on, as the launch's MASTER_PORT of rank 0."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("", 0))
        other.listen()
        port = other.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        yield port


def test_train_py_names_a_master_port_another_process_listens_on(taken_port, tmp_path):
    result = main_in_process(train.main, ["--recipe", "tiny_llama", "--output-dir", str(tmp_path / "run")])
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"error: MASTER_PORT {taken_port} is in use on {socket.gethostname()}, by another run on this node most " \
           f"likely" in result.stderr and "e.g. deepspeed --master_port " in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def test_only_rank_0_without_torchruns_agent_store_checks_the_port(taken_port, monkeypatch):
    with pytest.raises(ConfigError):
        check_master_port()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's agent listens there: the store is ours
    check_master_port()
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    monkeypatch.setenv("RANK", "1")  # a client of rank 0's store
    check_master_port()


def test_a_free_port_passes(monkeypatch):
    port = free_port()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", str(port))
    check_master_port()
