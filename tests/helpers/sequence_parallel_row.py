"""Run one packed row through a model under Ulysses sequence parallelism (launched with 2 ranks) and save every
token's loss, gathered from the ranks' slices: tests/test_parallelism.py compares them with each document
run alone, without sequence parallelism. On a CPU FlexAttention runs forward passes only (as here), with its
reference implementation.

    deepspeed --num_gpus 2 tests/helpers/sequence_parallel_row.py MODEL_TYPE ATTN_IMPLEMENTATION OUT.pt
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data_pipeline.loader import model_inputs  # noqa: E402
from tests.data_pipeline.test_packed_attention import packed_row, sharp_model  # noqa: E402
from tests.helpers import end_process, ranks_main  # noqa: E402
from training.parallel.sequence_parallel import enable_sequence_parallel  # noqa: E402


def compare(model_type: str, attn_implementation: str, out: str) -> None:
    model = sharp_model(model_type, attn_implementation)
    row, _ = packed_row()
    batch = {name: tensor[None] for name, tensor in row.items()}
    enable_sequence_parallel(model, dist.get_world_size(), micro_batch_size=1, seq_len=batch["input_ids"].shape[1])
    inputs = model_inputs(batch, torch.device("cpu"), (dist.get_rank(), dist.get_world_size()))
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):  # FlexAttention's reference implementation
        logits = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits[0]
    losses = F.cross_entropy(logits, inputs["shift_labels"][0], ignore_index=-100, reduction="none")
    slices = [torch.empty_like(losses) for _ in range(dist.get_world_size())]
    dist.all_gather(slices, losses)
    if dist.get_rank() == 0:
        torch.save(torch.cat(slices), out)
    dist.barrier()


main = ranks_main(compare)

if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
