"""The output folder: its default name, the checks that no flag combination loses an earlier run or anything that is
not a run, and what a run writes into it first. A run writes its folder as it goes (training/base/output_guard.py's
begin_in_place): --overwrite removes the earlier run's own files and keeps, and names, every other file."""
import re
from pathlib import Path

import torch.distributed as dist
import yaml

from training.base.errors import ConfigError
from training.base.output_guard import (
    MARKER,
    begin_in_place,
    check_writable_place,
    files_under,
    finish_in_place,
    kept_line,
    link_refusal,
    lists_files,
    overlap,
    owned_files,
    remove_owned,
    shown_list,
    way_out,
    written_by,
)
from training.base.strict_json import dumps
from training.objectives.registry import SPECS
from training.planning.plan import RunPlan

OUTPUT_ROOT = Path("outputs")
COMMAND = "train.py"
OBJECTIVE_FILES = tuple(name for spec in SPECS.values() for name in spec.run_files)  # what an objective's run
# writes by name (its spec's run_files, e.g. a reference pass's values): a run's, whichever objective it trained
RUN_FILES = ("metrics.jsonl", "summary.json", "resolved_recipe.yaml", "ds_config.json", "checkpoints", "hf", "adapter",
             "tensorboard", "wandb", "mlruns",  # wandb, mlruns: training/loop/trackers.py
             "benchmarks", *OBJECTIVE_FILES)


# what a run writes by name (DeepSpeed's scripts beside the checkpoints too), the folders it writes into, and what it
# writes as a whole folder (hf/, adapter/, a checkpoint): a file of another's (or a link, which the run would write
# through) at those names is refused
NAMED_FILES = {"metrics.jsonl", "summary.json", "resolved_recipe.yaml", "ds_config.json", *OBJECTIVE_FILES,
               "checkpoints/latest", "checkpoints/zero_to_fp32.py", "checkpoints/zero_to_torch.py"}
RUN_FOLDERS = {name for name in RUN_FILES if "." not in name} | {"checkpoints/universal"}
WHOLE_FOLDERS = ("hf/", "adapter/", "checkpoints/global_step")


def holds_run(path: Path) -> bool:
    return (path / "checkpoints" / "latest").exists() or (path / "metrics.jsonl").exists()


def is_run(path: Path) -> bool:
    """A folder train.py wrote: marked so, or a run from before the mark (its resolved recipe beside its metrics or
    checkpoints)."""
    return written_by(path) == COMMAND or ((path / "resolved_recipe.yaml").is_file() and holds_run(path))


def default_output_dir(recipe_name: str, resume: bool) -> Path:
    """outputs/<recipe>, or outputs/<recipe>-2, -3, ... when earlier runs (or symbolic links) hold those; --resume
    takes the latest."""
    runs = [OUTPUT_ROOT / recipe_name]
    while holds_run(runs[-1]) or runs[-1].is_symlink():
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
    if output_dir.is_symlink():
        raise ConfigError(link_refusal(output_dir, "--output-dir"))
    check_writable_place(output_dir, "--output-dir")
    if resume and not (output_dir / "checkpoints" / "latest").exists():
        raise ConfigError(f"--resume: {output_dir}/checkpoints holds no checkpoint to continue from")
    clashing = [name for name in RUN_FILES if (output_dir / name).exists() or (output_dir / name).is_symlink()]
    if clashing and not resume and not is_run(output_dir):
        raise ConfigError(f"--output-dir {output_dir} holds {shown_list(output_dir, clashing)}, which train.py did not "
                          f"write (no {MARKER} naming it): a run would write over them; choose another --output-dir "
                          f"(nothing was deleted)")
    if clashing and not resume and not overwrite:
        raise ConfigError(f"{output_dir} already holds a run; pass --resume to continue it, --overwrite to "
                          f"replace it, or another --output-dir")
    in_the_way = others_where_the_run_writes(output_dir, resume)
    if in_the_way:
        raise ConfigError(f"--output-dir {output_dir} holds {shown_list(output_dir, in_the_way)}, which train.py did "
                          f"not write, where the run writes: nothing was deleted; "
                          f"{way_out(output_dir, in_the_way, '--output-dir')}")


