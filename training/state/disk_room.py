"""Room on disk for what a run writes. A save that fills the disk is cut short, and torch's writer then fails with a
message that names neither the disk nor the file (`[enforce fail at inline_container.cc:672] . unexpected pos 704 vs
598`), hours into a run. So the plan's sizes (training/planning/checkpoint_size.py: a checkpoint within 2% of
DeepSpeed's files, and the export) are held against the output folder's free space: before anything is built, for the
first save, and again before each save and the export. One that does not fit stops the run by name, nothing written, the
latest checkpoint untouched."""
import shutil
from pathlib import Path

from training.base.errors import ConfigError
from training.base.output_guard import nearest_existing
from training.planning.checkpoint_size import planned_checkpoint, planned_export
from training.planning.plan import RunPlan
from training.planning.report import format_bytes
from training.state.output_dir import is_run, run_files


def free_bytes(folder: Path) -> int | None:
    """The free space of the file system `folder` is (or will be made) on; None where the file system does not say
    (some FUSE mounts of object stores report a total size of 0)."""
    usage = shutil.disk_usage(nearest_existing(folder))
    return usage.free if usage.total else None


def check_room(folder: Path, needed: float, what: str, fix: str, freed: int = 0) -> None:
    """Raise when `needed` bytes do not fit in `folder`'s free space (plus `freed`, what the run removes first)."""
    free = free_bytes(folder)
    if free is None:
        return
    free += freed
    if free < needed:
        raise ConfigError(f"{what} needs about {format_bytes(needed)} in {folder} and its file system has "
                          f"{format_bytes(free)} free{' once the earlier run is removed' if freed else ''}: {fix}")


def check_room_to_start(plan: RunPlan, overwrite: bool, resume: bool) -> None:
    """Before anything is built: room for the run's first checkpoint, or a resumed run's next one (and its universal
    copy of the last one)."""
    folder, size = plan.output_dir, planned_checkpoint(plan).total
    earlier = run_files(folder) if overwrite and folder.is_dir() and is_run(folder) else set()
    freed = sum((folder / name).stat().st_size for name in earlier if (folder / name).is_file())
    what = ("the resumed run's next checkpoint" if resume else "the run's first checkpoint") + (
        " and the universal conversion of the last" if plan.resume_universal else "")
    check_room(folder, size * (2 if plan.resume_universal else 1), what,
               "free space, or choose an --output-dir on another disk; nothing was started", freed)


def check_room_to_save(plan: RunPlan, step: int, latest: str | None) -> None:
    """Before a save: room for the whole checkpoint, which is written before keep_last removes older ones."""
    kept = f"`latest` names {latest}" if latest else "no checkpoint was saved yet"
    check_room(plan.output_dir / "checkpoints", planned_checkpoint(plan).total, f"checkpoint global_step{step}",
               f"the run stops here without saving it ({kept}); free space, or keep fewer checkpoints "
               f"(checkpointing.keep_last), then continue with --resume --output-dir {plan.output_dir}")


def check_room_to_export(plan: RunPlan, tag: str) -> None:
    check_room(plan.output_dir, planned_export(plan), "the export of the finished run",
               f"its last checkpoint, {tag}, is saved: free space, then export it with python -m training export "
               f"{plan.output_dir / 'checkpoints'} <folder>")
