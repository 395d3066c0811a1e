"""`ruff check` over the repository is clean (pyproject.toml's [tool.ruff]: sorted imports, pyflakes, pycodestyle's
errors, 120-character lines): part of the test command, so CI fails on a lint error as on any other failure."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).with_name("ruff")
    result = subprocess.run([str(ruff), "check", "--no-cache", "--output-format", "concise", str(REPO)],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, f"ruff check found problems (fix them, or `ruff check --fix`):\n{result.stdout}"
