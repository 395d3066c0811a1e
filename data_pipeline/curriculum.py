"""data.phases: a mixture that changes over the run, as OLMo 2 and Llama 3 anneal on high-quality data while the
learning rate decays.

The prepared data holds each source's rows once, every row packed from one source's documents (prepare.py,
pack_by_source) and labelled with it (the `source` column, a ClassLabel of the sources' labels). Each source is read
as a stream: its rows in a seeded order, from the start again once they are used up. A phase of S steps takes
S x global_batch_size rows, split over the sources by its weights (largest remainders: the counts are exact
integers), each source's share being the next rows of its stream. So no row repeats within a phase unless the phase
asks a source for more rows than it holds (upsampling: counted in `passes`), and a later phase goes on with rows the
earlier ones did not take. The phase's rows are put in a seeded random order (or shortest first, or highest score
first: a row's score is the token-weighted mean of its documents'), optionally in buckets, and step s of the phase
takes the next global batch of them.

Everything follows from the data position (the batches consumed), never from an iterator: every layout and a resumed
run see the same rows in the same order. Positions past the last phase (the stability guard passes over batches)
read further phases like the last."""
import math
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from data_pipeline.config import PREPARE_AGAIN, PhaseConfig, check_prepared
from training.base.errors import DataError

SOURCE_STREAM, PHASE_STREAM, BUCKET_STREAM = 7, 8, 9  # SeedSequence streams: each source's, phase's, bucket's order


def phase_steps(phases: list[PhaseConfig], max_steps: int, decay_steps: int, tokens_per_step: int) -> list[int]:
    """Each phase's optimizer steps: its `steps`, its `tokens` in whole steps, the decay's steps, or (one phase
    without a length) what the others leave of max_steps. A ValueError when they do not add up to max_steps."""
    lengths = [decay_steps if phase.steps == "decay" else phase.steps or
               (math.ceil(phase.tokens / tokens_per_step) if phase.tokens else None) for phase in phases]
    open_ended = [index for index, length in enumerate(lengths) if length is None]
    fixed = sum(length for length in lengths if length is not None)
    shown = ", ".join(f"{phase.name} {length if length is not None else 'the rest'}"
                      for phase, length in zip(phases, lengths))
    if len(open_ended) > 1:
        raise ValueError(f"data.phases: {len(open_ended)} phases have no length ({shown}); give all but one steps or "
                         f"tokens")
    if open_ended:
        if fixed >= max_steps:
            raise ValueError(f"data.phases: the phases with a length take {fixed} steps ({shown}), which leaves none "
                             f"of training.max_steps={max_steps} for {phases[open_ended[0]].name}")
        lengths[open_ended[0]] = max_steps - fixed
    elif fixed != max_steps:
        raise ValueError(f"data.phases take {fixed} steps ({shown}) and training.max_steps is {max_steps}; make them "
                         f"equal, or leave one phase without a length to take the rest")
    return lengths


def allocate(total: int, weights: np.ndarray) -> np.ndarray:
    """`total` split in proportion to `weights` as whole numbers that sum to it (largest remainders, ties to the
    first)."""
    share = total * weights / weights.sum()
    counts = np.floor(share).astype(np.int64)
    counts[np.argsort(-(share - counts), kind="stable")[:total - counts.sum()]] += 1
    return counts


def weight_vector(phase: PhaseConfig, labels: list[str]) -> np.ndarray:
    return np.array([phase.weights.get(label, 0.0) for label in labels])


@dataclass(eq=False)  # phases are told apart by identity
class Phase:
    name: str
    steps: int
    first_step: int  # the data position of its first batch
    counts: np.ndarray  # rows from each source
    offsets: np.ndarray  # where in each source's stream they start
    config: PhaseConfig


