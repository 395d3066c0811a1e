"""train.py (or a script wrapping it) run as users run it, through DeepSpeed's own `deepspeed` launcher: for the
tools, benchmarks and tests that start runs, and for reading why a run failed from its console log."""
import re
import shutil
import socket
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_command(ranks: int, script: str, args: list[str], port: int | None = None) -> list[str]:
    """`deepspeed --num_gpus ranks --master_port port script args`, with the launcher of this Python's
    environment (else the one on PATH: packages installed with `pip --target` put it elsewhere) and a free port
    unless one is given."""
    beside = Path(sys.executable).parent / "deepspeed"
    launcher = str(beside) if beside.exists() else shutil.which("deepspeed") or str(beside)
    return [launcher, "--num_gpus", str(ranks), "--master_port", str(port or free_port()), script, *args]


def failure_reason(log: str) -> str:
    """The line of a failed run's console log that says why: train.py's own 'error: ...' report, an out-of-memory
    error, the last exception, a kill, else the last line."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line.strip()) for line in log.splitlines()
             if line.strip() and "CalledProcessError" not in line]  # that one is a launcher's report of its child
    for pattern in (r"^error: ", r"OutOfMemoryError|CUDA out of memory", r"^\w+(\.\w+)*(Error|Exception)\b.*:",
                    r"\bKilled\b"):
        hits = [line for line in lines if re.search(pattern, line)]
        if hits:
            return re.sub(r"\s+", " ", hits[-1].removeprefix("error: "))[:300]
    return lines[-1][:300] if lines else "no output"