def others_where_the_run_writes(output_dir: Path, resume: bool) -> list[str]:
    """The files (and symbolic links) of another's in the folder where the run writes (written_there)."""
    if not output_dir.is_dir():
        return []
    ours = run_files(output_dir) if resume or is_run(output_dir) else set()  # --resume: the checkpoints are a run's
    # a link is another's even in a killed run's folder (whose files are every file but those there before it):
    # train.py makes none where it writes
    others = {name for name in files_under(output_dir) if name not in ours or (output_dir / name).is_symlink()}
    return [name for name in others if written_there(output_dir, name, resume)]


def written_there(output_dir: Path, name: str, resume: bool) -> bool:
    """Whether the run writes at `name` or below it: a name it writes, a folder it writes into, or a folder it writes
    whole. A resumed run writes again only the files save_pretrained writes into hf/ and adapter/ (so a plain file of
    another's there stays where it is, and a link is refused: a write could go through it) and the checkpoints after
    the latest (an earlier checkpoint's folder it only prunes of its own files)."""
    if name in NAMED_FILES or name in RUN_FOLDERS:
        return True
    if not name.startswith(WHOLE_FOLDERS):
        return False
    if not resume:
        return True
    if name.startswith("checkpoints/"):
        return saved_after_latest(output_dir, name)
    return (output_dir / name).is_symlink()


def saved_after_latest(output_dir: Path, name: str) -> bool:
    """Whether `name` lies in a checkpoint folder of a step after the latest checkpoint's: one a resumed run saves."""
    tag, latest = Path(name).parts[1], (output_dir / "checkpoints" / "latest").read_text().strip()
    steps = [re.fullmatch(r"global_step(\d+)", text) for text in (tag, latest)]
    return all(steps) and int(steps[0][1]) > int(steps[1][1])


def run_files(output_dir: Path) -> set[str]:
    """The files of the run in the folder (output_guard.owned_files); for a run marked before markers listed them, the
    files under RUN_FILES' names but those of a folder another command marked (an evaluation's results)."""
    if lists_files(output_dir):
        return owned_files(output_dir)
    foreign = [path.parent for path in output_dir.glob(f"**/{MARKER}")
               if path.parent != output_dir and written_by(path.parent) != COMMAND]
    return {name for name in files_under(output_dir) if name.split("/")[0] in RUN_FILES
            and not any(folder in (output_dir / name).parents for folder in foreign)}


def claim_output_dir(output_dir: Path, resume: bool) -> None:
    """Before a resumed run writes anything (its checkpoint's conversion to another layout included), rank 0 marks
    its folder as being written again: the files there now that are not the earlier run's stay another's."""
    if resume and dist.get_rank() == 0:
        begin_in_place(output_dir, COMMAND, run_files(output_dir))


def start_output_dir(plan: RunPlan, overwrite: bool, resume: bool) -> None:
    """Every check has passed. Rank 0 removes, with --overwrite, the earlier run's own files (naming the others, which
    stay), marks a new run's folder as being written by it, and writes exactly what will run."""
    if dist.get_rank() == 0:
        if overwrite and is_run(plan.output_dir):
            kept = remove_owned(plan.output_dir, run_files(plan.output_dir))
            if kept:
                print(kept_line(kept, COMMAND), flush=True)
        if not resume:
            begin_in_place(plan.output_dir, COMMAND, set())
        recipe_tree = plan.recipe.model_dump(mode="json")
        (plan.output_dir / "resolved_recipe.yaml").write_text(yaml.safe_dump(recipe_tree, sort_keys=False))
        (plan.output_dir / "ds_config.json").write_text(dumps(plan.ds_config, indent=2) + "\n")
    dist.barrier()


def finish_output_dir(output_dir: Path) -> None:
    """The run has ended (finished, or stopped with its checkpoint saved): its marker lists what it wrote."""
    if dist.get_rank() == 0:
        finish_in_place(output_dir, COMMAND)
