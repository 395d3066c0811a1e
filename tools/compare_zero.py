"""ZeRO stages side by side: the short form of tools/compare.py for `--vary deepspeed.config=...`.

    python tools/compare_zero.py --recipe tiny_llama --stages 0,1,2,3 --num-gpus 2
    python tools/compare_zero.py --recipe llama2_7b --stages 1,2,3,3_offload --num-gpus 8 --steps 30

Everything else (--num-gpus, --steps, --output-dir, --overwrite, key.path=value overrides, the outputs, and the
checks made before anything runs) is compare.py's.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import compare  # noqa: E402

from training.planning.model_states import ZERO_SETTINGS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="0,1,2,3", help=f"comma-separated, of {', '.join(ZERO_SETTINGS)}")
    args, rest = parser.parse_known_args(argv)
    stages = args.stages.split(",")
    unknown = [stage for stage in stages if stage not in ZERO_SETTINGS]
    if unknown:
        parser.error(f"--stages: unknown {', '.join(unknown)}; choose from {', '.join(ZERO_SETTINGS)}")
    vary = "deepspeed.config=" + ",".join(f"zero{stage}" for stage in stages)
    return compare.main(["--vary", vary, *rest], labels={vary: f"--stages {args.stages}"})


if __name__ == "__main__":
    sys.exit(main())
