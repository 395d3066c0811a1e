"""data.seq_len_warmup: the sequence length grows over the first steps, as OLMo-core's sequence-length scheduler
does, with the tokens per step kept. At length l a step cuts each packed row of data.seq_len tokens into
seq_len / l rows of l tokens, so its micro-batches hold seq_len / l times the rows; l grows linearly from `start`
to data.seq_len over `steps` steps, through the multiples of `start` that divide data.seq_len (so a row always cuts
into whole rows).

A cut keeps every token in place and makes each fragment a document of its own: where a document runs on past a
cut, its part in the next row counts its positions from 0 again (rotary attention sees only the distances between
positions, so the fragment attends as a document alone of its length), and that part's first token is no target,
as no row's first token is (it has nothing to predict it from). So the packing's invariant holds for the
fragments: each one's loss is its loss alone. The rows a step reads and their order are those without the warmup
(the data position picks them); the plan and the memory are those of data.seq_len, the longest."""
import torch

from data_pipeline.config import LengthWarmupConfig


def warmup_lengths(seq_len: int, start: int) -> list[int]:
    """The lengths the warmup passes through: the multiples of `start` that divide seq_len, up to seq_len."""
    return [length for length in range(start, seq_len + 1, start) if seq_len % length == 0]


def length_at(warmup: LengthWarmupConfig, seq_len: int, position: int) -> int:
    """The sequence length of the batch at this data position: the longest warmup length within the linear ramp from
    `start` (position 0) to seq_len (position `steps`)."""
    if position >= warmup.steps:
        return seq_len
    ramp = warmup.start + (seq_len - warmup.start) * position / warmup.steps
    return max(length for length in warmup_lengths(seq_len, warmup.start) if length <= ramp)


def cut_rows(batch: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """The micro-batch with each row cut into rows of `length` tokens (each row's real tokens, `length`, being
    its first ones): positions counted from 0 again where a row starts inside a document."""
    rows, seq_len = batch["input_ids"].shape
    if length == seq_len:
        return batch
    parts = seq_len // length
    cut = {name: batch[name].reshape(rows * parts, length) for name in ("input_ids", "labels", "position_ids")}
    positions = cut["position_ids"]
    inside = torch.cumsum(positions == 0, dim=1) == 0  # before the first document that starts in the row
    cut["position_ids"] = torch.where(inside, positions - positions[:, :1], positions)
    offsets = torch.arange(parts) * length
    cut["length"] = (batch["length"][:, None] - offsets[None, :]).clamp(0, length).reshape(-1)
    return cut


def warmup_line(warmup: LengthWarmupConfig, seq_len: int, micro_batch_size: int) -> str:
    """--dry-run's line: each length, the step it starts at and the rows per micro-batch it makes."""
    first = {}
    for position in range(warmup.steps + 1):
        first.setdefault(length_at(warmup, seq_len, position), position + 1)
    return ("sequence-length warmup (data.seq_len_warmup), the tokens per step kept: " + ", ".join(
        f"{length:,} tokens x {micro_batch_size * seq_len // length} rows/micro-batch from step {step}"
        for length, step in first.items()))
