"""Turn a recipe's `data:` section into training-ready packed rows. Never imports DeepSpeed."""


def processes(num_proc: int) -> int | None:
    """`num_proc` for `datasets.map`: datasets 5 starts a process pool even for 1, which a datatrove
    worker (a daemon process) may not; None maps in this process."""
    return num_proc if num_proc > 1 else None
