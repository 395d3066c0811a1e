"""The training loop's parts: optimizer and schedule, metrics, evaluation, stability."""
