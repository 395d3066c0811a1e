import sys
from pathlib import Path

from training.parallel.launch import failure_reason, launcher_command


def test_launcher_command_is_deepspeeds_own_launcher():
    command = launcher_command(2, "train.py", ["--recipe", "tiny_llama"], port=29555)
    assert command == [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", "29555",
                       "train.py", "--recipe", "tiny_llama"]
    assert launcher_command(1, "x.py", [])[4] != "None"  # a free port when none is given


def test_failure_reason_prefers_train_pys_own_error():
    log = ("[rank0]: Traceback (most recent call last):\n[rank0]: ValueError: something deep\n"
           "error: precision=fp8 needs an NVIDIA GPU\nsubprocess.CalledProcessError: Command '...' returned 2.\n")
    assert failure_reason(log) == "precision=fp8 needs an NVIDIA GPU"


def test_failure_reason_finds_out_of_memory_then_exceptions_then_kills():
    assert failure_reason("[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\nbye\n") == \
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"
    assert (failure_reason("[rank0]: RuntimeError:   bad   shape\nexits with return code = 1\n")
            == "RuntimeError: bad shape")
    assert failure_reason("step 3\nKilled\n") == "Killed"
    assert failure_reason("step 3\nlast words\n") == "last words"
    assert failure_reason("") == "no output"
