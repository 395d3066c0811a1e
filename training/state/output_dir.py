"""The output folder: its default name, the checks that no flag combination loses an earlier run or anything that is
not a run, and what a run writes into it first."""
import json
import shutil
from pathlib import Path

import torch.distributed as dist
import yaml

from training.config.errors import ConfigError
from training.state.output_guard import MARKER, check_writable_place, mark, overlap, written_by
from training.planning.plan import RunPlan

OUTPUT_ROOT = Path("outputs")
COMMAND = "train.py"
REFERENCE_FILE = "reference_logps.npz"  # a DPO run's reference log-probabilities (training/loop/preference.py)
RUN_FILES = ("metrics.jsonl", "summary.json", "resolved_recipe.yaml", "ds_config.json", "checkpoints", "hf", "adapter",
             "tensorboard", "wandb", "mlruns", "benchmarks", REFERENCE_FILE)  # wandb, mlruns: training/loop/trackers.py


def holds_run(path: Path) -> bool:
    return (path / "checkpoints" / "latest").exists() or (path / "metrics.jsonl").exists()


def is_run(path: Path) -> bool:
    """A folder train.py wrote: marked so, or a run from before the mark (its resolved recipe beside its metrics or
    checkpoints)."""
    return written_by(path) == COMMAND or ((path / "resolved_recipe.yaml").is_file() and holds_run(path))


def default_output_dir(recipe_name: str, resume: bool) -> Path:
    """outputs/<recipe>, or outputs/<recipe>-2, -3, ... when earlier runs hold those; --resume takes the latest."""
    runs = [OUTPUT_ROOT / recipe_name]
    while holds_run(runs[-1]):
        runs.append(OUTPUT_ROOT / f"{recipe_name}-{len(runs) + 1}")
    return runs[-2] if resume and len(runs) > 1 else runs[-1]


def check_output_dir(output_dir: Path, resume: bool, overwrite: bool, inputs: list[Path]) -> None:
    """The output folder can hold this run: it holds no input and lies inside none, and no flag combination can lose
    an earlier run, or replace what train.py did not write."""
    if resume and overwrite:
        raise ConfigError("--resume continues the run in the output folder and --overwrite replaces it: pass one of "
                          "them (nothing was deleted)")
    found = overlap(output_dir, inputs)
    if found:
        how, source = found
        raise ConfigError(f"--output-dir {output_dir} {how} {source}, which the recipe reads: a run never writes "
                          f"{'around' if how == 'contains' else 'into'} its inputs; choose another --output-dir")
    check_writable_place(output_dir, "--output-dir")
    if resume and not (output_dir / "checkpoints" / "latest").exists():
        raise ConfigError(f"--resume: {output_dir}/checkpoints holds no checkpoint to continue from")
    if resume:
        return
    clashing = [name for name in RUN_FILES if (output_dir / name).exists()]
    if clashing and not is_run(output_dir):
        raise ConfigError(f"--output-dir {output_dir} holds {', '.join(clashing)}, which train.py did not write (no "
                          f"{MARKER} naming it): a run would write over them; choose another --output-dir (nothing "
                          f"was deleted)")
    if clashing and not overwrite:
        raise ConfigError(f"{output_dir} already holds a run; pass --resume to continue it, --overwrite to "
                          f"replace it, or another --output-dir")


def start_output_dir(plan: RunPlan, overwrite: bool) -> None:
    """Rank 0 clears an earlier run (with --overwrite: its own files, nothing else), marks the folder as a run's
    and writes exactly what will run."""
    if dist.get_rank() == 0:
        if overwrite and is_run(plan.output_dir):
            for name in RUN_FILES:
                path = plan.output_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        plan.output_dir.mkdir(parents=True, exist_ok=True)
        mark(plan.output_dir, COMMAND)
        recipe_tree = plan.recipe.model_dump(mode="json")
        (plan.output_dir / "resolved_recipe.yaml").write_text(yaml.safe_dump(recipe_tree, sort_keys=False))
        (plan.output_dir / "ds_config.json").write_text(json.dumps(plan.ds_config, indent=2) + "\n")
    dist.barrier()
