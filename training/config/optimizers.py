"""Optimizers, by `optimizer.name`: one record each of the facts the code reads about an update rule.

Adding an optimizer is one entry in OPTIMIZERS plus its proof (tests/training/config/test_optimizers.py: the schema
takes its name, the DeepSpeed config its type, the plan counts its states, the loop resolves its builder; and its
first steps against its library in tests/test_optimizers.py, docs/optimizers.md What is proven). An optimizer with
settings of its own also declares their types in the recipe's OptimizerSection. Data only: the code that builds or
checks one is named by "module:function" and loaded by the loop (training/loop/optimizer.py).
"""
from dataclasses import dataclass, field
from typing import Any, Literal

SHAPED_RULES = {  # the state rules counted from the weights' shapes, each with how it keeps its states, in the
    # resume check's words: a rank steps each weight's share in its own shape (training/loop/shaped_optimizer.py)
    "quantized": "in 8-bit blocks",
    "factored": "as a row and a column per matrix",
}


@dataclass(frozen=True)
class OptimizerRecord:
    deepspeed_type: str  # the DeepSpeed config's optimizer.type
    # how the plan counts its states (training/planning/optimizer_states.py): "fixed", state_bytes per parameter,
    # which ZeRO 1-3 shard evenly; "layer_matrices", state_bytes on the decoder layers' matrices and AdamW's 8 on
    # the rest; or a rule of SHAPED_RULES, counted tensor by tensor on each rank's shares of the weights
    state_rule: Literal["fixed", "layer_matrices", "quantized", "factored"]
    state_bytes: float = 0.0  # per parameter ("fixed") or per decoder-layer matrix weight ("layer_matrices")
    # "module:function" building it from the config's optimizer params as the client optimizer DeepSpeed is handed
    # (a factory of the parameter groups; training/loop/optimizer.py); None: DeepSpeed builds the type it names
    builder: str | None = None
    untaken_keys: tuple[str, ...] = ()  # the shipped configs' AdamW settings (optimizer.params) it does not take
    settings: dict[str, str] = field(default_factory=dict)  # its own optimizer.<setting> -> optimizer.params.<key>
    zero3_keys: dict[str, Any] = field(default_factory=dict)  # DeepSpeed config keys it needs at ZeRO-3
    # DeepSpeed's ZeRO-1/2 writes each step's momentum into a staged copy of its momentum partition, which the plan
    # counts beside the states (training/planning/model_states.py muon_staging_bytes)
    staged_momentum: bool = False
    # "module:function" of what it cannot run with, called with (recipe, model config, ZeRO setting) before
    # anything is built; None: it runs with every stage and model
    check: str | None = None
    lora_refused: str | None = None  # why LoRA does not run with it (training/models/lora.py); None: it does
    refused_layouts: dict[str, str] = field(default_factory=dict)  # a parallel degree (parallelism.<key>) -> why it
    # does not run with it above 1; a degree absent runs (training/parallel/support.py's table)
    universal: bool = False  # a resume in another layout (DeepSpeed's universal conversion) is proven with its states

    @property
    def client(self) -> bool:
        """Built here and handed to DeepSpeed, which wraps it under ZeRO as any torch optimizer."""
        return self.builder is not None

    @property
    def shaped(self) -> bool:
        return self.state_rule in SHAPED_RULES


OPTIMIZERS = {
    "adamw": OptimizerRecord("AdamW", "fixed", 8.0, universal=True),  # two fp32 moments
    # torchao's, quantized moments (about 2 bytes per parameter), with torch's AdamW on the embeddings
    "adamw8bit": OptimizerRecord("AdamW8bit", "quantized", builder="training.loop.optimizer:adamw8bit",
                                 untaken_keys=("torch_adam",)),
    # torch's: a factored second moment, whose decay follows the step count (beta2_decay), so no betas; torch's eps
    "adafactor": OptimizerRecord("Adafactor", "factored", builder="training.loop.optimizer:adafactor",
                                 untaken_keys=("eps", "torch_adam", "betas")),
    # lion-pytorch's, not DeepSpeed's (training/loop/optimizer.py): one momentum, and no eps
    "lion": OptimizerRecord("Lion", "fixed", 4.0, builder="training.loop.optimizer:lion",
                            untaken_keys=("eps", "torch_adam")),
    # DeepSpeed's MuonWithAuxAdam: momentum on the decoder layers' matrices, AdamW's moments on the rest
    "muon": OptimizerRecord(
        "Muon", "layer_matrices", 4.0,
        settings={"muon_lr": "muon_lr", "muon_momentum": "momentum"},
        zero3_keys={"zero_optimization.reduce_scatter": False},  # DeepSpeed's ZeRO-3 Muon refuses that gradient path
        staged_momentum=True, check="training.loop.optimizer:check_muon",
        lora_refused="its rule orthogonalizes the decoder layers' matrices, which for LoRA are the low-rank adapters",
        refused_layouts={
            "pipeline_stages": "not built with Muon",
            "tensor_parallel": "not built with Muon (tensor parallelism would split the matrices it orthogonalizes)",
            "sequence_parallel": "not built with Muon",
        }),
}
