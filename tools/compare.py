"""Run one recipe under several settings of any recipe knob on this machine, one after the other, and compare.

    python tools/compare.py --recipe tiny_llama --vary optimizer.name=adamw,lion,muon --num-gpus 2
    python tools/compare.py --recipe tiny_llama --vary deepspeed.config=zero1,zero3 --vary precision=fp32,bf16
    python tools/compare.py --recipe llama2_7b --vary activation_checkpointing=false,true --num-gpus 8 --steps 30
    python tools/compare.py --recipe llama3_8b_anneal --vary data.phases.1.weights.math=0.3,0.5 --num-gpus 8 \
        checkpointing.average_last=null            # a phase's weight (a 30-step cell saves no 3 checkpoints)

Each --vary KEY=V1,V2,... is a recipe key and its values (commas inside [...] or {...} belong to the value);
several --vary make a grid, every combination a cell. Every cell runs the same recipe, seed and data through
the real `deepspeed` launcher and train.py, for --steps steps, logging every step. Written to --output-dir:
  comparison.md / comparison.csv  per cell: tokens/s (mean after step 1), TFLOP/s and MFU (GPU), peak memory per
                                  rank (GPU: allocated and reserved; CPU: resident set size), model-state memory
                                  measured in the run, the plan's estimate for the same cell and its peak, (GRPO) the
                                  seconds a step spent generating and the first and last reward, (data.phases) each
                                  source's tokens read, the eval loss (with an eval split), final loss and the
                                  largest loss difference from the first cell that ran
  comparison.png                  loss curves, throughput and memory bars
  <cell>/, <cell>.log             each run's own output folder and console log
The default --output-dir is outputs/compare-<recipe>, or outputs/compare-<recipe>-2, -3, ... when earlier
comparisons are there; an existing --output-dir is replaced only with --overwrite, and only when an earlier
comparison wrote it: its files go, any other file there stays (named). Each cell runs what its label says: a key
given twice (in two --vary, or in a --vary and as a fixed override), a value given twice, or a key that compare.py
sets itself (training.max_steps from --steps, training.epochs unset, logging.every_steps=1) is refused. A cell that
cannot run (refused by train.py's checks, or failing, e.g. out of memory) is a row with its error. Every check is
made before anything is written or launched.
tools/compare_zero.py is the short form for ZeRO stages.
"""
import argparse
import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import train  # noqa: E402
from tools.comparison_report import write_reports  # noqa: E402
from training.base.errors import ConfigError, exit_code, positive_int  # noqa: E402
from training.base.output_guard import (  # noqa: E402
    MARKER,
    begin_in_place,
    check_output,
    files_under,
    finish_in_place,
    kept_line,
    lists_files,
    owned_files,
    remove_owned,
    shown_list,
    way_out,
    written_by,
)
from training.base.strict_json import number  # noqa: E402
from training.config.overrides import parse_override  # noqa: E402
from training.config.recipe import load_recipe, recipe_inputs  # noqa: E402
from training.parallel.launch import failure_reason, launcher_command  # noqa: E402
from training.planning.memory import planned_model_states, planned_peak  # noqa: E402

COMMAND = "tools/compare.py"
OUTPUT_ROOT = REPO / "outputs"
REPORTS = ("comparison.csv", "comparison.md", "comparison.png")


