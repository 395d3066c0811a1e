"""A reward function that kills the run's vLLM server (kill -9) once, for tests/test_grpo_vllm.py: while the
completions of the generation after optimizer step `step` are scored, the server that listens on `port` is killed,
and `marker` is written so that a resumed run's generation of that step leaves the new server alone."""
import os
import signal
import subprocess
from pathlib import Path


def kill_server(prompts, completions, trainer_state, port: int, step: int, marker: str, **_) -> list[float]:
    if trainer_state.global_step == step and not Path(marker).exists():
        found = subprocess.run(["pgrep", "-f", f"vllm.entrypoints.openai.api_server.*--port {port}"],
                               capture_output=True, text=True)
        for pid in found.stdout.split():
            os.kill(int(pid), signal.SIGKILL)
        Path(marker).write_text(found.stdout)
    return [0.0] * len(completions)
