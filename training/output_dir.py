"""The output folder: its default name, the checks that no flag combination loses an earlier run, and what a run
writes into it first."""
import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist
import yaml

from training.errors import ConfigError
from training.plan import RunPlan

OUTPUT_ROOT = Path("outputs")
RUN_FILES = ("metrics.jsonl", "summary.json", "resolved_recipe.yaml", "ds_config.json", "checkpoints", "hf", "tensorboard")


def holds_run(path: Path) -> bool:
    return (path / "checkpoints" / "latest").exists() or (path / "metrics.jsonl").exists()


def default_output_dir(recipe_name: str, resume: bool) -> Path:
    """outputs/<recipe>, or outputs/<recipe>-2, -3, ... when earlier runs hold those; --resume takes the latest."""
    runs = [OUTPUT_ROOT / recipe_name]
    while holds_run(runs[-1]):
        runs.append(OUTPUT_ROOT / f"{recipe_name}-{len(runs) + 1}")
    return runs[-2] if resume and len(runs) > 1 else runs[-1]


def check_output_dir(output_dir: Path, resume: bool, overwrite: bool) -> None:
    """The output folder can hold this run, and no flag combination can lose an earlier one."""
    if resume and overwrite:
        raise ConfigError("--resume continues the run in the output folder and --overwrite replaces it: pass one of "
                          "them (nothing was deleted)")
    existing = next(path for path in (output_dir, *output_dir.parents) if path.exists())
    if not existing.is_dir():
        raise ConfigError(f"--output-dir {output_dir}: {existing} is a file, not a folder; choose another --output-dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--output-dir {output_dir}: {existing} is not writable by this user; choose another "
                          f"--output-dir")
    if resume and not (output_dir / "checkpoints" / "latest").exists():
        raise ConfigError(f"--resume: {output_dir}/checkpoints holds no checkpoint to continue from")
    if holds_run(output_dir) and not (resume or overwrite):
        raise ConfigError(f"{output_dir} already holds a run; pass --resume to continue it, --overwrite to "
                          f"replace it, or another --output-dir")


def start_output_dir(plan: RunPlan, overwrite: bool) -> None:
    """Rank 0 clears an earlier run (with --overwrite) and writes exactly what will run."""
    if dist.get_rank() == 0:
        if overwrite:
            for name in RUN_FILES:
                path = plan.output_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        plan.output_dir.mkdir(parents=True, exist_ok=True)
        recipe_tree = plan.recipe.model_dump(mode="json")
        (plan.output_dir / "resolved_recipe.yaml").write_text(yaml.safe_dump(recipe_tree, sort_keys=False))
        (plan.output_dir / "ds_config.json").write_text(json.dumps(plan.ds_config, indent=2) + "\n")
    dist.barrier()
