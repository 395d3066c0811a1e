import datasets
import numpy as np
import pytest

from data_pipeline.loader import EvalBatches, StepBatches
from data_pipeline.prepare import rows_to_dataset
from training.base.errors import ConfigError, DataError


def numbered_rows(n: int, seq_len: int = 4) -> datasets.Dataset:
    """Row i holds the token i everywhere, so a batch shows which rows it took."""
    ids = np.repeat(np.arange(n, dtype=np.int32)[:, None], seq_len, axis=1)
    return rows_to_dataset({"input_ids": ids, "labels": ids,
                            "position_ids": np.tile(np.arange(seq_len, dtype=np.int32), (n, 1)),
                            "length": np.full(n, seq_len, dtype=np.int32)}, fingerprint=f"numbered-{n}")


def rows_seen(batches: StepBatches, step: int) -> list[int]:
    return [int(r) for micro in batches.micro_batches(step) for r in micro["input_ids"][:, 0]]


def test_global_batch_is_the_same_for_any_number_of_ranks():
    rows = numbered_rows(50)
    for step in range(6):
        one_rank = rows_seen(StepBatches(rows, 2, 4, 0, 1, seed=7), step)
        two_ranks = [r for rank in range(2) for r in rows_seen(StepBatches(rows, 2, 2, rank, 2, seed=7), step)]
        four_ranks = [r for rank in range(4) for r in rows_seen(StepBatches(rows, 2, 1, rank, 4, seed=7), step)]
        assert sorted(one_rank) == sorted(two_ranks) == sorted(four_ranks)
        assert len(set(two_ranks)) == 8  # ranks take disjoint rows


def test_an_epoch_visits_each_row_at_most_once_and_epochs_reshuffle():
    batches = StepBatches(numbered_rows(50), 2, 2, 0, 2, seed=7)  # global batch 8 of 50 rows: 6 steps an epoch
    assert batches.steps_per_epoch == 6
    epoch0 = [r for step in range(6) for rank in range(2)
              for r in rows_seen(StepBatches(numbered_rows(50), 2, 2, rank, 2, 7), step)]
    assert len(epoch0) == len(set(epoch0)) == 48
    assert rows_seen(batches, 6) != rows_seen(batches, 0)


def test_same_seed_same_batches_and_a_fresh_loader_resumes_at_any_step():
    first, second = (StepBatches(numbered_rows(50), 2, 2, 1, 2, seed=3),
                     StepBatches(numbered_rows(50), 2, 2, 1, 2, seed=3))
    assert [rows_seen(first, s) for s in range(10)] == [rows_seen(second, s) for s in (range(10))]
    assert rows_seen(StepBatches(numbered_rows(50), 2, 2, 1, 2, seed=4), 0) != rows_seen(first, 0)


def test_a_resume_that_changes_what_a_position_means_names_each_setting():
    saved = StepBatches(numbered_rows(50), 2, 2, 0, 1, seed=3).state_dict()
    with pytest.raises(ConfigError, match="training.global_batch_size is 4 there and 8 in this run; training.seed is "
                                          "3 there and 4 in this run. Resume with the checkpoint's "
                                          "training.global_batch_size, or start a new run"):
        StepBatches(numbered_rows(50), 2, 4, 0, 1, seed=4).load_state_dict(saved)
    with pytest.raises(ConfigError, match=r"the prepared data's rows \(data.sources, their filters and data.seq_len\) "
                                          "is 50 there and 40 in this run"):
        StepBatches(numbered_rows(40), 2, 2, 0, 1, seed=3).load_state_dict(saved)
    StepBatches(numbered_rows(50), 1, 2, 1, 2, seed=3).load_state_dict(saved)  # another layout: the same positions


def test_batches_are_int64_tensors_of_micro_batch_rows():
    micro_batches = StepBatches(numbered_rows(20), 3, 2, 0, 1, seed=0).micro_batches(0)
    assert len(micro_batches) == 2
    for micro in micro_batches:
        assert set(micro) == {"input_ids", "labels", "position_ids", "length"}
        assert all(micro[name].shape == (3, 4) for name in ("input_ids", "labels", "position_ids"))
        assert micro["length"].tolist() == [4, 4, 4]
        assert all(str(t.dtype) == "torch.int64" for t in micro.values())


def test_fewer_rows_than_one_global_batch():
    with pytest.raises(DataError, match="has 5 rows, fewer than one global batch of 8"):
        StepBatches(numbered_rows(5), 2, 2, 0, 2, seed=0)


@pytest.mark.parametrize("rows, micro, ranks, max_rows", [
    (10, 3, 1, None),
    (10, 3, 2, None),
    (7, 2, 4, None),
    (1, 2, 2, None),
    (10, 3, 2, 5),
])
def test_evaluation_visits_every_row_once_with_equal_batches_per_rank(rows, micro, ranks, max_rows):
    """Ranks run the same number of micro-batches; filler rows take no loss."""
    data = numbered_rows(rows)
    per_rank = [list(EvalBatches(data, micro, rank, ranks, max_rows)) for rank in range(ranks)]
    assert len({len(batches) for batches in per_rank}) == 1
    counted = []
    for batches in per_rank:
        for batch in batches:
            assert batch["input_ids"].shape == (micro, 4)
            counted += [int(row[0]) for row, labels in zip(batch["input_ids"], batch["labels"])
                        if (labels != -100).any()]
    assert sorted(counted) == list(range(max_rows or rows))
