"""Workarounds of lm-evaluation-harness behaviour (verified for lm-eval 0.4.13, requirements.txt)."""
from typing import TYPE_CHECKING

from training.compat import Patch

if TYPE_CHECKING:
    from lm_eval.models.huggingface import HFLM

VERIFIED_FOR = "0.4.13"
PATCHES = (
    Patch("split_over_processes", "lm_eval", VERIFIED_FOR,
          "HFLM takes its data-parallel rank and size from accelerate only when the machine has more than one GPU "
          "(gpus > 1 in HFLM.__init__), and then the rank within the node (local_process_index): under a launch of "
          "CPU processes (gloo), or of one GPU per node, each process scores every request, and over several nodes "
          "the ranks repeat. The launch's rank (process_index) and size are set on its private _rank and _world_size",
          "https://github.com/EleutherAI/lm-evaluation-harness/issues/1081",
          "tests/training/compat/test_lm_eval.py::test_hflm_takes_the_launchs_rank_only_on_a_node_of_gpus",
          proofs=("tests/training/loop/test_benchmarks.py::"
                  "test_two_processes_share_the_requests_and_give_one_processs_scores",
                  "tests/training/loop/test_benchmarks.py::test_every_rank_of_a_run_scores_a_share_of_its_export")),
)


def split_over_processes(model: "HFLM") -> None:
    """HFLM under an accelerate launch of several processes (accelerate's CLI, or the process group of a training
    run): each process scores its share of the requests, by its rank in the launch. A no-op without a launch."""
    accelerator = getattr(model, "accelerator", None)  # HFLM keeps one only when there are several processes
    if accelerator is not None:
        model._rank, model._world_size = accelerator.process_index, accelerator.num_processes
