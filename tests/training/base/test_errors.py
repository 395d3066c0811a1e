"""training/base/errors.py: which failures are the user's to fix (exit 2 and a message), and what the message says."""
import torch

from training.base.errors import failure

TORCH_SAYS = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
              "1.20 GiB is free. Including non-PyTorch memory, this process has 77.88 GiB memory in use.")


def allocate() -> None:
    raise torch.OutOfMemoryError(TORCH_SAYS)


def test_running_out_of_gpu_memory_names_where_and_the_ways_to_fit():
    try:
        allocate()
    except torch.OutOfMemoryError as error:
        code, message = failure(error)
    assert code == 2 and "Traceback" not in message
    line = allocate.__code__.co_firstlineno + 1
    assert message.startswith(f"error: out of GPU memory in allocate (test_errors.py:{line}): {TORCH_SAYS} To fit: "
                              f"lower training.micro_batch_size")
    assert message.endswith("train.py --dry-run shows the memory per rank under each ZeRO setting")


def test_a_bug_keeps_its_traceback():
    try:
        raise RuntimeError("a bug")
    except RuntimeError as error:
        code, message = failure(error)
    assert code == 1 and message.startswith("Traceback") and message.endswith("RuntimeError: a bug")
