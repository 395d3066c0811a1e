import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from training.distributed import free_port  # noqa: E402

# A 2-layer, 64-wide shrink of tiny_llama: the same code path in seconds.
SMALL_MODEL = ("model.config_overrides={num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
               "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}")


def run_train(args: list[str], ranks: int | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """train.py as users run it: through the `deepspeed` launcher with `ranks` ranks, or plain `python train.py`."""
    if ranks is None:
        command = [sys.executable, "train.py"]
    else:
        launcher = Path(sys.executable).parent / "deepspeed"
        command = [str(launcher), "--num_gpus", str(ranks), "--master_port", str(free_port()), "train.py"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(command + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """One prepared-data cache for the whole session, so each run does not re-tokenize the corpus."""
    return f"data.cache_dir={tmp_path_factory.mktemp('data_cache')}"