class PhaseSchedule:
    """Which rows each global batch of a phased run holds (the module's docstring)."""

    def __init__(self, sources: np.ndarray, lengths: np.ndarray, labels: list[str], phases: list[PhaseConfig],
                 steps: list[int], global_batch_size: int, seed: int, scores: np.ndarray | None = None):
        self.sources, self.lengths, self.labels, self.scores = sources, lengths, labels, scores
        self.configs, self.global_batch_size, self.seed = phases, global_batch_size, seed
        self.streams = [np.random.default_rng([seed, SOURCE_STREAM, index]).permutation(
            np.flatnonzero(sources == index)) for index in range(len(labels))]
        self.steps = sum(steps)
        self.phases: list[Phase] = []
        for phase, length in zip(phases, steps):
            self.add_phase(phase, length)
        self._cached: tuple[int, np.ndarray] | None = None
        self._counted = (0, np.zeros(len(labels), dtype=np.int64))  # (position, each source's tokens before it)

    def add_phase(self, config: PhaseConfig, steps: int) -> None:
        weights = weight_vector(config, self.labels)
        empty = [label for label, weight, stream in zip(self.labels, weights, self.streams)
                 if weight and not len(stream)]
        if empty:
            raise DataError(f"data.phases: phase {config.name!r} draws from {', '.join(empty)}, whose prepared rows "
                            f"are none (each source is packed apart: one with less than data.seq_len tokens fills no "
                            f"row); add data to it or give it no weight")
        last = self.phases[-1] if self.phases else None
        offsets = last.offsets + last.counts if last else np.zeros(len(self.labels), dtype=np.int64)
        self.phases.append(Phase(config.name, steps, last.first_step + last.steps if last else 0,
                                 allocate(steps * self.global_batch_size, weights), offsets, config))

    def phase_at(self, position: int) -> Phase:
        """The phase whose batch is at this data position (past the last: as many more like it as needed)."""
        while position >= self.phases[-1].first_step + self.phases[-1].steps:
            self.add_phase(self.configs[-1], self.phases[-1].steps)
        return next(phase for phase in reversed(self.phases) if position >= phase.first_step)

    def source_part(self, phase: Phase, source: int) -> np.ndarray:
        """The rows the phase takes from one source: the next `count` of its stream, wrapping around."""
        stream = self.streams[source]
        return stream[(phase.offsets[source] + np.arange(phase.counts[source])) % len(stream)]

    def phase_rows(self, phase: Phase) -> np.ndarray:
        """The phase's rows in the order its steps take them."""
        index = self.phases.index(phase)
        if self._cached and self._cached[0] == index:
            return self._cached[1]
        rows = np.concatenate([self.source_part(phase, source) for source, count in enumerate(phase.counts)
                               if count])
        rows = np.random.default_rng([self.seed, PHASE_STREAM, index]).permutation(rows)
        if phase.config.order != "shuffled":
            rows = self.ordered(rows, phase.config, index)
        self._cached = (index, rows)
        return rows

    def ordered(self, rows: np.ndarray, config: PhaseConfig, index: int) -> np.ndarray:
        """A phase's rows (in their seeded order, which breaks ties) with the fewest real tokens or the highest
        scores first (unscored rows last); with buckets, cut into that many equal parts, read in order, each in a
        seeded random order: a curriculum in stages."""
        key = self.lengths[rows] if config.order == "shortest_first" else np.nan_to_num(-self.scores[rows], nan=np.inf)
        rows = rows[np.argsort(key, kind="stable")]
        if not config.buckets:
            return rows
        rng = np.random.default_rng([self.seed, BUCKET_STREAM, index])
        return np.concatenate([rng.permutation(part) for part in np.array_split(rows, config.buckets)])

    def global_rows(self, position: int) -> np.ndarray:
        phase = self.phase_at(position)
        start = (position - phase.first_step) * self.global_batch_size
        return self.phase_rows(phase)[start:start + self.global_batch_size]

    def source_tokens(self, position: int) -> np.ndarray:
        """Each source's real tokens in the batches before this data position (counted on from the last call)."""
        counted, tokens = self._counted
        if position < counted:
            counted, tokens = 0, np.zeros(len(self.labels), dtype=np.int64)
        tokens = tokens.copy()
        while counted < position:
            phase = self.phase_at(counted)
            end = min(position, phase.first_step + phase.steps)
            rows = self.phase_rows(phase)[(counted - phase.first_step) * self.global_batch_size:
                                          (end - phase.first_step) * self.global_batch_size]
            tokens += np.bincount(self.sources[rows], weights=self.lengths[rows],
                                  minlength=len(self.labels)).astype(np.int64)
            counted = end
        self._counted = (position, tokens)
        return tokens

    def metrics(self, position: int) -> dict:
        """metrics.jsonl's fields for the step that read the batch before `position`: its phase, and each source's
        tokens so far."""
        return {"phase": self.phase_at(max(0, position - 1)).name,
                "source_tokens": dict(zip(self.labels, map(int, self.source_tokens(position))))}

    def table(self) -> list[str]:
        """The phases as planned on this data: steps, and each source's rows, tokens and passes over its rows."""
        lines = ["data phases (rows per source; passes: the share of the source's rows the phase reads, over 1 "
                 "when it upsamples):"]
        for phase in self.phases[:len(self.configs)]:
            cells = []
            for source, (label, count, stream) in enumerate(zip(self.labels, phase.counts, self.streams)):
                if count:
                    rows = self.source_part(phase, source)
                    cells.append(f"{label} {count:,} rows, {int(self.lengths[rows].sum()):,} tokens, "
                                 f"{count / len(stream):.2f} passes")
            lines.append(f"  {phase.name}: steps {phase.first_step + 1}-{phase.first_step + phase.steps}: "
                         + "; ".join(cells))
        return lines

    def state_dict(self) -> list:
        """What the positions mean: each phase's name, steps, weights and order (and buckets, when it has them)."""
        return [[phase.name, phase.steps, dict(config.weights), config.order, *filter(None, [config.buckets])]
                for phase, config in zip(self.phases, self.configs)]


