"""Run through the deepspeed launcher on 2 ranks: a tiny model of the given family (and tying) as a
2-stage pipeline, one training step on a packed batch; rank 0 prints the pipeline's loss and plain
transformers' loss on the same weights and batch as JSON.

    deepspeed --num_gpus 2 tests/helpers/pipeline_loss.py MODEL_TYPE [tied]
"""
import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import end_process, ranks_main  # noqa: E402
from training.parallel.pipeline import TokenMeanLoss, build_pipeline  # noqa: E402

SEED, VOCAB = 1234, 512


def compare(model_type: str, *flags: str) -> None:
    tied = "tied" in flags
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  use_cache=False, tie_word_embeddings=tied, max_position_embeddings=128)
    loss = TokenMeanLoss()
    module = build_pipeline(config, 2, "parameters", False, loss, None, SEED)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=ds_config)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (4, 32), generator=generator)
    position_ids = torch.cat([torch.arange(10), torch.arange(22)]).expand(4, 32).contiguous()  # two documents a row
    labels = input_ids.clone()
    labels[:, [0, 10]] = -100
    targets = int((labels[:, 1:] != -100).sum())
    loss.targets_per_micro_batch = targets / 2
    micro_batches = [((input_ids[i:i + 2], position_ids[i:i + 2]), labels[i:i + 2]) for i in (0, 2)]
    pipelined = engine.train_batch(data_iter=iter(micro_batches)).item()
    torch.manual_seed(SEED)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100,
                               reduction="sum").item() / targets
    if dist.get_rank() == 0:
        print(json.dumps({"pipeline": pipelined, "transformers": expected}))


main = ranks_main(compare)

if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
