#!/usr/bin/env bash
# One device call: issue 52's GPU measurements (not committed).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout 150 deepspeed --num_gpus 1 train.py --recipe tiny_llama_grpo --output-dir /tmp/g2 model.name_or_path=null \
  model.config=benchmarks/llama_1b/config.json tokenizer.name_or_path=recipes/tiny_llama/tokenizer grpo.beta=0 \
  data.packing=none data.seq_len=160 grpo.max_completion_length=128 deepspeed.config=zero2 training.max_steps=3 \
  logging.every_steps=1 > $OUT/grpo_zero2.log 2>&1
echo "grpo cell rc=$? at $(( $(date +%s) - t0 )) s"
cp /tmp/g2/metrics.jsonl $OUT/grpo_zero2_metrics.jsonl
grep -c recompile_limit $OUT/grpo_zero2.log
timeout 85 python3 benchmarks/generation_batch.py --batches 64,512 2>&1 | grep -v Warning | tee $OUT/generation_batch.log
echo "benchmark rc=$? at $(( $(date +%s) - t0 )) s"
