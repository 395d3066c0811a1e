"""The recipe's sections but data (data_pipeline/config.py): one pydantic model each, with the checks that stay
inside it. recipe.py puts them together."""
import math
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    WrapValidator,
    model_validator,
)

from data_pipeline.config import LocalPath
from training.base.schema import HubIdOrPath, StrictModel
from training.config.optimizers import OPTIMIZERS
from training.objectives.registry import SPECS
from training.objectives.spec import ObjectiveSpec


def finite_numbers(tree: Any) -> Any:
    """A free-form mapping (passed on to transformers or DeepSpeed) holds no .inf or .nan."""
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else [tree]
    for value in values:
        if isinstance(value, (dict, list)):
            finite_numbers(value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{value} is not a finite number")
    return tree


FreeForm = Annotated[dict[str, Any], AfterValidator(finite_numbers)]


def regular_expression(value: list[str] | str) -> list[str] | str:
    """lora.target_modules as a string other than all-linear is a regular expression over the full module names."""
    if isinstance(value, str) and value != "all-linear":
        try:
            re.compile(value)
        except re.error as error:
            raise ValueError(f"{value!r} is not a valid regular expression ({error}); write one that matches full "
                             f"module names (e.g. '.*\\.(q_proj|v_proj)'), or a list of name suffixes") from None
    return value


class ModelSection(StrictModel):
    """`config` alone trains from scratch; `name_or_path` alone fine-tunes a checkpoint; both: the weights come
    from `name_or_path` and the shipped `config` (the same architecture) lets --dry-run and the checks run
    without downloading anything."""
    config: LocalPath | None = None  # architecture: a config.json or its folder
    name_or_path: HubIdOrPath | None = None  # checkpoint to start from: hub id or local folder
    config_overrides: FreeForm = {}  # e.g. {num_hidden_layers: 2} to shrink a model for a smoke test
    # auto: flex_attention on CUDA (packed documents at flash speed), sdpa elsewhere (training/models/attention.py)
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"] = "auto"
    trust_remote_code: bool = False  # run Python code shipped with a hub checkpoint: only for checkpoints you trust

    @model_validator(mode="after")
    def one_source(self) -> "ModelSection":
        if self.config is None and self.name_or_path is None:
            raise ValueError("set model.config (an architecture to train from scratch), model.name_or_path (a "
                             "checkpoint to start from), or both (the checkpoint's architecture, shipped)")
        return self


class TokenizerSection(StrictModel):
    name_or_path: HubIdOrPath | None = None  # default: model.name_or_path


def number_or_auto(value: Any, handler: Callable[[Any], Any]) -> int | str:
    """training.micro_batch_size's one message for every wrong value (pydantic would give one per union member)."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(f"a positive whole number of rows per rank, or auto (the largest micro-batch that fits the "
                         f"memory plan, training/planning/micro_batch.py); got {value!r}") from None


MicroBatchSize = Annotated[PositiveInt | Literal["auto"], WrapValidator(number_or_auto)]


def known_objective(name: str) -> str:
    if name not in SPECS:
        raise ValueError(f"{name!r} is not an objective here; use one of {', '.join(map(repr, SPECS))}")
    return name


class TrainingSection(StrictModel):
    objective: Annotated[str, AfterValidator(known_objective)] = "lm"  # SPECS: lm, next-token loss (pretraining,
    # SFT); dpo, preference pairs (dpo:)
    micro_batch_size: MicroBatchSize  # rows per rank per forward pass (dpo: pairs, packed into as few rows as fit);
    # auto: the largest that fits the memory plan, a number once the plan is made
    global_batch_size: PositiveInt  # rows per optimizer step = micro x accumulation x data-parallel ranks (dpo: pairs)
    max_steps: PositiveInt | None = None
    epochs: PositiveInt | None = None
    lr: PositiveFloat
    schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    warmup_steps: NonNegativeInt = 0
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine and wsd end at lr x min_lr_ratio; linear ends at 0
    decay_ratio: float = Field(0.2, gt=0, le=1)  # wsd: share of the steps spent in the final decay
    weight_decay: NonNegativeFloat = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: PositiveFloat = 1e-8
    grad_clip: NonNegativeFloat = 1.0  # 0 turns clipping off
    seed: int = 1234
    eval_every_steps: PositiveInt | None = None  # with an eval split (data.eval): also at the end of the run
    eval_max_rows: PositiveInt | None = None  # None: every evaluation row (dpo: pair; grpo: prompt)

    @property
    def spec(self) -> ObjectiveSpec:
        """What the objective is before anything is built (training/objectives/<name>/spec.py)."""
        return SPECS[self.objective]

    def total_steps(self, steps_per_epoch: int) -> int:
        """The run's optimizer steps: max_steps, or epochs of `steps_per_epoch` (the training batches')."""
        return self.max_steps or self.epochs * steps_per_epoch

    def decay_steps(self, total_steps: int) -> int:
        """The WSD schedule's final decay: its last decay_ratio of the steps, one at least."""
        return max(1, round(self.decay_ratio * total_steps))

    @model_validator(mode="after")
    def steps_or_epochs(self) -> "TrainingSection":
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of training.max_steps and training.epochs")
        return self


