"""The CPU suite's one-GPU invariants, on CUDA (skipped, with the reason, without a CUDA GPU).

A packed row gives each document the per-token loss it has alone, on the GPU's kernels: fp32 within 1e-5 (TF32
is off for matrix products by default), bf16 within 3e-2, where a leak across documents moves the losses of the
sharpened model by far more (the CPU test shows it). flash_attention_2 runs where flash-attn is installed;
flex_attention's compiled kernel (the GPU default) runs here, and trains as sdpa does. The speed kernels that a CPU
runs in another form are checked on the GPU's own: the fused head and loss (bf16 too), the compiled layers
(inductor's Triton kernels), GRPO's fp32 head and torch's fused AdamW.
The ZeRO stages' equal losses on one GPU are checked by benchmarks/gpu_validate.py from tools/compare_zero.py's
table; fp16 and FP8 have their own GPU files (tests/test_train_fp16_gpu.py, tests/test_train_fp8_gpu.py).
"""
import importlib.util

import pytest
import torch

from tests.data_pipeline.test_packed_attention import (
    assert_documents_kept_apart,
    losses_alone,
    packed_row,
    per_token_loss,
    sharp_model,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; "
                                "torch.cuda.is_available() is False")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager", "flash_attention_2", "flex_attention"])
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


def packed_rows(rows: int = 4, seq_len: int = 256, vocab: int = 97) -> dict[str, torch.Tensor]:
    """Rows of random documents of 10 to 90 tokens, packed as data_pipeline packs them (position_ids restart)."""
    generator = torch.Generator().manual_seed(0)
    positions = []
    for _ in range(rows):
        row = []
        while len(row) < seq_len:
            row += range(int(torch.randint(10, 90, (1,), generator=generator)))
        positions.append(row[:seq_len])
    ids = torch.randint(1, vocab, (rows, seq_len), generator=generator)
    labels = torch.where(torch.tensor(positions) == 0, -100, ids)  # a document's first token is no target
    return {"input_ids": ids.cuda(), "labels": labels.cuda(), "position_ids": torch.tensor(positions).cuda()}


def losses_of(attn_implementation: str, steps: int = 5, compiled: bool = False, fused_loss: bool = False,
              dtype: torch.dtype = torch.float32) -> tuple[list[float], list[torch.Tensor]]:
    """AdamW steps of the sharpened model on packed rows: each step's loss, and the last step's gradients."""
    from training.models.compile import compile_layers
    from training.models.fused_loss import fuse_head_and_loss

    model = sharp_model(attn_implementation=attn_implementation).to("cuda", dtype).train()
    if fused_loss:
        fuse_head_and_loss(model)
    if compiled:
        compile_layers(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch, losses = packed_rows(), []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses, [p.grad.float() for p in model.parameters()]


def test_flex_attention_trains_as_sdpa_does_on_cuda():
    """5 steps in fp32 on packed rows: FlexAttention's compiled kernel with the document BlockMask gives the
    per-step losses of sdpa with the dense document mask, within 1e-5."""
    sdpa, _ = losses_of("sdpa")
    flex, _ = losses_of("flex_attention")
    assert flex == pytest.approx(sdpa, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fused_loss_and_compiled_layers_train_as_the_plain_model_does_on_cuda(dtype):
    """The run's GPU kernels together (flex attention, the fused head and loss, each layer compiled by inductor)
    against the plain model: the same per-step losses and last gradients, fp32 within 1e-5, bf16 within 3e-2."""
    tolerance = TOLERANCE[dtype]
    plain, plain_grads = losses_of("flex_attention", dtype=dtype)
    fast, fast_grads = losses_of("flex_attention", compiled=True, fused_loss=True, dtype=dtype)
    assert fast == pytest.approx(plain, rel=tolerance)
    for got, expected in zip(fast_grads, plain_grads):
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_the_fused_adamw_takes_the_foreach_steps_on_cuda():
    """torch's fused AdamW (train.py's default on CUDA, ds_config.choose_adamw_kernel) against its foreach form: 10
    steps of the same gradients, fp32, within 1e-6."""
    weights = {}
    for fused in (False, True):
        torch.manual_seed(0)
        parameters = [torch.nn.Parameter(torch.randn(shape, device="cuda")) for shape in ((512, 256), (256,), (7,))]
        optimizer = torch.optim.AdamW(parameters, lr=1e-2, weight_decay=0.1, fused=fused, foreach=not fused)
        generator = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(10):
            for parameter in parameters:
                parameter.grad = torch.randn(parameter.shape, device="cuda", generator=generator)
            optimizer.step()
        weights[fused] = parameters
    for foreach, fused in zip(weights[False], weights[True]):
        torch.testing.assert_close(fused, foreach, rtol=1e-6, atol=1e-6)


def test_the_fp32_head_gives_fp32_logits_on_cuda():
    """grpo.cast_lm_head_to_fp32 on cuBLAS: bf16 logits are rounded to 8 bits of mantissa (cuBLAS accumulates in fp32
    and rounds the product), the cast head's are the fp32 product of the bf16 hidden states and weight (TF32 is off
    for matrix products by default)."""
    from tests.training.models.test_model import bf16_llama
    from training.models.model import cast_lm_head_to_fp32
    model = bf16_llama(tie=False).cuda()
    ids = torch.randint(0, 1000, (2, 12), device="cuda")
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        exact = hidden.double() @ model.lm_head.weight.double().T
        rounded = model(input_ids=ids).logits
        cast_lm_head_to_fp32(model)
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float32
    assert (logits.double() - exact).abs().max() < 1e-5 < (rounded.double() - exact).abs().max()
