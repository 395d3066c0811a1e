"""Deterministic global batches over packed rows, sharded across data-parallel ranks."""
from collections.abc import Iterator

import datasets
import numpy as np
import torch

from data_pipeline.config import LengthWarmupConfig
from data_pipeline.curriculum import PhaseSchedule
from data_pipeline.length_warmup import cut_rows, length_at
from data_pipeline.preference import pack_pairs
from training.base.errors import ConfigError, DataError

ROW_COLUMNS = ("input_ids", "labels", "position_ids", "length")


def fetch_rows(rows: datasets.Dataset, indices: np.ndarray) -> dict[str, torch.Tensor]:
    """input_ids, labels and position_ids for the model, and each row's `length` in real tokens."""
    batch = rows[indices]
    return {name: torch.from_numpy(batch[name].astype(np.int64)) for name in ROW_COLUMNS}


def target_count(batch: dict) -> int:
    """Tokens the batch takes a loss on: each label predicts from the token before it."""
    return int((batch["labels"][:, 1:] != -100).sum())


def model_inputs(batch: dict, device: torch.device, shard: tuple[int, int] = (0, 1)) -> dict:
    """What the model takes of a batch, on its device. Under sequence parallelism, shard = (index, count):
    this rank's slice of the sequence, with the labels shifted first (`shift_labels`, which transformers'
    loss takes as they are) so that a slice's last token still predicts the next slice's first."""
    index, count = shard
    if count == 1:
        return {name: batch[name].to(device, non_blocking=True) for name in ("input_ids", "labels", "position_ids")}
    shifted = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    width = shifted.shape[1] // count
    part = slice(index * width, (index + 1) * width)
    inputs = {name: batch[name][:, part].contiguous().to(device, non_blocking=True)
              for name in ("input_ids", "position_ids")}
    labels = shifted[:, part].contiguous().to(device, non_blocking=True)
    return {**inputs, "labels": labels, "shift_labels": labels}


class StepBatches:
    """The micro-batches each rank trains on at a given optimizer step.

    Epoch e visits the rows in a permutation seeded by (seed, e); step s takes the next
    `global_batch_size` rows of it, and an incomplete last batch of an epoch is skipped. The
    global batch is the same for any number of ranks, so runs on 1 or N ranks (and under any
    ZeRO stage) see the same data. The position (batches consumed: the step, plus any batches the
    stability guard passed over) alone determines a batch, which is what makes resuming exact: no
    iterator state needs saving.

    Rank r's micro-batch m holds rows [(m * ranks + r) * micro, ... + micro) of the global batch.
    """
    unit = "rows"

    def __init__(self, rows: datasets.Dataset, micro_batch_size: int, accumulation_steps: int,
                 dp_rank: int, dp_size: int, seed: int, phases: PhaseSchedule | None = None,
                 warmup: LengthWarmupConfig | None = None):
        self.rows = rows.with_format("numpy")
        self.micro_batch_size, self.accumulation_steps = micro_batch_size, accumulation_steps
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.global_batch_size = micro_batch_size * accumulation_steps * dp_size
        self.phases = phases  # data.phases: the schedule says which rows each batch holds (data_pipeline/curriculum.py)
        self.warmup = warmup  # data.seq_len_warmup: the first steps' rows cut shorter (data_pipeline/length_warmup.py)
        self.seq_len = len(rows[0]["input_ids"]) if warmup else None
        self.batches_per_epoch = len(rows) // self.global_batch_size
        if self.batches_per_epoch == 0:
            raise DataError(f"the data set has {len(rows)} {self.unit}, fewer than one global batch of "
                             f"{self.global_batch_size}; add data or lower training.global_batch_size")
        self.steps_per_epoch = phases.steps if phases else self.batches_per_epoch  # phases: the run's
        self._epoch, self._order = None, None

    def epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
        return self._order

    def micro_batches(self, position: int) -> list[dict[str, torch.Tensor]]:
        batches = [self.fetch(np.sort(micro)) for micro in self.rank_rows(position)]
        if self.warmup:
            length = length_at(self.warmup, self.seq_len, position)
            batches = [cut_rows(batch, length) for batch in batches]
        return batches

    def global_rows(self, position: int) -> np.ndarray:
        """The rows of the global batch at this data position."""
        if self.phases:
            return self.phases.global_rows(position)
        epoch, index = divmod(position, self.batches_per_epoch)
        start = index * self.global_batch_size
        return self.epoch_order(epoch)[start:start + self.global_batch_size]

    def rank_rows(self, position: int) -> np.ndarray:
        """This rank's rows of the global batch at the position, [accumulation steps, micro-batch]."""
        rows = self.global_rows(position)
        return rows.reshape(self.accumulation_steps, self.dp_size, self.micro_batch_size)[:, self.dp_rank]

    def metrics(self, position: int) -> dict:
        """metrics.jsonl's fields of the data for the step before this position: with data.phases, its phase and each
        source's tokens so far; with data.seq_len_warmup, its sequence length."""
        record = self.phases.metrics(position) if self.phases else {}
        if self.warmup:
            record["seq_len"] = length_at(self.warmup, self.seq_len, max(0, position - 1))
        return record

    def fetch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        return fetch_rows(self.rows, indices)

    def pass_over(self, count: int) -> None:
        """Batches are read by their position: passing over some needs nothing (a stream must read them)."""

    # state_dict's fields in the recipe's words, the settings a user changes first (a resume names what changed)
    settings = {"global_batch_size": "training.global_batch_size", "seed": "training.seed",
                "rows": "the prepared data's rows (data.sources, their filters and data.seq_len)",
                "phases": "data.phases (each phase's name, steps, weights and order)",
                "seq_len_warmup": "data.seq_len_warmup"}

    def state_dict(self) -> dict:
        """What a position means, checked when resuming (the position itself is in the run state)."""
        return {"rows": len(self.rows), "global_batch_size": self.global_batch_size, "seed": self.seed,
                "phases": self.phases.state_dict() if self.phases else None,
                "seq_len_warmup": self.warmup.model_dump() if self.warmup else None}

    def load_state_dict(self, state: dict) -> None:
        """A ConfigError naming each setting whose value the checkpoint's position was counted under and this run
        changes (fields a checkpoint predates are not compared)."""
        current = self.state_dict()
        changed = [key for key in self.settings if key in state and state[key] != current[key]]
        if changed:
            raise ConfigError("--resume: the checkpoint's data position counts batches of another shape: " + "; ".join(
                f"{self.settings[key]} is {state[key]} there and {current[key]} in this run" for key in changed) +
                f". Resume with the checkpoint's {self.settings[changed[0]].split(' (')[0]}, or start a new run "
                f"(another --output-dir, or --overwrite)")