class OptimizerSection(StrictModel):
    """Which update rule: a record of training/config/optimizers.py. The learning rate, betas, eps, weight decay and
    clipping stay in `training`: AdamW and AdamW8bit use them all, Lion all but eps, Adafactor the rate and weight
    decay (each record's untaken_keys), Muon its own rate and momentum for the decoder layers' matrices and AdamW
    (training.*) for the rest. Below `name`, the settings the records own (their `settings`)."""
    name: Literal[tuple(OPTIMIZERS)] = "adamw"
    muon_lr: PositiveFloat = 0.02  # Muon's matrices (the schedule scales it as it scales training.lr)
    muon_momentum: float = Field(0.95, gt=0, lt=1)  # Muon's momentum (Nesterov)

    @model_validator(mode="after")
    def settings_only_for_their_optimizer(self) -> "OptimizerSection":
        owner = {setting: name for name, record in OPTIMIZERS.items() for setting in record.settings}
        stray = sorted(setting for setting in self.model_fields_set & owner.keys() if owner[setting] != self.name)
        if stray:
            raise ValueError(f"optimizer.{stray[0]} applies to optimizer.name={owner[stray[0]]}, not {self.name}")
        return self


class DeepSpeedSection(StrictModel):
    config: str = "zero1"  # a name under ds_configs/ (zero0..zero3, zero2_offload, ...), a JSON file, or auto
    # (auto: chosen from the memory plan, training/planning/auto_config.py)
    overrides: FreeForm = {}  # merged into that JSON, e.g. {zero_optimization: {overlap_comm: false}}


class ParallelismSection(StrictModel):
    pipeline_stages: PositiveInt = 1  # > 1: DeepSpeed pipeline parallelism; world size = data-parallel x stages
    partition_method: Literal["parameters", "uniform"] = "parameters"  # balance stages by parameters or by layers
    # > 1: Ulysses; each row split over this many ranks (training/parallel/sequence_parallel.py)
    sequence_parallel: PositiveInt = 1
    # > 1: AutoTP; each matrix split over this many ranks (training/parallel/tensor_parallel.py)
    tensor_parallel: PositiveInt = 1
    # > 1: AutoEP; each MoE layer's experts split over this many ranks (training/parallel/expert_parallel.py)
    expert_parallel: PositiveInt = 1


class LongContextSection(StrictModel):
    """ALST's memory savers for long rows (training/models/long_context.py); useful with or without sequence
    parallelism."""
    tiled_mlp: bool = False  # the MLPs on tiles of hidden_size tokens: their intermediate activations never whole
    logits_tile_tokens: PositiveInt | None = None  # head and loss on tiles of this many tokens: no whole logits
    offload_checkpoints: bool = False  # activation checkpointing's saved layer inputs held in host memory


class Fp8Section(StrictModel):
    """precision: fp8 only (training/models/fp8.py)."""
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"  # torchao's scaling recipes
    lm_head: bool = False  # also the LM head in FP8 (kept in BF16 by default: its logits feed the loss directly)
    exclude: list[str] = []  # module names (fnmatch patterns) kept in BF16, e.g. ["model.layers.0.*"]


class LoraSection(StrictModel):
    """Low-rank adapters (peft) trained on a frozen base model (training/models/lora.py)."""
    enabled: bool = False
    rank: PositiveInt = 16
    alpha: PositiveFloat = 32  # the adapters' output is scaled by alpha / rank
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapters' input
    # module name suffixes, a regular expression over the full names, or all-linear (every linear layer but the LM
    # head; MoE experts' fused weights are not linear layers)
    target_modules: Annotated[list[str] | str, AfterValidator(regular_expression)] = "all-linear"
    modules_to_save: list[str] = []  # modules trained in full besides the adapters, e.g. [lm_head]
    quantize: Literal["none", "nf4"] = "none"  # nf4: QLoRA, the frozen base model in 4 bits (bitsandbytes, CUDA)

    @model_validator(mode="after")
    def settings_only_when_enabled(self) -> "LoraSection":
        stray = sorted(self.model_fields_set - {"enabled"})
        if stray and not self.enabled:
            raise ValueError(f"lora.{stray[0]} is set but lora.enabled is false: set lora.enabled=true to train "
                             f"adapters, or remove the lora settings")
        return self


