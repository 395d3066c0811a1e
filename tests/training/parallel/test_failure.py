"""The failure watch's heartbeats, on an in-process store: which ranks count as lost, and the message that names
their nodes and the last checkpoint. (Whole runs that lose a node: tests/test_multi_node.py.)"""
from datetime import timedelta

import pytest
import torch.distributed as dist

from training.parallel import failure
from training.parallel.failure import FailureWatch
from training.parallel.launch import free_port


@pytest.fixture
def watches(monkeypatch):
    """Three ranks' watches on one store, their threads not started (each test moves the counts itself)."""
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    monkeypatch.setattr(failure.threading.Thread, "start", lambda thread: None)
    made = []
    for rank, node in enumerate(("0", "0", "1")):
        monkeypatch.setenv("CROSS_RANK", node)
        made.append(FailureWatch(rank, rank % 2, 3, lambda: "The last complete checkpoint is out/global_step4"))
    yield made
    del server


def test_a_rank_whose_count_stands_still_is_lost(watches, monkeypatch):
    clock = iter([0.0, 5.0, 25.0])
    monkeypatch.setattr(failure.time, "monotonic", lambda: next(clock))
    first = watches[0]
    assert first.standing_still(20.0) == []
    for watch in watches[:2]:
        watch.store.add(watch.beat_keys[watch.rank], 1)
    assert first.standing_still(20.0) == []
    for watch in watches[:2]:
        watch.store.add(watch.beat_keys[watch.rank], 1)
    assert first.standing_still(20.0) == [2]  # still since 0 s, the others moved at 25 s


def test_a_failing_rank_finds_the_ranks_that_stand_still(watches, monkeypatch):
    def others_beat(seconds):
        watches[1].store.add(watches[1].beat_keys[1], 1)

    monkeypatch.setattr(failure.time, "sleep", others_beat)
    assert watches[0].stalled_ranks() == [2]


def test_the_message_names_the_lost_node_its_ranks_and_the_checkpoint(watches):
    message = watches[0].lost_message([2], 20.0)
    assert message.startswith("error: lost node 1 (")
    assert "), rank(s) 2: no heartbeat for 20 s" in message
    assert message.endswith(". The last complete checkpoint is out/global_step4")


def test_a_rank_that_fails_after_another_follows_it_without_looking(watches, monkeypatch):
    """A lost node breaks every rank's collective at once: the first to fail looks for ranks that stand still; the
    others find the failure counted and leave with its code, without their own 3 s look."""
    looked, left = [], []
    monkeypatch.setattr(FailureWatch, "stalled_ranks", lambda watch: looked.append(watch.rank) or [])
    monkeypatch.setattr(FailureWatch, "follow", lambda watch: left.append(watch.rank) or exit_now())
    monkeypatch.setattr(failure.os, "_exit", lambda code: exit_now())
    watches[1].store.add(watches[1].count_key, 1)  # rank 1 failed first
    with pytest.raises(SystemExit):
        watches[0].fail(1, "error: Connection reset by peer")
    assert looked == [] and left == [0]


def exit_now():
    raise SystemExit
