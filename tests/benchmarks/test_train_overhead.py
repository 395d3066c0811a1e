"""benchmarks/train_overhead.py end to end at the smallest size: every loop trains and the table comes out
(speed is the benchmark's to measure, not a test's). Its runs go to the session's warm ranks in place of the
`deepspeed` launcher (launcher_command: tests/training/parallel/test_launch.py): the loops, not the launch, are the
subject."""
import re
import sys

import pytest

from tests.conftest import REPO, main_in_process, run_train

sys.path.insert(0, str(REPO / "benchmarks"))
import train_overhead  # noqa: E402

pytestmark = pytest.mark.slow


def test_train_py_and_the_bare_loop_both_run(data_cache, monkeypatch):
    def on_warm_ranks(script: str, args: list[str], num_gpus: int) -> None:
        result = run_train(args, ranks=num_gpus, script=script)
        assert result.returncode == 0, f"{script}: " + result.stdout[-2000:] + result.stderr[-3000:]

    monkeypatch.setattr(train_overhead, "launch", on_warm_ranks)
    result = main_in_process(train_overhead.main, ["--steps", "3", "--repeats", "1", data_cache])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert re.search(r"\| train\.py \| [\d,]+ \| [\d,]+ \| [\d.]+ \|", result.stdout), result.stdout
    assert re.search(r"\| train\.py, stability off \| [\d,]+ \| [\d,]+ \| [\d.]+ \|", result.stdout), result.stdout
    assert re.search(r"\| bare loop \| [\d,]+ \| [\d,]+ \| 1\.000 \|", result.stdout), result.stdout
