"""A generation's completions as the model trains on them: the rank's Rollout (prompts, completions, rewards), its
completions after their prompts as a micro-batch's rows (completion_rows), and the completion tokens'
log-probabilities in the completions' own layout (unpack, completion_logps)."""
from typing import NamedTuple

import numpy as np
import torch

from data_pipeline.pack import best_fit_decreasing
from training.objectives.grpo.loss import token_logps
from training.objectives.grpo.rewards import RewardLog


class Rollout(NamedTuple):
    """A rank's prompts (each repeated for its group), their completions and every reward function's scores."""
    prompt_ids: list[torch.Tensor]
    prompts: list  # as the data gave them (strings or chat messages)
    completions: list[torch.Tensor]
    texts: list[str]
    truncated: list[bool]
    per_function: torch.Tensor  # [completions, functions], NaN: no opinion
    log: RewardLog  # what the reward functions logged (log_metric, log_extra)
    sampling_logps: list[torch.Tensor] | None = None  # the engine's log-probability of each completion token, where
    # it reports them (vllm)


def completion_rows(prompts: list[torch.Tensor], completions: list[torch.Tensor], pad_id: int, seq_len: int,
                    packing: str) -> dict:
    """A micro-batch's completions, each after its prompt, as the model's rows: one per row right-padded to the
    longest (packing none), or packed whole into rows of at most seq_len, best-fit decreasing (bfd), each keeping
    its own positions (restarting at 0), so no token attends to another sequence's. `slots` maps every position
    whose next token is a completion's to that token's place in the completions' own [completions, longest
    completion] layout (-1 elsewhere), where the loss is computed (unpack): packed or not, the loss sees the same
    tensors. `length` is each row's real tokens."""
    lengths = np.array([len(p) + len(c) for p, c in zip(prompts, completions)], dtype=np.int64)
    if packing == "bfd":
        rows, offsets = best_fit_decreasing(lengths, seq_len)
    else:
        rows, offsets = np.arange(len(lengths)), np.zeros(len(lengths), dtype=np.int64)
    fill = np.bincount(rows, weights=lengths).astype(np.int64)
    width, longest = int((offsets + lengths).max()), max(len(c) for c in completions)
    input_ids = torch.full((len(fill), width), pad_id, dtype=torch.long)
    position_ids = torch.arange(width).repeat(len(fill), 1)  # a row's padding continues its last sequence's
    if packing == "bfd":  # or, packed, restarts at 0: the padding is a sequence of its own, seen by none
        position_ids = (position_ids - torch.from_numpy(fill)[:, None]).clamp(min=0)
    slots = torch.full((len(fill), width - 1), -1, dtype=torch.long)
    mask = torch.zeros(len(completions), longest, dtype=torch.bool)
    for index, (prompt, completion, row, offset) in enumerate(zip(prompts, completions, rows.tolist(),
                                                                  offsets.tolist())):
        end = offset + len(prompt) + len(completion)
        input_ids[row, offset:end] = torch.cat([prompt, completion])
        position_ids[row, offset:end] = torch.arange(end - offset)
        slots[row, offset + len(prompt) - 1:end - 1] = index * longest + torch.arange(len(completion))
        mask[index, :len(completion)] = True
    return {"input_ids": input_ids, "position_ids": position_ids, "slots": slots, "completion_mask": mask,
            "length": torch.from_numpy(fill)}


def completion_values(values: list[torch.Tensor], completion_mask: torch.Tensor) -> torch.Tensor:
    """Per-token values of a micro-batch's completions in their layout [completions, longest completion], NaN past
    each one's end."""
    out = torch.full(completion_mask.shape, float("nan"))
    for row, value in enumerate(values):
        out[row, :len(value)] = value
    return out


def unpack(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """Per-position values of the rows ([rows, width - 1], position t scoring token t + 1) in the completions' own
    layout [completions, longest completion], zero where a completion has ended (completion_rows' `slots`)."""
    slots = batch["slots"].to(values.device)
    taken = slots >= 0
    shape = batch["completion_mask"].shape
    flat = values.new_zeros(shape.numel()).index_put((slots[taken],), values[taken])
    return flat.view(shape)


def completion_logps(model: torch.nn.Module, batch: dict, device: torch.device, temperature: float,
                     entropy_gradient: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-probability (from the logits before it) and the entropy of the distribution it
    was drawn from (token_logps), in the completions' layout [completions, longest completion]
    (batch["completion_mask"] marks the tokens)."""
    logits = model(input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device),
                   use_cache=False).logits  # with a cache transformers would not mask packed sequences apart
    logps, entropies = token_logps(logits[:, :-1], batch["input_ids"][:, 1:].to(device), temperature,
                                   entropy_gradient)
    return unpack(logps, batch), unpack(entropies, batch)