def parse_args(argv: list[str] | None, labels: dict[str, str] | None = None) -> argparse.Namespace:
    """`labels`: how a wrapper's user wrote a --vary (compare_zero.py's --stages), for the messages."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--vary", action="append", required=True, metavar="KEY=V1,V2,...",
                        help="a recipe key and the values to compare; repeat for a grid")
    parser.add_argument("--num-gpus", type=positive_int, default=1,
                        help="ranks on this machine (GPUs, or CPU processes)")
    parser.add_argument("--steps", type=positive_int, default=30, help="training steps per cell (default 30)")
    parser.add_argument("--output-dir", type=Path, help="default: outputs/compare-<recipe>, or "
                        "outputs/compare-<recipe>-N when earlier comparisons are there")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier comparison in --output-dir")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="applied to every cell")
    args = parser.parse_intermixed_args(argv)
    args.varied = []
    for vary in args.vary:
        key, _, values = vary.partition("=")
        if not key or not values:
            parser.error(f"--vary {vary}: write KEY=V1,V2,... (e.g. optimizer.name=adamw,lion)")
        args.varied.append([f"{key}={value}" for value in split_values(values)])
    args.labels = [(labels or {}).get(vary, f"--vary {vary}") for vary in args.vary]
    args.cells = [list(cell) for cell in itertools.product(*args.varied)]
    args.folders = dict(zip(map(tuple, args.cells), cell_folders(args.cells)))
    return args


def split_values(values: str) -> list[str]:
    """A --vary's V1,V2,...: the commas outside every [...] and {...} separate the values, those inside (nested too:
    [{a: 1}, {b: 2}]) belong to a value."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(values):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(values[start:index])
            start = index + 1
    return [*parts, values[start:]]


def cell_name(cell: list[str]) -> str:
    return ", ".join(cell)


def cell_folder(cell: list[str]) -> str:
    """The cell's settings as a folder name: characters other than letters, digits and ._=- become _, and a long
    name is cut (a file name holds 255 bytes, and the console log adds .log)."""
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", "__".join(cell))[:200]


def cell_folders(cells: list[list[str]]) -> list[str]:
    """Each cell's folder under the output folder, its console log beside it as <folder>.log. Two cells whose
    cell_folder is the same (their settings differ only in replaced characters, in case, which macOS and Windows
    ignore, or past the cut), or whose folder is another's log, would write into one place: a name already taken
    gets -2, -3, ..."""
    taken, folders = set(), []
    for cell in cells:
        base = name = cell_folder(cell)
        number = 1
        while {name.casefold(), f"{name}.log".casefold()} & taken:
            number += 1
            name = f"{base}-{number}"
        taken |= {name.casefold(), f"{name}.log".casefold()}
        folders.append(name)
    return folders


def cell_overrides(args: argparse.Namespace, cell: list[str]) -> list[str]:
    return [*args.overrides, *cell, *tool_settings(args)]


def tool_settings(args: argparse.Namespace) -> list[str]:
    """What compare.py sets in every cell, after the user's overrides: the same steps everywhere (--steps, also for
    a recipe that counts epochs), and every step logged (the loss curves and their differences need each step)."""
    return [f"training.max_steps={args.steps}", "training.epochs=null", "logging.every_steps=1"]


@dataclass
class Setting:
    """One key.path=value that a cell gets, and where the user gave it (for the messages)."""
    path: list[str]
    value: Any
    text: str
    source: str

    @property
    def key(self) -> str:
        return ".".join(self.path)


def setting(text: str, source: str) -> Setting:
    path, value = parse_override(text)
    return Setting(path, value, text, source)


def replaces(earlier: Setting, later: Setting) -> bool:
    """Whether applying `later` after `earlier` loses (part of) what `earlier` set: the same key or a parent of it,
    or a key inside a mapping that `earlier` gave whole."""
    if earlier.path[:len(later.path)] == later.path:
        return True
    if later.path[:len(earlier.path)] != earlier.path:
        return False
    node = earlier.value
    for part in later.path[len(earlier.path):]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def check_settings(args: argparse.Namespace) -> None:
    """Every cell runs what its label says. Overrides apply in order (fixed ones, each --vary, then compare.py's
    own) and the last wins, so a key given twice would run one value under several labels: refused, as is a value
    given twice in one --vary and a key that compare.py sets itself."""
    fixed = [setting(text, f"the override {text}") for text in args.overrides]
    varied = [[setting(text, label) for text in values] for values, label in zip(args.varied, args.labels)]
    for values in varied:
        check_distinct_values(values)
    tool = [setting(text, "compare.py") for text in tool_settings(args)]
    for given in [*fixed, *(value for values in varied for value in values)]:
        for own in tool:
            if replaces(given, own):
                raise ConfigError(tool_key_message(given, own.key, args.steps))
    earlier = list(fixed)
    for values in varied:
        for value in values:
            clash = next((other for other in earlier if replaces(other, value)), None)
            if clash:
                raise ConfigError(clash_message(clash, value))
        earlier += values


