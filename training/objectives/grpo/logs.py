"""What a GRPO run logs of a generation beside the loss's metrics: TRL's metrics of its rewards and completions
(generation_metrics), the reward functions' log_metric values (logged_metrics), and its samples with their
log_extra columns in completions.jsonl (log_samples)."""
import json
from pathlib import Path

import torch
import torch.distributed as dist

from training.base.errors import DataError
from training.base.strict_json import dumps
from training.objectives.grpo.loss import nanstd
from training.objectives.grpo.rewards import RewardLog
from training.objectives.grpo.rollout import Rollout
from training.parallel import distributed


def generation_metrics(names: list[str], per_function: torch.Tensor, rewards: torch.Tensor, std: torch.Tensor,
                       lengths: torch.Tensor, truncated: torch.Tensor, generations: int) -> dict:
    """TRL's metrics of a generation, over the global batch of groups of `generations` (`names`: the reward
    functions')."""
    ended = lengths[~truncated]
    return {
        "reward": rewards.nanmean().item(),
        "reward_std": nanstd(rewards).item(),  # TRL's: over the whole generation, not the groups' mean
        "frac_reward_zero_std": (std.view(-1, generations)[:, 0] < 1e-6).float().mean().item(),
        **{f"rewards/{name}/mean": per_function[:, i].nanmean().item() for i, name in enumerate(names)},
        **{f"rewards/{name}/std": nanstd(per_function[:, i]).nan_to_num().item()  # 0 under 2 values (TRL: NaN)
           for i, name in enumerate(names)},
        "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.float().mean().item(),
        **({"completions/mean_terminated_length": ended.mean().item(),
            "completions/min_terminated_length": ended.min().item(),
            "completions/max_terminated_length": ended.max().item()} if len(ended) else {})}


def logged_metrics(log: RewardLog) -> dict[str, float]:
    """The reward functions' log_metric values of a generation: each name's mean over every call on every rank (TRL's),
    the names gathered so that every rank reduces the same ones in the same order."""
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(log.metrics))
    names = sorted(set().union(*names))
    if not names:
        return {}
    sums = distributed.all_reduce_on_host([value for name in names for value in
                                           (sum(log.metrics.get(name, [])), len(log.metrics.get(name, [])))])
    return {name: sums[2 * i] / sums[2 * i + 1] for i, name in enumerate(names)}


def extra_columns(log: RewardLog, count: int) -> dict[str, list]:
    """The reward functions' log_extra columns of a rank's `count` completions; a DataError names one of another
    length."""
    for column, values in log.columns.items():
        if len(values) != count:
            raise DataError(f"a reward function's log_extra({column!r}, ...) gave {len(values)} values for {count} "
                            f"completions; give one per completion")
    return log.columns


def log_samples(path: Path, generation: int, rollout: Rollout, rewards: torch.Tensor, names: list[str],
                in_order: list[int], ranks_per_replica: int, rewrite: bool) -> None:
    """Every rank's prompts, completions, rewards (each reward function's by `names` too) and the reward functions'
    log_extra columns appended to `path` by rank 0 in the prompts' order (`in_order`: the indices of the ranks'
    records, rank by rank, in it; the records of one rank in every `ranks_per_replica`); with `rewrite`, the lines of a
    generation at or past this one, from before a resume, are dropped first."""
    columns = extra_columns(rollout.log, len(rollout.texts))
    records = [{"generation": generation, "prompt": p, "completion": c, "reward": float(r),
                **{name: float(v) for name, v in zip(names, values)},
                **{column: values[index] for column, values in columns.items()}}
               for index, (p, c, r, values) in enumerate(zip(rollout.prompts, rollout.texts, rewards.tolist(),
                                                             rollout.per_function.tolist()))]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() != 0:
        return
    if rewrite:
        kept = [line for line in path.read_text().splitlines()
                if json.loads(line)["generation"] < generation] if path.exists() else []
        path.write_text("".join(line + "\n" for line in kept))
    rank_by_rank = [record for rank_records in gathered[::ranks_per_replica] for record in rank_records]
    with path.open("a") as file:
        file.writelines(dumps(rank_by_rank[index]) + "\n" for index in in_order)
