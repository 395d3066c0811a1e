"""benchmarks/train_overhead.py end to end at the smallest size: every loop trains and the table comes out
(speed is the benchmark's to measure, not a test's)."""
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, TRAIN_ENV

pytestmark = pytest.mark.slow


def test_train_py_and_the_bare_loop_both_run(data_cache):
    result = subprocess.run([sys.executable, "benchmarks/train_overhead.py", "--steps", "3", "--repeats", "1",
                             data_cache], cwd=REPO, env=TRAIN_ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert re.search(r"\| train\.py \| [\d,]+ \| [\d,]+ \| [\d.]+ \|", result.stdout), result.stdout
    assert re.search(r"\| train\.py, stability off \| [\d,]+ \| [\d,]+ \| [\d.]+ \|", result.stdout), result.stdout
    assert re.search(r"\| bare loop \| [\d,]+ \| [\d,]+ \| 1\.000 \|", result.stdout), result.stdout
