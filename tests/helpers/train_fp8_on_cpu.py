"""train.py with the FP8 hardware check switched off, run through the deepspeed launcher like train.py:

    deepspeed tests/helpers/train_fp8_on_cpu.py <train.py args> precision=fp8

torchao's float8 matmuls also run on PyTorch's CPU backend (slowly), so the whole FP8 path (conversion,
DeepSpeed's bf16 ZeRO stages, activation checkpointing, checkpoint and hf/ export) can be tested on a CPU.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train  # noqa: E402
import training.planning.precision  # noqa: E402
from tests.helpers import end_process  # noqa: E402


def main(argv: list[str]) -> int:
    """train.py's main on a CPU that passes for an FP8 GPU (the warm ranks of tests/warm_ranks.py call it too)."""
    training.planning.precision.check_fp8_hardware = lambda: None  # as on an H100
    return train.main(argv)


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
