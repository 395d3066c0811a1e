"""The data stage on its own.

    python -m data_pipeline prepare --recipe NAME_OR_DIR --output DIR [key.path=value ...]
    python -m data_pipeline prepare ... --engine datatrove [--executor local|slurm|ray] [--tasks N] [--workers W]
    python -m data_pipeline dedup IN.jsonl OUT.jsonl [--text-field text] [--threshold 0.8] [--no-near] [--overwrite]

`prepare` writes the recipe's training-ready splits (`datasets.save_to_disk` layout) and DIR/stats.json;
point a recipe at it with `data.prepared=DIR` (what multi-node runs should do). `--engine datatrove`
runs the same steps as a datatrove job (data_pipeline/scale.py, docs/data_at_scale.md). `dedup` keeps the first
of each group of exact or near duplicates of a JSONL file, in input order, lines copied unchanged.

Both follow training/base/output_guard.py: an output never holds or goes inside an input, its folder is checked
before any work, and it is marked as the command's. prepare refuses an existing --output; dedup replaces an
existing OUT only with --overwrite, and only when an earlier dedup wrote it.
"""
import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import orjson
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from data_pipeline.config import DedupConfig
from data_pipeline.dedup import NearDuplicates, bytes_hashes, normalized_bytes, repeated_mask
from data_pipeline.files import emptiness, json_lines, record_problem
from data_pipeline.filters import SAMPLES_FILE
from training.base.errors import DataError, exit_code, positive_int
from training.base.output_guard import check_output, mark, overlap, write_atomically

if TYPE_CHECKING:
    from training.config.recipe import Recipe


def print_counts(title: str, counts: dict) -> None:
    table = Table(title=title, show_header=False, title_justify="left")
    for name, value in counts.items():
        if isinstance(value, (int, float, str)):
            table.add_row(name, f"{value:,}" if isinstance(value, int) else f"{value:.4f}" if isinstance(value, float)
                          else value)
    Console(width=120).print(table)


def print_filters(stats: dict, output: Path) -> None:
    """What each quality filter removed, in order: the trade-off to judge with the samples beside the data."""
    table = Table(title="quality filters, in order", title_justify="left")
    for column in ("filter", "documents removed", "of those read", "tokens removed", "edited", "top reasons"):
        table.add_column(column, justify="left" if column in ("filter", "top reasons") else "right")
    for index, counts in enumerate(stats["filters"]):
        reasons = sorted(counts["reasons"].items(), key=lambda item: -item[1])[:3]
        table.add_row(f"{index}: {counts['type']}", f"{counts['documents_removed']:,}",
                      f"{counts['documents_removed'] / max(1, stats['documents_in']):.1%}",
                      f"{counts['tokens_removed']:,}", f"{counts['documents_edited']:,}",
                      ", ".join(f"{reason} {count:,}" for reason, count in reasons))
    Console(width=140).print(table)
    print(f"a sample of each filter's removed documents: {output / SAMPLES_FILE}")


DEDUP_COMMAND = "python -m data_pipeline dedup"


def check_prepare_output(output: Path, inputs: list[Path], engine: str) -> None:
    """output_guard's rules, before any work. prepare has no --overwrite: an existing output is refused, not replaced.
    The datatrove job's work folder beside it is held to the same inputs."""
    from data_pipeline.prepare import PREPARE_COMMAND
    from data_pipeline.work_folder import check_work_folder, work_folder
    if output.exists() and not output.is_symlink() and not overlap(output, inputs):  # a link: check_output names it
        raise DataError(f"{output} already exists; choose another --output or remove it")
    check_output(output, PREPARE_COMMAND, inputs, option="--output")
    if engine == "datatrove":
        check_work_folder(work_folder(output), inputs)


def check_recipe_layout(recipe: "Recipe") -> None:
    """train.py's refusals of the recipe's parallel layout (training/parallel/support.py) before any work: data for a
    run that cannot start is not prepared. Without the model (not loaded here) and the ranks, only the rows the recipe
    alone decides apply: its objective's, LoRA's, the optimizer's, the degrees that do not run together."""
    from training.parallel.support import check_support
    from training.planning.layout import ParallelDims
    degrees = recipe.parallelism
    smallest_world = degrees.pipeline_stages * degrees.tensor_parallel * degrees.sequence_parallel  # one replica
    check_support(recipe, None, ParallelDims.of(degrees, smallest_world))


