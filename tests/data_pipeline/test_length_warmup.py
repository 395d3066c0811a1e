"""data.seq_len_warmup (data_pipeline/length_warmup.py): the lengths over the steps, a step's tokens unchanged by
the cut, each fragment's loss as alone, the same rows on every layout, and the recipe's refusals."""
import datasets
import numpy as np
import pytest
import torch

from data_pipeline.config import LengthWarmupConfig
from data_pipeline.length_warmup import cut_rows, length_at, warmup_lengths, warmup_line
from data_pipeline.loader import StepBatches, target_count
from data_pipeline.pack import pack_bfd
from data_pipeline.prepare import rows_to_dataset
from tests.data_pipeline.test_packed_attention import per_token_loss, sharp_model
from training.base.errors import ConfigError
from training.config.recipe import load_recipe

SEQ = 32
WARMUP = LengthWarmupConfig(start=8, steps=12)


def packed_rows(count: int = 16, seed: int = 0) -> tuple[datasets.Dataset, dict[str, np.ndarray]]:
    """Random documents packed best-fit into rows of SEQ (padding at the ends), as a data set and as arrays."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 20, size=count * 2)
    tokens = rng.integers(1, 97, size=int(lengths.sum()))
    rows = pack_bfd(tokens, lengths, SEQ, pad_id=0)
    return rows_to_dataset(rows, f"warmup-{count}-{seed}"), rows


def test_the_length_climbs_from_start_through_divisors_to_seq_len():
    assert warmup_lengths(256, 32) == [32, 64, 128, 256]
    assert warmup_lengths(96, 16) == [16, 32, 48, 96]
    lengths = [length_at(WARMUP, SEQ, position) for position in range(20)]
    ramp = [8 + 24 * p / 12 for p in range(12)]
    assert lengths[0] == 8 and lengths == sorted(lengths) and set(lengths) == {8, 16, 32}
    assert all(length <= r for length, r in zip(lengths, ramp)) and lengths[12:] == [SEQ] * 8
    assert lengths.index(16) == 4 and lengths.index(32) == 12  # the ramp 8 + 2p reaches 16 at p = 4
    assert "8 tokens x 16 rows/micro-batch from step 1, 16 tokens x 8 rows/micro-batch from step 5, 32 tokens x 4 " \
           "rows/micro-batch from step 13" in warmup_line(WARMUP, SEQ, 4)


def test_a_cut_step_holds_the_same_tokens_and_loses_only_the_cut_rows_first_targets():
    rows, _ = packed_rows()
    plain = StepBatches(rows, 4, 2, 0, 1, seed=3)
    warm = StepBatches(rows, 4, 2, 0, 1, seed=3, warmup=WARMUP)
    for position in (0, 5, 12):
        length = length_at(WARMUP, SEQ, position)
        for whole, cut in zip(plain.micro_batches(position), warm.micro_batches(position), strict=True):
            assert cut["input_ids"].shape == (4 * SEQ // length, length)
            assert torch.equal(cut["input_ids"].reshape(-1), whole["input_ids"].reshape(-1))
            assert torch.equal(cut["labels"].reshape(-1), whole["labels"].reshape(-1))
            assert int(cut["length"].sum()) == int(whole["length"].sum())
            starts = whole["labels"][:, length::length] != -100  # targets that now begin a row
            assert target_count(cut) == target_count(whole) - int(starts.sum())
    assert warm.metrics(1) == {"seq_len": 8} and warm.metrics(13) == {"seq_len": SEQ}


def fragments(input_ids: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
    """The documents of one row, split where a document starts (position 0)."""
    starts = (position_ids == 0).nonzero().flatten().tolist()
    bounds = sorted({0, *starts, len(input_ids)})
    return [input_ids[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("length", [8, 16])
def test_each_fragment_of_a_cut_row_has_its_loss_alone(length):
    """A document cut across rows: its part in the next row attends as a document alone of its length (positions
    from 0), and no row's attention crosses into another document."""
    rows, packed = packed_rows(4)
    batch = {name: torch.from_numpy(packed[name].astype(np.int64)) for name in ("input_ids", "labels", "position_ids",
                                                                                 "length")}
    cut = cut_rows(batch, length)
    model = sharp_model()
    with torch.no_grad():
        for ids, positions, labels in zip(cut["input_ids"], cut["position_ids"], cut["labels"]):
            got = per_token_loss(model, ids, positions, labels)
            start = 0
            for part in fragments(ids, positions):
                alone = per_token_loss(model, part, torch.arange(len(part)), labels[start:start + len(part)])
                torch.testing.assert_close(got[start:start + len(part) - 1], alone, rtol=1e-5, atol=1e-5)
                start += len(part)
            assert positions[0] == 0  # a row starts a document or a fragment


def test_every_layout_reads_the_same_cut_rows():
    rows, _ = packed_rows()
    one = StepBatches(rows, 4, 2, 0, 1, seed=3, warmup=WARMUP)
    two = [StepBatches(rows, 2, 2, rank, 2, seed=3, warmup=WARMUP) for rank in range(2)]
    for position in (0, 4, 11):
        single = sorted(map(tuple, torch.cat([b["input_ids"] for b in one.micro_batches(position)]).tolist()))
        split = sorted(map(tuple, torch.cat([b["input_ids"] for rank in two
                                             for b in rank.micro_batches(position)]).tolist()))
        assert single == split
    with pytest.raises(ConfigError, match="data.seq_len_warmup is .* there and None in this run"):
        StepBatches(rows, 4, 2, 0, 1, seed=3).load_state_dict(one.state_dict())


@pytest.mark.parametrize("overrides, message", [
    (["data.seq_len_warmup={start: 48, steps: 10}"], "data.seq_len_warmup.start is 48: it must divide data.seq_len"),
    (["data.seq_len_warmup={start: 64, steps: 10}", "training.objective=dpo"], "this run is dpo: remove it"),
    (["data.seq_len_warmup={start: 64, steps: 10}", "parallelism.pipeline_stages=2"],
     "DeepSpeed's pipeline engine passes activations of one shape"),
    (["data.seq_len_warmup={start: 2, steps: 10}", "data.seq_len=256", "parallelism.sequence_parallel=4"],
     "data.seq_len_warmup.start=2 does not split over parallelism.sequence_parallel=4"),
])
def test_the_recipe_refuses_what_the_warmup_cannot_cut(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe("tiny_llama", overrides)