def check_distinct_values(values: list[Setting]) -> None:
    seen = {}
    for value in values:
        same = seen.setdefault(json.dumps(value.value, sort_keys=True, default=str), value)
        if same is not value:
            raise ConfigError(f"{value.source}: {same.text} and {value.text} are the same value, which would run the "
                              f"same cell twice; give each value once")


def tool_key_message(given: Setting, key: str, steps: int) -> str:
    inside = "" if given.key == key else f" ({key} inside {given.key})"
    if key.startswith("training."):
        return (f"{given.source} sets {key}{inside}, which compare.py sets itself: every cell trains --steps ({steps}) "
                f"steps, training.max_steps={steps} with training.epochs unset; pass --steps N instead")
    return (f"{given.source} sets {key}{inside}, which compare.py sets itself: it logs every step, which the loss "
            f"curves and their differences need; leave {key} out")


def clash_message(earlier: Setting, later: Setting) -> str:
    what = (f"{later.key} is given in both {earlier.source} and {later.source}" if earlier.key == later.key else
            f"{later.source} sets {later.key}, which overlaps {earlier.key} from {earlier.source}")
    return (f"{what}: overrides apply in order (the fixed ones, then each --vary) and the last wins, so cells would "
            f"run other values than their labels say; give each key in one place only (one --vary with all its "
            f"values, or one fixed override for a key not varied)")


@dataclass
class CellCheck:
    """train.py's checks of one cell: its memory estimate, the files it reads and its recipe, or the error that
    refuses it."""
    estimate: dict | None = None
    error: str | None = None
    inputs: list[Path] = field(default_factory=list)
    recipe: str | None = None  # the validated recipe as JSON


def check_cell(args: argparse.Namespace, cell: list[str]) -> CellCheck:
    """train.py's own checks for this cell on --num-gpus ranks, before anything runs."""
    train_args = train.parse_args(["--recipe", args.recipe, "--dry-run", *cell_overrides(args, cell)])
    try:
        plan = train.make_plan(train_args, world_size=args.num_gpus)
    except ConfigError as error:
        return CellCheck(error=str(error))
    check = CellCheck(inputs=[*recipe_inputs(plan.recipe), plan.ds_config_path],
                      recipe=json.dumps(plan.recipe.model_dump(mode="json"), sort_keys=True))
    try:
        states = planned_model_states(plan)
        check.estimate = {"estimated_model_states_bytes": states.device_bytes, "estimate_source": states.source,
                          "planned_peak_bytes": planned_peak(plan, states)}
    except ValueError:
        check.estimate = {"estimate_source": f"none for {plan.precision}"}
    return check


def check_cells(args: argparse.Namespace) -> list[CellCheck]:
    """Every cell's checks, all before the first run. Two cells that run the same recipe (a value written two ways,
    e.g. 0.001 and 1.0e-3) are refused."""
    checked = [check_cell(args, cell) for cell in args.cells]
    if all(check.error for check in checked):
        raise ConfigError("every cell is refused by train.py's checks:\n" + "\n".join(
            f"  {cell_name(cell)}: {check.error}" for cell, check in zip(args.cells, checked)))
    recipes = {}
    for cell, check in zip(args.cells, checked):
        same = check.recipe and recipes.setdefault(check.recipe, cell)
        if same and same is not cell:
            raise ConfigError(f"the cells {cell_name(same)} and {cell_name(cell)} run the same recipe (one value "
                              f"written two ways): give each value once")
    return checked


