"""distill's sampled sequences (GKD): with distill.lmbda > 0 each conversation of a step is, with probability lmbda,
the student's own completion of its prompt (on-policy), and with distill.seq_kd the others are the teacher's (
sequence-level KD); the rest stay the data's. The prompt is a row's tokens before its first target token (the chat
template's prompt, up to the assistant's turn); the sample replaces what follows, its tokens the targets, and ends at
EOS (kept) or after max_new_tokens, or where the row ends (data.seq_len). A row is one conversation (data.packing=none,
which the check asks for), so a step's rows keep their count and width: the memory plan's.

Samples come from GRPO's sampling path (training/objectives/grpo/sampling.py: `sample`, one seeded random stream per
completion, at distill.temperature), in one batch per model and rank each step. Both the draw and the stream are
seeded by (training.seed, the data position, the row's index in the data), not by where the row lands: every layout
and a resumed run sample the same sequences. Under ZeRO-3 every rank samples in each step, together (generate's
synced_gpus), a throwaway prompt where it has none."""
import numpy as np
import torch

from data_pipeline.loader import StepBatches
from training.objectives.distill.spec import DistillSection, sampling_section
from training.objectives.grpo.sampling import decoding, sample, sampling_seed
from training.objectives.grpo.spec import GrpoSection

IGNORE = -100
DRAW_STREAM = 5  # the draws' SeedSequence stream (GRPO's completions take 3 and 4)


class SeededRows(StepBatches):
    """StepBatches whose micro-batches also carry each row's index in the data (`row`) and the data position
    (`position`), which seed the sampled sequences."""

    def micro_batches(self, position: int) -> list[dict[str, torch.Tensor]]:
        batches = super().micro_batches(position)
        for batch, rows in zip(batches, self.rank_rows(position), strict=True):
            batch["row"], batch["position"] = torch.from_numpy(np.sort(rows)), torch.tensor(position)
        return batches


def sampler(row_seed: list[int], lmbda: float, seq_kd: bool) -> str | None:
    """Who completes the row whose stream is `row_seed`: "student" (probability lmbda), else "teacher" with seq_kd,
    else None (the data's completion)."""
    if np.random.default_rng(row_seed).random() < lmbda:
        return "student"
    return "teacher" if seq_kd else None


def prompt_end(labels: torch.Tensor, length: int) -> int | None:
    """Where a row's first target token is (the prompt before it), or None where it has none or no prompt."""
    targets = (labels[:length] != IGNORE).nonzero()
    return int(targets[0]) if len(targets) and int(targets[0]) > 0 else None


def sample_sequences(micro_batches: list[dict], section: DistillSection, seed: int, models: dict, zero3: bool,
                     attention: str, eos_id: int, pad_id: int) -> tuple[list[dict], dict[str, int]]:
    """The step's micro-batches with the drawn rows' completions sampled, and how many rows each model completed:
    `models` maps "student" and "teacher" to the module that generates."""
    jobs = {"student": [], "teacher": []}
    for index, batch in enumerate(micro_batches):
        position = int(batch["position"])
        for row, data_row in enumerate(batch["row"].tolist()):
            end = prompt_end(batch["labels"][row], int(batch["length"][row]))
            who = sampler([seed, DRAW_STREAM, position, data_row], section.lmbda, section.seq_kd) if end else None
            if who:
                jobs[who].append((index, row, end, sampling_seed(seed, position, data_row, 0)))
    batches = [{**batch, **{name: batch[name].clone() for name in ("input_ids", "labels", "length")}}
               for batch in micro_batches]
    settings, needed = sampling_section(section), {"student": section.lmbda > 0, "teacher": section.seq_kd}
    for who, rows in jobs.items():
        if not needed[who] or not (rows or zero3):  # under ZeRO-3 every rank samples together
            continue
        prompts = [batches[index]["input_ids"][row, :end] for index, row, end, _ in rows] or [torch.tensor([eos_id])]
        seeds = [stream for *_, stream in rows] or [0]
        completions = generate(models[who], prompts, seeds, settings, zero3, attention, eos_id, pad_id)
        for (index, row, end, _), completion in zip(rows, completions):
            replace_completion(batches[index], row, end, completion, pad_id)
    return batches, {who: len(rows) for who, rows in jobs.items()}


def generate(module: torch.nn.Module, prompts: list[torch.Tensor], seeds: list[int], settings: GrpoSection,
             zero3: bool, attention: str, eos_id: int, pad_id: int) -> list[torch.Tensor]:
    """One seeded completion per prompt, in eval mode (the mode it was in after)."""
    device, training = next(module.parameters()).device, module.training
    module.eval()
    with decoding(module, attention, settings.engine):
        completions, _ = sample(module, [prompt.to(device) for prompt in prompts], seeds, settings, eos_id, pad_id,
                                synced=zero3)
    module.train(training)
    return completions


def replace_completion(batch: dict, row: int, end: int, completion: torch.Tensor, pad_id: int) -> None:
    """Row `row` of the micro-batch (its tensors the batch's own) becomes its prompt (its first `end` tokens) and
    `completion`, cut at the row's width, padded after; the completion's tokens are the targets."""
    kept = completion[:batch["input_ids"].shape[1] - end]
    batch["input_ids"][row, end:] = pad_id
    batch["input_ids"][row, end:end + len(kept)] = kept
    batch["labels"][row, end:] = IGNORE
    batch["labels"][row, end:end + len(kept)] = kept
    batch["length"][row] = end + len(kept)
