"""TRL's trainers in a test process: what they leave behind, put back."""
import os
import random
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def left_as_found():
    """TRL's Trainer seeds the global generators and makes accelerate's process-wide state: the next test sees
    neither (nor any environment variable or thread count it might set)."""
    from accelerate.state import AcceleratorState
    environ, threads = dict(os.environ), torch.get_num_threads()
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        AcceleratorState._reset_state(reset_partial_state=True)