def prepare_output(args: argparse.Namespace, recipe_name: str, inputs: list[Path]) -> bool:
    """The output folder's checks (training/base/output_guard.py): the default one is outputs/compare-<recipe>, or the
    next free -2, -3, ...; returns whether --overwrite replaces an earlier comparison there."""
    if args.output_dir is None:
        args.output_dir = next_free(OUTPUT_ROOT / f"compare-{recipe_name}")
    replace = check_output(args.output_dir, COMMAND, inputs, args.overwrite, option="--output-dir")
    folders = set(args.folders.values())
    writes = {f"{folder}.log" for folder in folders} | set(REPORTS) | folders
    ours = comparison_files(args.output_dir) if replace else set()
    # a link at a name the comparison writes is another's even in a killed comparison's folder: it makes none there
    in_the_way = [name for name in (files_under(args.output_dir) if replace else set())
                  if (name in writes or name.split("/")[0] in folders)
                  and (name not in ours or (name in writes and (args.output_dir / name).is_symlink()))]
    if in_the_way:
        raise ConfigError(f"--output-dir {args.output_dir} holds {shown_list(args.output_dir, in_the_way)}, which "
                          f"{COMMAND} did not write, where the comparison writes: nothing was deleted; "
                          f"{way_out(args.output_dir, in_the_way, '--output-dir')}")
    return replace


def comparison_files(output_dir: Path) -> set[str]:
    """The earlier comparison's files (output_guard.owned_files); for one marked before markers listed them, its
    reports, cell logs and the cells' runs (folders train.py marked)."""
    if lists_files(output_dir):
        return owned_files(output_dir)
    runs = [path.parent for path in output_dir.glob(f"*/{MARKER}") if written_by(path.parent) == "train.py"]
    return {name for name in files_under(output_dir) if name in REPORTS or ("/" not in name and name.endswith(".log"))
            or any(run in (output_dir / name).parents for run in runs)}


def next_free(path: Path) -> Path:
    number, free = 1, path
    while free.exists() or free.is_symlink():
        number += 1
        free = path.with_name(f"{path.name}-{number}")
    return free


def start_output(output_dir: Path, replace: bool) -> None:
    """Every check has passed: only now are an earlier comparison's files removed (the others stay, named); the
    folder is marked as being written by a comparison before the first cell runs, so that even an interrupted one
    can be replaced with --overwrite."""
    if replace:
        kept = remove_owned(output_dir, comparison_files(output_dir))
        if kept:
            print(kept_line(kept, COMMAND), flush=True)
    begin_in_place(output_dir, COMMAND, set())


def train_args(args: argparse.Namespace, cell: list[str], output_dir: Path) -> list[str]:
    """train.py's arguments for the cell: the recipe, the cell's own folder and its overrides."""
    return ["--recipe", args.recipe, "--output-dir", str(output_dir / args.folders[tuple(cell)]),
            *cell_overrides(args, cell)]


def run_cell(args: argparse.Namespace, cell: list[str], output_dir: Path) -> str | None:
    """Train the cell through the deepspeed launcher, the console going to <cell>.log; the error or None. The cell's
    folder is new (the comparison's folder is), so train.py runs without --overwrite: it can replace nothing."""
    command = launcher_command(args.num_gpus, str(REPO / "train.py"), train_args(args, cell, output_dir))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.num_gpus)))
    log_path = cell_log(args, cell, output_dir)
    print(f"{cell_name(cell)}: {' '.join(command)}", flush=True)
    with log_path.open("w") as log:
        returncode = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    return cell_error(returncode, log_path)


def cell_log(args: argparse.Namespace, cell: list[str], output_dir: Path) -> Path:
    """The cell's console log, beside its folder."""
    return output_dir / f"{args.folders[tuple(cell)]}.log"


