"""The CPU suite's one-GPU invariants, on CUDA (skipped, with the reason, without a CUDA GPU).

A packed row gives each document the per-token loss it has alone, on the GPU's kernels: fp32 within 1e-5 (TF32
is off for matrix products by default), bf16 within 3e-2, where a leak across documents moves the losses of the
sharpened model by far more (the CPU test shows it). flash_attention_2 runs where flash-attn is installed.
The ZeRO stages' equal losses on one GPU are checked by benchmarks/gpu_validate.py from tools/compare_zero.py's
table; fp16 and FP8 have their own GPU files (tests/test_train_fp16_gpu.py, tests/test_train_fp8_gpu.py).
"""
import importlib.util

import pytest
import torch

from tests.data_pipeline.test_packed_attention import (assert_documents_kept_apart, losses_alone, packed_row,
                                                       per_token_loss, sharp_model)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; "
                                "torch.cuda.is_available() is False")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager", "flash_attention_2"])
def test_a_packed_row_keeps_its_documents_apart_on_cuda(attn_implementation, dtype):
    if attn_implementation == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            pytest.skip("flash-attn is not installed")
        if dtype == torch.float32:
            pytest.skip("flash_attention_2 runs in 16 bits only")
    model = sharp_model(attn_implementation=attn_implementation).to("cuda", dtype)
    row, documents = packed_row()
    row = {name: tensor.cuda() for name, tensor in row.items()}
    with torch.no_grad():
        packed = per_token_loss(model, row["input_ids"], row["position_ids"], row["labels"]).cpu()
    assert_documents_kept_apart(packed, losses_alone(model, documents, device="cuda"), TOLERANCE[dtype])
