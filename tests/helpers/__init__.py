"""Scripts the tests start through the deepspeed launcher, each rank a process."""
import os
import sys
from collections.abc import Callable

from training.parallel.distributed import run_in_process_group


def end_process(code: int = 0) -> None:
    """Leave as train.py does once everything is written: without interpreter teardown, which can abort a finished
    process of several CPU ranks ("terminate called without an active exception", about 1 run in 50)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def ranks_main(compare: Callable[..., None]) -> Callable[[list[str]], int]:
    """A helper's main(argv), as the launcher's ranks and the warm ranks (tests/warm_ranks.py) call it: `compare`
    with argv's positional arguments (the launcher's --local_rank dropped) in the launcher's process group, which a
    failure on any rank ends and which is torn down after."""
    def main(argv: list[str]) -> int:
        args = [arg for arg in argv if not arg.startswith("--local_rank")]

        def body() -> int:
            compare(*args)
            return 0

        return run_in_process_group(body)

    return main
