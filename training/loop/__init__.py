"""The training loop's parts: the engine, optimizer and schedule, metrics, health signals, evaluation, stability."""
