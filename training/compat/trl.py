"""What the distill objective takes from TRL beyond its public names (verified for trl 1.16.0, requirements.txt)."""
import torch

from training.compat import NO_ISSUE, Patch

VERIFIED_FOR = "1.16.0"
PATCHES = (
    Patch("chunked_divergence", "trl", VERIFIED_FOR,
          "TRL's DistillationTrainer computes its generalized Jensen-Shannon divergence with ChunkedDivergenceFunction "
          "(trl/kernels/chunked_divergence.py: both heads projected a tile of tokens and vocabulary at a time, in "
          "fp32, Triton on a GPU and torch elsewhere), which trl.kernels does not export (its __all__ names "
          "ChunkedLogProbFunction alone): distill's loss calls it from its module, with TRL's tile sizes, which the "
          "memory plan counts (training/objectives/distill/spec.py)", NO_ISSUE,
          "tests/training/compat/test_trl.py::test_the_chunked_divergence_is_where_and_as_large_as_counted",
          proofs=("tests/training/objectives/distill/test_divergence.py::"
                  "test_the_chunked_divergence_is_trls_generalized_jsd_and_its_gradient",)),
)


def chunked_divergence(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                       teacher_weight: torch.Tensor, beta: float, temperature: float, student_scale: float,
                       student_softcap: float | None, teacher_scale: float,
                       teacher_softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's divergence (with a gradient to the student's hidden states and head) and the student's entropy
    (none), from [tokens, hidden] states and [vocabulary, hidden] heads without bias: TRL's
    ChunkedDivergenceFunction."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction  # only a distill run imports TRL

    return ChunkedDivergenceFunction.apply(student_hidden, student_weight, None, teacher_hidden, teacher_weight, None,
                                           beta, temperature, student_scale, student_softcap, teacher_scale,
                                           teacher_softcap)
