"""The stored reference: every pair's log-probabilities under the starting model, computed in one pass before step 1
and kept with the run (reference_logps.npz), which a resumed run reads again."""
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist

from data_pipeline.loader import EvalPairBatches, PairBatches
from training.base.errors import ConfigError, DataError
from training.compat.datasets import fingerprint
from training.objectives.dpo.preference_loss import PreferenceLoss, pair_logps
from training.objectives.dpo.spec import REFERENCE_FILE, DpoSection
from training.parallel import distributed


def training_layout(batches: PairBatches) -> Iterator[dict]:
    """Every training pair once, in this rank's micro-batches: first epoch 0's as the steps read them (the same
    packed rows, so that until the first update the policy's values equal the reference's exactly and step 1's
    rewards are 0, as TRL's), then the pairs that epoch 0 leaves out."""
    for position in range(batches.steps_per_epoch):
        yield from batches.micro_batches(position)
    left_out = batches.epoch_order(0)[batches.steps_per_epoch * batches.global_batch_size:]
    if len(left_out):
        yield from EvalPairBatches(batches.rows, batches.micro_batch_size, batches.dp_rank, batches.dp_size,
                                   batches.seq_len, batches.pad_id, batches.packing, indices=left_out)


def reference_pass(engine: deepspeed.DeepSpeedEngine, micro_batches: Iterable[dict], count: int,
                   ld_alpha: float | None) -> np.ndarray:
    """[count, 2] log-probabilities (chosen, rejected) of every pair under the engine's current weights: each
    data-parallel rank its share, gathered by a sum."""
    values = torch.zeros((count, 2), dtype=torch.float64, device=engine.device)
    engine.eval()
    with torch.no_grad():
        for batch in micro_batches:
            logps = pair_logps(engine, batch, engine.device, ld_alpha)[0].double()
            real = batch["real"].to(engine.device)
            values[batch["pair_index"].to(engine.device)[real]] = logps[real]
    engine.train()
    return distributed.all_reduce(values).cpu().numpy()


def start_preference(engine: deepspeed.DeepSpeedEngine, section: DpoSection, lora: bool, output_dir: Path,
                     batches: PairBatches, evaluation: EvalPairBatches | None, resume: bool,
                     live: torch.nn.Module | None = None) -> PreferenceLoss:
    """The loss, with every pair's reference values in `batches` (and `evaluation`): read from the run's
    reference_logps.npz when resuming, else computed now by the starting model and written there. Under LoRA, and
    with a `live` reference model (sync_ref_model), none."""
    if lora or live is not None:
        return PreferenceLoss(section, adapters_off=lora, reference_seconds=None, live=live)
    path, started = output_dir / REFERENCE_FILE, time.perf_counter()
    if resume:
        stored = read_reference(path, batches, section.ld_alpha)
    else:
        stored = {"train": reference_pass(engine, training_layout(batches), len(batches.rows), section.ld_alpha),
                  **({"eval": reference_pass(engine, evaluation, len(evaluation.rows), section.ld_alpha)}
                     if evaluation else {})}
        if dist.get_rank() == 0:
            partial = path.with_name(f"{path.stem}.partial.npz")
            np.savez(partial, data=np.array(fingerprint(batches.rows)), ld_alpha=np.array(ld_key(section.ld_alpha)),
                     **stored)
            os.replace(partial, path)  # a kill leaves the old file or the new one whole
    batches.reference = stored["train"]
    if evaluation:
        evaluation.reference = stored["eval"]
    return PreferenceLoss(section, adapters_off=False, reference_seconds=None if resume else
                          time.perf_counter() - started)


def ld_key(ld_alpha: float | None) -> str:
    """How reference_logps.npz records the ld_alpha its values were summed with."""
    return "null" if ld_alpha is None else repr(float(ld_alpha))


def read_reference(path: Path, batches: PairBatches, ld_alpha: float | None) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise DataError(f"{path} is missing: a resumed DPO run needs the reference log-probabilities its first start "
                        f"computed (the starting model's weights are gone from the checkpoints); start the run again "
                        f"without --resume, or, if it was started with dpo.sync_ref_model=true (its checkpoints hold "
                        f"the reference), resume with that")
    with np.load(path) as stored:
        if str(stored["data"]) != fingerprint(batches.rows) or len(stored["train"]) != len(batches.rows):
            raise DataError(f"{path} holds reference values for other prepared pairs than this run's: resume with the "
                            f"data the run started with")
        summed_with = str(stored["ld_alpha"]) if "ld_alpha" in stored.files else ld_key(None)
        if summed_with != ld_key(ld_alpha):
            raise ConfigError(f"{path} holds reference values summed with dpo.ld_alpha={summed_with}, not "
                              f"{ld_key(ld_alpha)}: resume with the ld_alpha the run started with")
        return {name: stored[name] for name in stored.files if name not in ("data", "ld_alpha")}
