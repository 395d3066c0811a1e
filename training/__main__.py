"""python -m training export CHECKPOINT OUT_DIR [--dtype bf16|fp16|fp32] [--overwrite]
python -m training convert CHECKPOINT      (a DeepSpeed universal checkpoint, which any ZeRO-1/2/3 layout loads)"""
import argparse
import sys
from pathlib import Path

from training.compat import check_versions
from training.config.errors import exit_code
from training.state.export import export_checkpoint, find_tag
from training.planning.precision import DTYPES
from training.state.universal import convert


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="a saved checkpoint to a Hugging Face folder (from_pretrained loads it)")
    export.add_argument("checkpoint", type=Path, help="a run's checkpoints/ folder (its latest) or one global_stepN/ in it")
    export.add_argument("out_dir", type=Path)
    export.add_argument("--dtype", choices=DTYPES, help="default: the run's precision")
    export.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists (once the export is "
                        "complete)")
    convert_parser = commands.add_parser("convert", help="a saved checkpoint to a DeepSpeed universal checkpoint "
                                         "(what --resume does on another world size, ZeRO stage or precision)")
    convert_parser.add_argument("checkpoint", type=Path, help="a run's checkpoints/ folder (its latest) or one "
                                "global_stepN/ in it")
    args = parser.parse_args(argv)
    check_versions()  # export and convert read DeepSpeed's checkpoint formats (training/compat/deepspeed.py)

    def run_export() -> int:
        tag_dir = export_checkpoint(args.checkpoint, args.out_dir, args.dtype, args.overwrite)
        print(f"exported {tag_dir} to {args.out_dir}")
        return 0

    def run_convert() -> int:
        checkpoint_dir, tag = find_tag(args.checkpoint)
        print(f"universal checkpoint: {convert(checkpoint_dir, tag)}")
        return 0

    return exit_code(run_export if args.command == "export" else run_convert)


if __name__ == "__main__":
    sys.exit(main())
