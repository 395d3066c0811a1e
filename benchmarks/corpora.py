"""Corpora no one here wrote, shared by the data benchmarks."""
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np


def source_files(rng: random.Random) -> Iterator[str]:
    """The installed packages' Python files of 1-50 KB, in a random order: real source code."""
    root = Path(np.__file__).resolve().parent.parent
    files = sorted(p for p in root.rglob("*.py") if 1_000 < p.stat().st_size < 50_000)
    rng.shuffle(files)
    return (p.read_text(errors="replace") for p in files)
