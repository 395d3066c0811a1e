"""Rewrite the --dry-run plans quoted in the Markdown files, and those stored under recipes/*/measured/ and
benchmarks/results/, from the commands that head them.

    python tools/refresh_plans.py           # rewrite every quoted plan that differs from its command's output
    python tools/refresh_plans.py --check   # only list them (exit 1 if any): tests/test_docs.py

A quoted plan is a ``` block whose first line is `$ python train.py ... --dry-run ...`; the lines after it
are that command's output, run here in-process (a dry run builds nothing: seconds per plan). The plans
quoted use --num-gpus and --gpu-mem, so they do not depend on the machine (but for the tokenizer line of the
model recipes, which says whether the hub tokenizer is in the local cache); the output folder they print is
the default one of a fresh checkout.
"""
import contextlib
import io
import os
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import train  # noqa: E402
from training.state import output_dir  # noqa: E402

BLOCK = re.compile(r"```\n(\$ python train\.py [^\n]*)\n(.*?)```", re.S)


def markdown_files() -> list[Path]:
    return sorted([REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("recipes/*/README.md"),
                   REPO / "benchmarks/README.md"])


def stored_plans() -> list[Path]:
    """Plan files: a `$ python train.py ... --dry-run` line, then what it printed."""
    return sorted(path for path in [*REPO.glob("recipes/*/measured/*.txt"), *REPO.glob("benchmarks/results/**/*.txt")]
                  if path.read_text().startswith("$ python train.py")
                  and "--dry-run" in path.read_text().split("\n")[0])


def plan_output(command: str) -> str:
    """What `command` ($ python train.py ...) prints, as it prints it in a fresh checkout (no earlier runs)."""
    args = shlex.split(command)[3:]
    holds_run, output_dir.holds_run = output_dir.holds_run, lambda path: False
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            code = train.main(args)
    finally:
        output_dir.holds_run = holds_run
    if code != 0 or "--dry-run" not in args:
        raise SystemExit(f"{command}: not a dry run that succeeds (exit {code})")
    return out.getvalue()


def refreshed(text: str) -> str:
    return BLOCK.sub(lambda block: f"```\n{block.group(1)}\n{plan_output(block.group(1))}```", text)


def refreshed_plan(text: str) -> str:
    command = text.split("\n")[0]
    return f"{command}\n{plan_output(command)}"


def main() -> int:
    check = "--check" in sys.argv[1:]
    os.chdir(REPO)  # the plans print paths relative to the repository
    stale = []
    for path in markdown_files() + stored_plans():
        text = path.read_text()
        new = refreshed(text) if path.suffix == ".md" else refreshed_plan(text)
        if new != text:
            stale.append(path.relative_to(REPO))
            if not check:
                path.write_text(new)
    for path in stale:
        print(f"{'stale' if check else 'rewritten'}: {path}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
