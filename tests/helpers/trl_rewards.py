"""A reward function of TRL's whole signature, for tests/test_grpo_trl.py: it reads completion_ids and
trainer_state, and logs through log_metric and log_extra."""


def progress(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **_) -> list[float]:
    """Each completion's token count, scaled by the optimizer steps done; logs those steps and the mean count, and
    each completion's count as a column."""
    counts = [len(ids) for ids in completion_ids]
    log_metric("progress/steps_done", trainer_state.global_step)
    log_metric("progress/mean_ids", sum(counts) / len(counts))
    log_extra("ids", counts)
    return [count * (1 + trainer_state.global_step) / 10 for count in counts]