def prepare(args: argparse.Namespace) -> int:
    """Imports datasets, transformers and torch here, not at the top of the module: `dedup` needs none of them, and
    importing them was most of its time as a whole process (benchmarks/README.md)."""
    from data_pipeline.prepare import build_dataset, save_prepared
    from training.compat import check_versions
    from training.config.recipe import load_recipe, recipe_inputs
    from training.models.model import load_tokenizer
    from training.objectives.base import objective_class
    recipe = load_recipe(args.recipe, args.overrides)
    check_recipe_layout(recipe)
    objective_class(recipe.training.spec).check(recipe, None)  # its refusals of data settings, before any work
    if recipe.data.prepared or recipe.data.streaming:
        raise DataError("the recipe's data is already prepared (data.prepared) or streamed (data.streaming); to "
                        "prepare a streamed recipe's sources anyway, add data.streaming=false")
    if recipe.data.examples != "documents" and args.engine == "datatrove":
        raise DataError(f"--engine datatrove prepares documents; {recipe.data.examples} (training.objective="
                        f"{recipe.training.objective}) are prepared by --engine datasets")
    check_prepare_output(args.output, recipe_inputs(recipe), args.engine)
    tokenizer = load_tokenizer(recipe.tokenizer_path, recipe.model.trust_remote_code)  # as train.py loads it
    if args.engine == "datatrove" or recipe.data.filters:
        check_versions(("datatrove",))
    if args.engine == "datatrove":
        from data_pipeline.scale import JobOptions, run_job
        options = JobOptions(args.executor, args.tasks, args.workers, args.slurm_partition, args.slurm_time,
                             args.cpus_per_task, args.mem_per_cpu_gb)
        work = run_job(recipe.data, tokenizer, args.output, options, recipe.name)
        if not (args.output / "stats.json").exists():
            return job_not_finished(args.output, work, args.executor)
        stats = json.loads((args.output / "stats.json").read_text())
    else:
        save_prepared(*build_dataset(recipe.data, tokenizer), args.output)
        stats = json.loads((args.output / "stats.json").read_text())
    print_counts(f"{recipe.name}: prepared data in {args.output}", stats)
    if "filters" in stats:
        print_filters(stats, args.output)
    if "eval" in stats:
        print_counts("evaluation split", stats["eval"])
    for source in stats["sources"]:
        print_counts(f"source {source['name']}", source)
    return 0


def job_not_finished(output: Path, work: Path, executor: str) -> int:
    """Slurm runs the stages after the command returns; the local and Ray executors have run them all, so a job that
    returns without stats.json there has failed."""
    if executor == "slurm":
        print(f"submitted; {output}/stats.json appears when the last stage ends (logs: {work}/logs)")
        return 0
    print(f"error: the datatrove job ended without writing {output}/stats.json; its logs are in {work}/logs. Run the "
          f"same command again (finished tasks are skipped), or remove {work} to start over", file=sys.stderr)
    return 1


def read_jsonl(path: Path, text_field: str) -> tuple[list[bytes], list[str]]:
    """Each line (its bytes, newline-terminated) and its text, or a DataError naming the file, the line and the fix."""
    if how := emptiness(str(path)):
        raise DataError(f"{path} is empty ({how}); pass a .jsonl file with one JSON object per line")
    lines, texts = [], []
    for number, raw, record in json_lines(str(path), orjson.loads):
        problem = record_problem(record, text_field, chat=False, setting="--text-field")
        if problem is None and text_field not in record:
            problem = f"no field '{text_field}' (fields present: {', '.join(record)}); pass --text-field"
        if problem:
            raise DataError(f"{path}:{number}: {problem}")
        lines.append(raw if raw.endswith(b"\n") else raw + b"\n")
        texts.append(record[text_field] or "")
    return lines, texts


def dedup_config(args: argparse.Namespace) -> DedupConfig:
    try:  # the recipe's limits apply to the options too
        return DedupConfig(near=not args.no_near, threshold=args.threshold, num_perm=args.num_perm,
                           shingle=args.shingle, ngram=args.ngram)
    except ValidationError as error:
        raise DataError("; ".join(f"--{str(e['loc'][0]).replace('_', '-')} {e['input']}: {e['msg']}"
                                  for e in error.errors())) from None


def near_signatures(texts: list[str], encoded: list[bytes], config: DedupConfig, num_proc: int) -> np.ndarray:
    """MinHash signatures in this process from the normalized texts, or through datasets.map with num_proc > 1."""
    if num_proc == 1:
        return config.hasher().normalized_signatures(encoded)
    import datasets

    from data_pipeline.prepare import minhash_signatures
    return minhash_signatures(datasets.Dataset.from_dict({"text": texts}), config, num_proc)


