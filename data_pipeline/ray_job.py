"""The datatrove job on a Ray cluster: connect to it, then run the stages one after another, each to its end.

datatrove's Ray executor runs a stage's tasks and returns when they have ended; a task whose node is lost (a
worker killed, a node gone) is submitted again, up to 3 times. Its `depends` chain, though, waits in 2-minute
sleeps for a stage whose task failed for good, forever: here each stage runs on its own, and a stage that ends with
unfinished tasks stops the job, naming them and their logs. The job's code (this package and training/) goes to
the nodes with it (Ray's py_modules), so a node needs the same Python packages, not this checkout. The tasks'
temporary logs (datatrove writes them under the worker's temporary folder before copying them to the job's logs)
go to the job's own folder, so the job writes nothing outside it; the cluster's session files are the cluster's
(`ray start --temp-dir`).
"""
import os
from pathlib import Path

from training.base.errors import DataError

DEFAULT_ADDRESS = "auto"  # the cluster this machine started or joined with `ray start`


def connect(temporary: Path) -> None:
    """Join the running cluster (RAY_ADDRESS, else the one `ray start` left on this machine) before anything is
    written; its tasks' temporary folder is `temporary` (the caller makes it, in the job's folder)."""
    import ray

    import data_pipeline
    import training
    address = os.environ.get("RAY_ADDRESS", DEFAULT_ADDRESS)
    runtime = {"py_modules": [data_pipeline, training], "env_vars": {"TMPDIR": str(temporary)}}
    try:
        ray.init(address=address, runtime_env=runtime, log_to_driver=False)
    except ConnectionError as error:
        raise DataError(f"--executor ray: no Ray cluster at {address} ({error}); start one (ray start --head) or "
                        f"join one (ray start --address HEAD:6379) on this machine, or name it in RAY_ADDRESS") \
            from None


def run_stages(executors: list[tuple[str, object]], logs_of) -> None:
    """Each stage's executor (no `depends`) to its end; unfinished tasks stop the job, naming the stage and them."""
    for name, executor in executors:
        executor.run()
        if unfinished := executor.get_incomplete_ranks(range(executor.world_size)):
            raise DataError(f"the datatrove stage {name} ended with task(s) {', '.join(map(str, unfinished))} "
                            f"unfinished (their logs: {logs_of(name)}/logs); run the same command again: finished "
                            f"tasks are skipped")