class EvalBatches:
    """The evaluation rows in a fixed order, split across data-parallel ranks: micro-batch b of rank r
    holds rows [(b * ranks + r) * micro, ... + micro). Every rank runs the same number of micro-batches
    (under ZeRO-3 each forward pass gathers weights from all ranks); rows past the end are filled with
    copies of the last row whose labels are all -100, which adds nothing to the loss or the target count."""

    def __init__(self, rows: datasets.Dataset, micro_batch_size: int, dp_rank: int, dp_size: int,
                 max_rows: int | None = None):
        self.rows = rows.with_format("numpy")
        self.count = min(len(rows), max_rows or len(rows))
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __len__(self) -> int:
        """Micro-batches per rank."""
        return -(-self.count // (self.micro_batch_size * self.dp_size))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for b in range(len(self)):
            first = (b * self.dp_size + self.dp_rank) * self.micro_batch_size
            wanted = np.arange(first, first + self.micro_batch_size)
            yield self.fetch(np.minimum(wanted, self.count - 1), wanted < self.count)

    def fetch(self, positions: np.ndarray, real: np.ndarray) -> dict[str, torch.Tensor]:
        batch = fetch_rows(self.rows, positions)
        batch["labels"][~real] = -100
        return batch


class EvalPromptBatches(EvalBatches):
    """The evaluation prompts (training.objective=grpo), split across data-parallel ranks as EvalBatches splits rows,
    a batch being `micro_batch_size` prompts: every rank generates the same number of batches of the same size (under
    ZeRO-3 each decoding pass gathers weights from all ranks); prompts past the end are copies of the last, marked not
    `real`."""

    def fetch(self, positions: np.ndarray, real: np.ndarray) -> dict:
        batch = self.rows[positions]
        return {"prompt_ids": [ids.astype(np.int64) for ids in batch["prompt_ids"]], "prompt": list(batch["prompt"]),
                "fields": list(batch["fields"]), "rows": positions, "real": real}


class PairBatches(StepBatches):
    """The same over preference pairs (training.objective=dpo): a batch counts pairs, and each micro-batch's pairs are
    packed into rows when it is fetched (data_pipeline/preference.py), both sequences of a pair in the same
    micro-batch. `reference` (set before training) holds each pair's reference log-probabilities."""
    unit = "pairs"

    def __init__(self, pairs: datasets.Dataset, micro_batch_size: int, accumulation_steps: int, dp_rank: int,
                 dp_size: int, seed: int, seq_len: int, pad_id: int, packing: str):
        super().__init__(pairs, micro_batch_size, accumulation_steps, dp_rank, dp_size, seed)
        self.seq_len, self.pad_id, self.packing = seq_len, pad_id, packing
        self.reference: np.ndarray | None = None

    def fetch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        return fetch_pairs(self, indices, np.ones(len(indices), dtype=bool))


class EvalPairBatches(EvalBatches):
    """Every pair once in a fixed order (or the pairs `indices` names, in that order), split across data-parallel
    ranks as EvalBatches splits rows: for evaluation and for the reference pass. Past the end, copies of the last pair
    with `real` false fill the last micro-batches, so every rank runs as many forward passes."""

    def __init__(self, pairs: datasets.Dataset, micro_batch_size: int, dp_rank: int, dp_size: int, seq_len: int,
                 pad_id: int, packing: str, max_pairs: int | None = None, indices: np.ndarray | None = None):
        super().__init__(pairs, micro_batch_size, dp_rank, dp_size)
        self.indices = np.arange(len(pairs)) if indices is None else indices
        self.count = min(len(self.indices), max_pairs or len(self.indices))
        self.seq_len, self.pad_id, self.packing = seq_len, pad_id, packing
        self.reference: np.ndarray | None = None

    def fetch(self, positions: np.ndarray, real: np.ndarray) -> dict[str, torch.Tensor]:
        return fetch_pairs(self, self.indices[positions], real)


def fetch_pairs(source: PairBatches | EvalPairBatches, indices: np.ndarray, real: np.ndarray) -> dict:
    """Pairs `indices` packed into rows, with their indices, which of them are `real` and their reference values."""
    pairs = source.rows[indices]
    batch = pack_pairs(pairs["chosen_ids"], pairs["rejected_ids"], pairs["prompt_length"], source.seq_len,
                       source.pad_id, source.packing)
    batch["pair_index"], batch["real"] = torch.from_numpy(indices.astype(np.int64)), torch.from_numpy(real)
    if source.reference is not None:
        batch["reference"] = torch.from_numpy(source.reference[indices])
    return batch


class PromptBatches(StepBatches):
    """Prompts (training.objective=grpo). A step takes the next global_batch_size / num_generations prompts of the
    epoch's order, and rank r samples the groups of its contiguous share of them, so that every layout sees the same
    prompts and a group never spans ranks. A generation samples the prompts of `steps_per_generation` such steps at
    once (grpo.generation_batch_size), and num_iterations passes over those steps train on it: the data position p
    reads generation p // (steps_per_generation x num_iterations), for its step p % steps_per_generation. A batch is
    the rank's prompts of the whole generation, step by step (whose completions the objective generates,
    training/objectives/grpo/objective.py), with each prompt's row in the data set (which seeds its sampling), the
    generation's index and the step's place in it (part)."""
    unit = "prompts"

    def __init__(self, prompts: datasets.Dataset, prompts_per_rank: int, dp_rank: int, dp_size: int, seed: int,
                 num_iterations: int, num_generations: int, steps_per_generation: int = 1):
        super().__init__(prompts, prompts_per_rank, steps_per_generation, dp_rank, dp_size, seed)
        self.num_iterations, self.steps_per_generation = num_iterations, steps_per_generation
        self.num_generations = num_generations  # the completions of each prompt: a resume names a change of it
        self.cycle = steps_per_generation * num_iterations  # the data positions one generation serves
        self.generations_per_epoch, self.steps_per_epoch = self.steps_per_epoch, self.steps_per_epoch * self.cycle

    def micro_batches(self, position: int) -> list[dict]:
        generation, step = divmod(position, self.cycle)
        rows = self.rank_rows(generation).ravel()  # step by step
        batch = self.rows[rows]
        return [{"prompt_ids": [ids.astype(np.int64) for ids in batch["prompt_ids"]], "prompt": list(batch["prompt"]),
                 "fields": list(batch["fields"]), "rows": rows, "generation": generation,
                 "part": step % self.steps_per_generation}]

    settings = {"num_generations": "grpo.num_generations", "num_iterations": "grpo.num_iterations",
                "global_batch_size": "the prompts of a generation (training.global_batch_size / grpo.num_generations "
                                     "x the generation's steps, grpo.generation_batch_size / "
                                     "training.global_batch_size)",
                "seed": "training.seed", "rows": "the prepared data's prompts (data.sources and their filters)"}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "num_iterations": self.num_iterations, "num_generations": self.num_generations}