def planned_table(phases: list[PhaseConfig], steps: list[int], labels: list[str], global_batch_size: int,
                  seq_len: int) -> list[str]:
    """--dry-run's phases, before any data is prepared: each source's rows and tokens (rows x seq_len)."""
    lines, first = ["data phases (rows per source, x data.seq_len tokens):"], 1
    for phase, length in zip(phases, steps):
        counts = allocate(length * global_batch_size, weight_vector(phase, labels))
        lines.append(f"  {phase.name}: steps {first}-{first + length - 1}: " + "; ".join(
            f"{label} {count:,} rows, {count * seq_len:,} tokens" for label, count in zip(labels, counts) if count))
        first += length
    return lines


def row_labels(features: datasets.Features) -> list[str]:
    """The source labels of prepared rows packed by source, or a DataError saying how to make such rows."""
    feature = features.get("source")
    if not isinstance(feature, datasets.ClassLabel):
        raise DataError("data.phases draws each phase's rows from the sources, and the prepared rows mix them "
                        "(prepared without data.phases); prepare the data with data.phases set")
    return list(feature.names)


def prepared_labels(folder: Path) -> list[str]:
    """The source labels of a prepared folder, read from its train split's dataset_info.json (no rows loaded)."""
    check_prepared(folder, PREPARE_AGAIN)
    return row_labels(datasets.DatasetInfo.from_directory(str(folder / "train")).features)


def phase_schedule(rows: datasets.Dataset, phases: list[PhaseConfig], steps: list[int], global_batch_size: int,
                   seed: int) -> PhaseSchedule:
    """The schedule over prepared rows; a DataError when a phase weights a label the rows do not have."""
    labels = row_labels(rows.features)
    for phase in phases:
        unknown = sorted(set(phase.weights) - set(labels))
        if unknown:
            raise DataError(f"data.phases: phase {phase.name!r} weights {', '.join(unknown)}, and the prepared "
                            f"data's sources are labelled {', '.join(labels)}")
    table = rows.data.table
    sources = table.column("source").to_numpy()
    scores = table.column("score").to_numpy() if "score" in table.column_names else None
    for phase in phases:
        if phase.order != "highest_score_first":
            continue
        unscored = [label for index, label in enumerate(labels) if phase.weights.get(label) and
                    (scores is None or np.isnan(scores[sources == index]).all())]
        if unscored:
            raise DataError(f"data.phases: phase {phase.name!r} orders its rows by their documents' scores, and the "
                            f"prepared rows of {', '.join(unscored)} carry none; prepare the data with data.sources' "
                            f"score_field (or a classifier filter) for them")
    return PhaseSchedule(sources, table.column("length").to_numpy().astype(np.int64), labels, phases, steps,
                         global_batch_size, seed, scores)