class MoeSection(StrictModel):
    """Mixture-of-experts models (training/models/moe.py)."""
    aux_loss_coef: NonNegativeFloat | None = None  # the router's load-balancing loss in the training loss, times
    # this; None: the checkpoint config's router_aux_loss_coef; 0: off


class ExportSection(StrictModel):
    merge: bool = False  # with lora: also write the base weights with the adapters merged into them (hf/)


class CheckpointingSection(StrictModel):
    every_steps: PositiveInt | None = None  # None: only at the end
    keep_last: PositiveInt | None = None  # None: keep every checkpoint
    # written in the background while training goes on; `latest` moves once every rank's files are on disk
    # (training/state/saving.py, docs/checkpoints.md)
    asynchronous: bool = True
    # at the end, hf_average/ beside hf/: the mean of the last K checkpoints' weights (training/state/average.py)
    average_last: int | None = Field(None, ge=2)

    def save_steps(self, max_steps: int) -> list[int]:
        """The steps a run of max_steps saves at: every every_steps, and the last."""
        return sorted({*range(self.every_steps or max_steps, max_steps + 1, self.every_steps or max_steps), max_steps})


class StabilitySection(StrictModel):
    """Non-finite and spiking steps (training/loop/stability.py). A step whose loss or gradient is not finite is never
    applied; a loss spike is not applied either, and with `rewind` the run also goes back to its last checkpoint."""
    enabled: bool = True
    policy: Literal["skip", "rewind"] = "skip"  # skip: pass over the batch; rewind: to the last checkpoint, past it
    window: PositiveInt = 50  # recent applied steps that a spike is measured against
    min_history: PositiveInt = 20  # applied steps before spikes are looked for (losses fall fast at first)
    spike_sigma: PositiveFloat = 6.0  # a loss spike: above the window's mean by this many standard deviations
    spike_grad_factor: PositiveFloat | None = None  # a gradient spike: norm above this x the window's median (off:
    # tiny_llama's own default run has a norm 19x its median without any loss spike; clipping bounds such a step)
    max_skips: PositiveInt = 10  # this many skipped batches within skip_window steps: save and stop (exit 3)
    skip_window: PositiveInt = 100
    max_rewinds: PositiveInt = 3  # then save and stop (exit 3): the data or the settings need a human
    rewind_lr_factor: float = Field(1.0, gt=0, le=1)  # after a rewind, the learning rate x this ...
    rewind_lr_steps: NonNegativeInt = 0  # ... for this many steps

    @model_validator(mode="after")
    def history_fits_the_window(self) -> "StabilitySection":
        if self.min_history > self.window:
            raise ValueError(f"stability.min_history={self.min_history} is more than stability.window={self.window}: "
                             f"the window would never hold that many steps, and no spike would be looked for")
        return self


class LoggingSection(StrictModel):
    every_steps: PositiveInt = 10
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = ["tensorboard"]  # training/loop/trackers.py
    project: str | None = None  # the W&B project and MLflow experiment; default: the recipe's name
    run_name: str | None = None  # the tracker run's name; default: the output folder's name
    # the GPU's dense bf16 peak that MFU divides by; default: training/planning/flops.py
    peak_tflops: PositiveFloat | None = None

    @model_validator(mode="before")
    @classmethod
    def tensorboard_is_a_tracker(cls, data: object) -> object:
        if isinstance(data, dict) and "tensorboard" in data:
            raise ValueError("logging.tensorboard is now one of logging.report_to's trackers: write report_to: "
                             "[tensorboard] (the default), [tensorboard, wandb, mlflow], or [] for none")
        return data


class EvalSection(StrictModel):
    benchmarks: list[str] = []  # lm-eval tasks run on hf/ at the end of training (training/loop/benchmarks.py)
    benchmark_checkpoints: bool = False  # also on each periodic checkpoint, as it is saved
    batch_size: PositiveInt = 8
    limit: PositiveInt | None = None  # at most this many examples per task

    @model_validator(mode="after")
    def checkpoints_need_tasks(self) -> "EvalSection":
        if self.benchmark_checkpoints and not self.benchmarks:
            raise ValueError("benchmark_checkpoints runs eval.benchmarks on each checkpoint: name the tasks, e.g. "
                             "eval.benchmarks=[python_docs_mc]")
        return self
