"""The baseline for train_overhead.py: the least code that trains the same model with the same DeepSpeed config.

    deepspeed benchmarks/bare_loop.py --model-config recipes/tiny_llama/config.json --ds-config RUN/ds_config.json \
        --rows PREPARED_DIR --steps 60 --result bare.json

The same packed rows train.py reads, taken in order; no shuffling, token counting, logging, scheduler
or checkpoints.
"""
import argparse
import json
import sys
from pathlib import Path

import datasets
import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from training.base.strict_json import dumps  # noqa: E402
from training.loop.metrics import Stopwatch  # noqa: E402  (train.py's clock: synchronized at both ends)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-config", required=True)
    parser.add_argument("--ds-config", required=True)
    parser.add_argument("--rows", required=True, help="prepared data (python -m data_pipeline prepare's folder)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args(argv)

    deepspeed.init_distributed()
    ds_config = json.load(open(args.ds_config))
    config = AutoConfig.from_pretrained(args.model_config)
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    micro, accumulation = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    rows = datasets.load_from_disk(args.rows)["train"].with_format("torch")  # the prepared data's training split
    seq_len = len(rows[0]["input_ids"])

    clock = Stopwatch()
    for step in range(args.steps):
        if step == 1:  # as train.py: the first step is warm-up
            clock.start()
        for micro_step in range(accumulation):
            first = (step * accumulation + micro_step) * micro % (len(rows) - micro)
            batch = {name: tensor.long().to(engine.device) for name, tensor in rows[first:first + micro].items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
    clock.stop()
    elapsed = clock.take()
    tokens = (args.steps - 1) * ds_config["train_batch_size"] * seq_len
    if torch.distributed.get_rank() == 0:
        Path(args.result).write_text(dumps({"mean_tokens_per_s": tokens / elapsed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
