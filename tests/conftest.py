import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from training.parallel.launch import launcher_command  # noqa: E402

# A 2-layer, 64-wide shrink of tiny_llama: the same code path in seconds.
SMALL_MODEL = ("model.config_overrides={num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
               "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}")


def train_command(args: list[str], ranks: int | None = None, script: str = "train.py") -> list[str]:
    """train.py (or a script that wraps it) as users run it: through the `deepspeed` launcher with `ranks`
    ranks, or with plain `python` when `ranks` is None."""
    return [sys.executable, script, *args] if ranks is None else launcher_command(ranks, script, args)


TRAIN_ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def run_train(args: list[str], ranks: int | None = None, timeout: int = 600,
              script: str = "train.py") -> subprocess.CompletedProcess:
    return subprocess.run(train_command(args, ranks, script), cwd=REPO, env=TRAIN_ENV, capture_output=True,
                          text=True, timeout=timeout)


def save_small_checkpoint(path: Path, **save_options) -> None:
    """SMALL_MODEL's architecture with seeded random weights and tiny_llama's tokenizer, saved with
    save_pretrained: the checkpoint a user brings."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    config = AutoConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json", num_hidden_layers=2, hidden_size=64,
                                        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, **save_options)
    AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer").save_pretrained(path)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """One prepared-data cache for the whole session, so each run does not re-tokenize the corpus."""
    return f"data.cache_dir={tmp_path_factory.mktemp('data_cache')}"


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def tree_state(*folders: Path) -> dict[Path, tuple[int, str]]:
    """Every file under the folders: (size, sha256), by absolute path."""
    import hashlib
    return {path: (path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
            for folder in folders for path in Path(folder).rglob("*") if path.is_file() and not path.is_symlink()}


def assert_only_created(before: dict[Path, tuple[int, str]], after: dict[Path, tuple[int, str]],
                        replaceable: tuple[Path, ...] = ()) -> None:
    """The tree guard: every file that was there before is there after, unchanged, except under `replaceable` (an
    earlier output of the same command, given with --overwrite). New files are what the command created."""
    def may_change(path: Path) -> bool:
        return any(path == place or place in path.parents for place in replaceable)

    lost = sorted(str(path) for path in before if path not in after and not may_change(path))
    changed = sorted(str(path) for path in before if path in after and after[path] != before[path]
                     and not may_change(path))
    assert not lost and not changed, f"deleted: {lost[:10]}; changed: {changed[:10]}"


@pytest.fixture
def tree_guard(tmp_path):
    """Call it around a command: `with tree_guard(): ...` fails the test if the command deleted or changed a file under
    the test's folder (tmp_path) or the repository's recipes and ds_configs, apart from `replaceable` places."""
    from contextlib import contextmanager

    @contextmanager
    def guard(*replaceable: Path, folders: tuple[Path, ...] = ()):
        watched = (tmp_path, REPO / "recipes", REPO / "ds_configs", *folders)
        before = tree_state(*watched)
        yield
        assert_only_created(before, tree_state(*watched), tuple(Path(p).absolute() for p in replaceable))

    return guard


@pytest.fixture
def earlier_run(tmp_path) -> Path:
    """An output folder holding a run with two checkpoints, as train.py leaves it."""
    run = tmp_path / "run"
    for step in (2, 4):
        tag = run / "checkpoints" / f"global_step{step}"
        tag.mkdir(parents=True)
        (tag / "run_state.json").write_text(json.dumps({"step": step, "tokens_seen": 100 * step, "world_size": 1,
                                                        "zero_stage": 1, "precision": "fp32"}))
        (tag / "mp_rank_00_model_states.pt").write_bytes(b"weights")
        (tag / "rank_state0.pt").write_bytes(b"data position and RNG")
    (run / "checkpoints" / "latest").write_text("global_step4")
    (run / "metrics.jsonl").write_text('{"step": 4, "loss": 5.0}\n')
    (run / "resolved_recipe.yaml").write_text("model: {}\n")
    (run / ".written-by.json").write_text('{"command": "train.py"}\n')
    return run


@pytest.fixture
def one_rank(monkeypatch):
    """A process group of this process alone (gloo on CPU), for code that needs one in-process; torn down
    through deepspeed.comm, so that DeepSpeed forgets the groups it cached for the next test's engine."""
    import deepspeed.comm
    from training.parallel import distributed
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    distributed.init_distributed()
    yield
    deepspeed.comm.destroy_process_group()
