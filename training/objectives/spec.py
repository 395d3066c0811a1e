"""What an objective is before anything is built (docs/objectives.md): its recipe section, the traits the plan reads,
its check against the rest of the recipe, and where its run-time class lives. An objective's folder holds its spec
(<name>/spec.py), which loads with the recipe's schema: it imports nothing above training/config."""
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from data_pipeline.config import Examples
from training.base.schema import StrictModel


@dataclass(frozen=True)
class HeadTraits:
    """What an objective's loss adds to the activations at the LM head (docs/objectives.md), as the plan counts them
    (training/planning/activations.py)."""
    entropy_gradient: bool = False  # the loss differentiates an entropy: the fp32 probabilities saved beside the
    # log-probabilities, one more [tokens, vocabulary] fp32 tensor
    fp32_head: bool = False  # the head computes in fp32 in a run of lower precision: its input saved in fp32 and
    # its logits made in fp32, beside an fp32 copy of its weight
    divergence_tile: tuple[int, int] | None = None  # the loss projects the head, and another model's beside it, over
    # tiles of (tokens, vocabulary entries) in fp32, in the forward pass and again in the backward (distill: TRL's
    # chunked divergence), from a copy of the target tokens' hidden states: no logits saved; two fp32 tiles and the
    # fp32 gradients of the hidden states and of the head's weight live


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str  # training.objective's value, and its recipe section's key
    runtime: str  # "module:Class" of its Objective (training/objectives/base.py), loaded by the run's top layer
    trains_on: str  # what it trains on, in the error for a section set under another objective
    model_loss: bool  # its loss is the model's next-token loss over target tokens, which the fused loss may replace
    rows_per_example: int  # the rows a training example takes at most, for the memory plan (a DPO pair: 2)
    unit: str  # what micro_batch_size and global_batch_size count
    examples: Examples  # what the data holds (data_pipeline/config.py)
    statistics_chunk_tokens: int = 0  # the tokens at a time it reads statistics of the logits in, without a
    # gradient (dpo: TRL's token metrics and WPO's weights), whose chunk the plan counts; 0: none
    memory: str | None = None  # "module:function" of what it holds per rank beside the trained model (its
    # <name>/memory.py: a reference, reward models, a generation), loaded by the plan (training/planning/
    # objective_memory.py); the module sits at the planning layer
    generation_length: str | None = None  # where its memory term counts a generation: the setting that bounds how
    # long one runs, which micro_batch_size=auto's refusal names as a fix when a generation holds the most
    run_files: tuple[str, ...] = ()  # the files its run writes into the output folder by name, which the folder's
    # rules hold as the run's (training/state/output_dir.py)
    settings: type[StrictModel] | None = None  # its recipe section, under `name`
    head_traits: Callable[[Any], HeadTraits] | None = None  # its section -> what its loss adds at the head, for the
    # memory plan; None: nothing
    check_recipe: Callable[[Any], None] | None = None  # its section against the rest of the validated recipe: raises
    # ValueError (reported as the recipe's problem); may fill the data section's settings that follow from it
    input_paths: Callable[[Any], list[str | None]] | None = None  # its section -> the checkpoints it reads beside
    # the model's (a teacher, reward models), which no output may hold or go inside (recipe_inputs)
    refused_layouts: dict[str, str] = field(default_factory=dict)  # a parallel degree (parallelism.<key>) -> why
    # the objective does not run with it above 1; a degree absent runs (training/parallel/support.py's table)


TRL_SHARED_NAMES = {  # DPOConfig's and GRPOConfig's alike, for the unknown-key error: where they live here
    "model_init_kwargs": "the model section builds the model (model.name_or_path, model.attn_implementation, "
                         "model.trust_remote_code) in the run's precision",
    "trust_remote_code": "write model.trust_remote_code",
    "router_aux_loss_coef": "write moe.aux_loss_coef (0 with dpo and grpo: their losses have no place for the "
                            "router's)",
    "pad_to_multiple_of": "rows are data.seq_len long when packed (data.packing), else padded to the micro-batch's "
                          "longest",
}
