"""Evaluation: the mean token loss over the evaluation rows, every data-parallel rank its share, and its
perplexity; through the pipeline's own evaluation schedule when there are stages."""
import math
from itertools import islice

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from data_pipeline.loader import EvalBatches, model_inputs, target_count
from training.models.moe import without_router_loss
from training.parallel import distributed
from training.parallel.pipeline import pipeline_batches
from training.parallel.tensor_parallel import loss_copies


def evaluate(engine: deepspeed.DeepSpeedEngine, batches: EvalBatches, shard: tuple[int, int] = (0, 1)) -> dict:
    """Mean token loss over the evaluation rows (every data-parallel rank its share; under sequence parallelism
    each rank its `shard` of them) and its perplexity."""
    if isinstance(engine, PipelineEngine):
        loss_sum, targets = pipeline_eval_sums(engine, batches)
    else:
        loss_sum, targets = eval_sums(engine, batches, shard)
    copies = dist.get_world_size() // batches.dp_size  # the ranks of a pipeline or sequence group hold the same rows
    loss_sum /= loss_copies(engine)
    loss = loss_sum / (distributed.all_reduce_on_host([targets])[0] / copies)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}


def eval_sums(engine: deepspeed.DeepSpeedEngine, batches: EvalBatches, shard: tuple[int, int]) -> tuple[float, int]:
    """The summed token loss of every rank's rows, and this rank's target count."""
    engine.eval()
    loss_sum, targets = torch.zeros((), dtype=torch.float64, device=engine.device), 0
    with torch.no_grad(), without_router_loss(engine.module.config):
        for batch in batches:
            loss_sum += engine(**model_inputs(batch, engine.device, shard), num_items_in_batch=1).loss.double()  # a sum
            targets += target_count(batch)
    engine.train()
    return distributed.all_reduce(loss_sum).item(), targets


def pipeline_eval_sums(engine: PipelineEngine, batches: EvalBatches) -> tuple[float, int]:
    """The same through the pipeline's own evaluation schedule, which returns the mean of its micro-batches'
    losses over them and the data-parallel ranks."""
    engine.module.loss_fn.targets_per_micro_batch = 1.0  # the loss function then returns summed token losses
    loss_sum, targets, remaining = 0.0, 0, iter(batches)
    while chunk := list(islice(remaining, engine.micro_batches)):
        mean = engine.eval_batch(pipeline_batches(chunk), num_micro_batches=len(chunk))
        loss_sum += float(mean) * len(chunk) * batches.dp_size
        targets += sum(map(target_count, chunk))
    return loss_sum, targets