def dedup(args: argparse.Namespace) -> int:
    if not args.input.is_file():
        raise DataError(f"{args.input}: {'a folder' if args.input.is_dir() else 'no such file'}; pass a .jsonl file, "
                        f"one JSON object per line")
    if args.output.resolve() == args.input.resolve():
        raise DataError(f"{args.output} is the input file; write the result to another file")
    check_output(args.output, DEDUP_COMMAND, [args.input], args.overwrite, folder=False, option="OUT")
    config = dedup_config(args)
    lines, texts = read_jsonl(args.input, args.text_field)
    encoded = normalized_bytes(texts)
    exact = repeated_mask(bytes_hashes(encoded))
    near = np.zeros(len(texts), dtype=bool)
    unique = np.flatnonzero(~exact)
    if config.near and unique.size:
        signatures = near_signatures([texts[i] for i in unique], [encoded[i] for i in unique], config, args.num_proc)
        near[unique[NearDuplicates(config.threshold, config.hasher()).duplicate_mask(
            signatures, lambda rows: [encoded[unique[i]] for i in rows])]] = True
    kept = ~(exact | near)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(args.output, b"".join(line for line, keep in zip(lines, kept) if keep))
    mark(args.output, DEDUP_COMMAND, folder=False)
    print_counts(f"{args.input} -> {args.output}", {
        "documents_in": len(texts), "exact_duplicates_removed": int(exact.sum()),
        "near_duplicates_removed": int(near.sum()), "documents_out": int(kept.sum())})
    return 0


def workers(text: str) -> int:
    """An argparse type: -1 (every task at once) or a whole number above 0."""
    if text.strip() == "-1":
        return -1
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be -1 (every task at once) or a whole number above 0, got {text!r}") \
            from None


def threshold(text: str) -> float:
    """An argparse type: a Jaccard similarity in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a similarity above 0 and at most 1, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prepare_parser = commands.add_parser("prepare", help="prepare a recipe's data")
    prepare_parser.add_argument("--recipe", required=True)
    prepare_parser.add_argument("--output", type=Path, required=True)
    prepare_parser.add_argument("--engine", choices=["datasets", "datatrove"], default="datasets",
                                help="datasets: in this process (num_proc); datatrove: as a restartable datatrove job")
    prepare_parser.add_argument("--executor", choices=["local", "slurm", "ray"], default="local",
                                help="datatrove: where the tasks run")
    prepare_parser.add_argument("--tasks", type=positive_int, default=2,
                                help="datatrove: tasks per stage that splits its input (files are split among them)")
    prepare_parser.add_argument("--workers", type=workers, default=-1, help="datatrove: tasks at once (-1: all)")
    prepare_parser.add_argument("--slurm-partition")
    prepare_parser.add_argument("--slurm-time", default="24:00:00", help="each Slurm job's time limit")
    prepare_parser.add_argument("--cpus-per-task", type=positive_int, default=1, help="Slurm and Ray")
    prepare_parser.add_argument("--mem-per-cpu-gb", type=float, default=2.0, help="Slurm and Ray")
    prepare_parser.add_argument("overrides", nargs="*", metavar="key.path=value")
    dedup_parser = commands.add_parser("dedup", help="remove exact and near duplicates from a JSONL file")
    dedup_parser.add_argument("input", type=Path)
    dedup_parser.add_argument("output", type=Path)
    dedup_parser.add_argument("--text-field", default="text")
    dedup_parser.add_argument("--threshold", type=threshold, default=DedupConfig().threshold)
    dedup_parser.add_argument("--no-near", action="store_true", help="exact duplicates only")
    dedup_parser.add_argument("--overwrite", action="store_true", help="replace OUT.jsonl if an earlier dedup wrote it")
    dedup_parser.add_argument("--num-perm", type=positive_int, default=DedupConfig().num_perm)
    dedup_parser.add_argument("--shingle", choices=["word", "char"], default=DedupConfig().shingle)
    dedup_parser.add_argument("--ngram", type=positive_int, default=DedupConfig().ngram)
    dedup_parser.add_argument("--num-proc", type=positive_int, default=1)
    args = parser.parse_args(argv)
    return exit_code(lambda: prepare(args) if args.command == "prepare" else dedup(args))


if __name__ == "__main__":
    sys.exit(main())
