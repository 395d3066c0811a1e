"""What a run will cost before it starts, and the plan it runs by.

  shape.py             the model's architecture numbers, read from a model built on the meta device
  plan.py              the run plan (recipe, shape, precision, ZeRO config, layout) and the machine it plans for
  layout.py            the run's layout: what its checkpoints' states belong to
  ds_config.py         the DeepSpeed JSON configs: found, merged with the recipe's overrides, every "auto" resolved
  precision.py         which precision a run uses on this machine
  kernels.py           which kernels a run uses (the fused loss)
  model_states.py      weights, gradients and optimizer states per rank under each ZeRO setting, DeepSpeed's buffers
  optimizer_states.py  the optimizers' state bytes per parameter
  activations.py       one micro-batch's activations, with and without checkpointing
  objective_memory.py  what the objective holds beside the model, from its spec's memory term (its memory.py)
  memory.py            the totals per rank and whether they fit
  checkpoint_size.py   what a checkpoint save and the export write
  flops.py             FLOPs per token, the GPU's peak and bandwidth
  auto_config.py       deepspeed.config=auto: the least-sharded ZeRO setting that fits
  micro_batch.py       training.micro_batch_size=auto: the largest micro-batch that fits
  report.py            what --dry-run prints
"""
