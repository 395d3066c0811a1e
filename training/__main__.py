"""python -m training export CHECKPOINT OUT_DIR [--dtype bf16|fp16|fp32] [--overwrite]
python -m training convert CHECKPOINT      (a DeepSpeed universal checkpoint, which any ZeRO-1/2/3 layout loads)
python -m training average CHECKPOINT CHECKPOINT [...] OUT_DIR [--dtype ...] [--overwrite]
python -m training average RUN/checkpoints --last K OUT_DIR      (the mean of the checkpoints' weights)
python -m training evaluate RUN_OR_HF_DIR --tasks python_docs_mc[,hellaswag,...] [--output-dir DIR] [--limit N]
                           [--num-processes N]"""
import argparse
import os
import sys
from pathlib import Path

from training.base.errors import exit_code, positive_int
from training.compat import check_versions
from training.loop.benchmarks import check_evaluation, evaluate_folder, evaluate_in_processes
from training.planning.precision import DTYPES
from training.state.average import average_checkpoints
from training.state.export import export_checkpoint, find_tag
from training.state.universal import convert


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export",
                                 help="a saved checkpoint to a Hugging Face folder (from_pretrained loads it)")
    export.add_argument("checkpoint", type=Path,
                        help="a run's checkpoints/ folder (its latest) or one global_stepN/ in it")
    export.add_argument("out_dir", type=Path)
    export.add_argument("--dtype", choices=DTYPES, help="default: the run's precision")
    export.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists (once the export is "
                        "complete)")
    average = commands.add_parser("average", help="the element-wise mean of several checkpoints' weights, as a "
                                  "Hugging Face folder")
    average.add_argument("checkpoints", type=Path, nargs="+", help="global_stepN/ folders (of any layouts), or one "
                         "run's checkpoints/ folder with --last")
    average.add_argument("out_dir", type=Path)
    average.add_argument("--last", type=positive_int, help="the last K complete checkpoints of the checkpoints/ folder")
    average.add_argument("--dtype", choices=DTYPES, help="default: the last checkpoint's precision")
    average.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if an earlier average wrote it")
    convert_parser = commands.add_parser("convert", help="a saved checkpoint to a DeepSpeed universal checkpoint "
                                         "(what --resume does on another world size, ZeRO stage or precision)")
    convert_parser.add_argument("checkpoint", type=Path, help="a run's checkpoints/ folder (its latest) or one "
                                "global_stepN/ in it")
    evaluate = commands.add_parser("evaluate", help="benchmark scores of a run's hf/ export (or a Hugging Face folder) "
                                   "with lm-evaluation-harness")
    evaluate.add_argument("target", type=Path, help="a run folder (its hf/) or a Hugging Face model folder")
    evaluate.add_argument("--tasks", required=True, help="comma-separated: eval_tasks/ folders (offline) or lm-eval's "
                          "task names (their data from the hub)")
    evaluate.add_argument("--output-dir", type=Path, help="default: RUN/benchmarks (needed for a model folder)")
    evaluate.add_argument("--batch-size", type=positive_int, default=8)
    evaluate.add_argument("--limit", type=positive_int, help="at most this many examples per task (a quick look)")
    evaluate.add_argument("--overwrite", action="store_true", help="replace an earlier evaluate output there")
    evaluate.add_argument("--num-processes", type=positive_int, default=1, help="data-parallel: this many processes "
                          "under accelerate's launcher, one per GPU (CPU processes without one), each scoring a share")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    check_versions()  # export and convert read DeepSpeed's checkpoint formats (training/compat/deepspeed/)

    def run_export() -> int:
        tag_dir = export_checkpoint(args.checkpoint, args.out_dir, args.dtype, args.overwrite)
        print(f"exported {tag_dir} to {args.out_dir}")
        return 0

    def run_average() -> int:
        tags = average_checkpoints(args.checkpoints, args.out_dir, args.last, args.dtype, args.overwrite)
        print(f"averaged {len(tags)} checkpoints ({', '.join(tag.name for tag in tags)}) to {args.out_dir}")
        return 0

    def run_convert() -> int:
        checkpoint_dir, tag = find_tag(args.checkpoint)
        print(f"universal checkpoint: {convert(checkpoint_dir, tag)}")
        return 0

    def run_evaluate() -> int:
        tasks = args.tasks.split(",")
        if args.num_processes > 1 and "WORLD_SIZE" not in os.environ:  # not yet launched: launch
            check_evaluation(args.target, tasks, args.output_dir, args.overwrite)  # a bad input fails once, here
            return evaluate_in_processes(args.num_processes, argv)
        evaluate_folder(args.target, tasks, args.output_dir, args.overwrite, args.batch_size, args.limit)
        return 0

    return exit_code({"export": run_export, "average": run_average, "convert": run_convert,
                      "evaluate": run_evaluate}[args.command])


if __name__ == "__main__":
    sys.exit(main())
