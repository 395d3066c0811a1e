"""lora.quantize: nf4 (QLoRA) on an NVIDIA GPU: the base loads in 4 bits under ZeRO-3 and the adapters train.

Skipped, with the reason, without CUDA or without bitsandbytes (the optional extra: pip install -r
requirements-qlora.txt); the refusal on machines without CUDA is tested in tests/training/models/test_lora.py.
One rank, ZeRO-3 (the quant-storage path through zero.Init), 6 steps on the shrunk tiny_llama checkpoint:
the decoder's linear layers are bitsandbytes 4-bit layers, the loss is finite and falls, the adapter exports,
and its logits over the 4-bit base match the engine's (bf16: 2e-2).
"""
import importlib.util
import json
import math

import pytest
import torch

from tests.conftest import run_train, save_small_checkpoint

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="QLoRA's 4-bit layers need an NVIDIA GPU; "
                                 "torch.cuda.is_available() is False"),
              pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                 reason="bitsandbytes is not installed: pip install -r requirements-qlora.txt")]


def test_qlora_trains_under_zero3_and_exports_the_adapter(tmp_path, data_cache):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from training.models.lora import nf4_quantization
    base, out = tmp_path / "base", tmp_path / "run"
    save_small_checkpoint(base)
    result = run_train(["--recipe", "tiny_llama_sft", "--output-dir", str(out), f"model.name_or_path={base}",
                        data_cache, "lora.enabled=true", "lora.quantize=nf4", "precision=bf16",
                        "deepspeed.config=zero3", "training.max_steps=6", "training.lr=1e-2",
                        "logging.every_steps=1", "--record-logits"], ranks=1,
                       script="tests/helpers/train_with_probes.py")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]
    recorded = torch.load(out / "engine_logits.pt")
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=nf4_quantization(torch.bfloat16),
                                                 dtype=torch.bfloat16, device_map={"": 0})
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    adapted = PeftModel.from_pretrained(model, out / "adapter").eval()
    with torch.no_grad():
        logits = adapted(**{k: recorded[k].cuda() for k in ("input_ids", "position_ids")},
                         use_cache=False).logits.float().cpu()
    torch.testing.assert_close(logits, recorded["logits"].float(), atol=2e-2, rtol=2e-2)