def cell_error(returncode: int, log_path: Path) -> str | None:
    """A cell run's error, from its exit code and console log, or None."""
    if returncode == 0:
        return None
    return f"exit {returncode}: {failure_reason(log_path.read_text())} (log: {log_path})"


def read_run(run_dir: Path) -> tuple[dict, dict[int, float]]:
    """A cell's row and loss curve. Its generation seconds per step (GRPO) are the mean over the steps after the
    first (compare.py logs every step): with num_iterations > 1 only every so many steps generate."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [record for record in map(json.loads, (run_dir / "metrics.jsonl").open())
               if "event" not in record]  # stability events have lines of their own
    losses = {record["step"]: number(record["loss"]) for record in records}  # "nan" as text: strict_json
    generation = [record["generation_time_s"] for record in records[1:] if "generation_time_s" in record]
    measured = summary.get("model_state_bytes") or {}
    device = "cuda" if "cuda" in measured else "cpu"
    row = {"status": "ok", "tokens_per_s": summary["mean_tokens_per_s"], "tflops": summary.get("tflops"),
           "mfu": summary.get("mfu"), "peak_mem_bytes": summary["peak_mem_bytes"],
           "peak_mem_reserved_bytes": summary.get("peak_mem_reserved_bytes"),
           "model_states_bytes": measured.get(device),
           "model_states_host_bytes": measured.get("cpu") if device == "cuda" else None,
           "generation_time_s": sum(generation) / len(generation) if generation else summary.get("generation_time_s"),
           "first_reward": summary.get("first_reward"),
           "final_reward": summary.get("reward"), "final_loss": number(summary["final_loss"]),
           "eval_loss": summary.get("eval_loss"),
           "source_tokens": next((record["source_tokens"] for record in reversed(records) if "source_tokens" in record),
                                 None)}  # data.phases: each source's tokens read
    return row, losses


def compare(args: argparse.Namespace, recipe_name: str) -> tuple[list[dict], dict[str, dict[int, float]]]:
    checked = check_cells(args)
    replace = prepare_output(args, recipe_name, [path for check in checked for path in check.inputs])
    start_output(args.output_dir, replace)
    output_dir = args.output_dir
    rows, curves = [], {}
    for cell, check in zip(args.cells, checked):
        name = cell_name(cell)
        row = {"cell": name, **(check.estimate or {})}
        error = check.error or run_cell(args, cell, output_dir)
        if error is None:
            measured, curves[name] = read_run(output_dir / args.folders[tuple(cell)])
            row.update(measured)
        else:
            row.update(status="failed", error=error)
            print(f"{name} failed: {error}", file=sys.stderr)
        rows.append(row)
    reference = reference_cell(curves)
    for row in rows:
        if row["cell"] in curves:
            steps = curves[reference].keys() & curves[row["cell"]].keys()
            row["max_loss_diff"] = max(abs(curves[row["cell"]][s] - curves[reference][s]) for s in steps)
    return rows, curves


def reference_cell(curves: dict[str, dict[int, float]]) -> str | None:
    """The cell the others' losses are compared with: the first that ran."""
    return next(iter(curves), None)


def main(argv: list[str] | None = None, labels: dict[str, str] | None = None) -> int:
    """`labels`: how a wrapper's user wrote a --vary, for the messages (parse_args)."""
    args = parse_args(argv, labels)
    return exit_code(lambda: compare_and_report(args))


def compare_and_report(args: argparse.Namespace) -> int:
    check_settings(args)
    recipe = load_recipe(args.recipe, [*args.overrides, *tool_settings(args)])  # what every cell shares, checked once
    rows, curves = compare(args, recipe.name)
    reference = reference_cell(curves)
    write_reports(rows, curves, reference, args)
    finish_in_place(args.output_dir, COMMAND)
    print((args.output_dir / "comparison.md").read_text())
    print(f"written: {args.output_dir}/comparison.md, comparison.csv, comparison.png")
    return 0 if curves else 1


if __name__ == "__main__":
    sys.exit(main())
