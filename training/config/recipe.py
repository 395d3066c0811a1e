"""Recipes: a typed schema (pydantic, unknown keys rejected) loaded from YAML plus `key.path=value` overrides.

Every problem is reported at once, naming the file or override, the key and the fix, before
anything expensive starts.
"""
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationError,
    WrapValidator,
    create_model,
    model_validator,
)

from data_pipeline.config import DataConfig, LocalPath, matching_files, prepared_examples
from data_pipeline.curriculum import phase_steps
from training.base.errors import ConfigError, read_text
from training.base.schema import HubIdOrPath, StrictModel
from training.config.optimizers import OPTIMIZERS
from training.config.overrides import apply_override, parse_override
from training.config.precision import Precision
from training.config.problems import describe_error
from training.objectives.registry import SPECS
from training.objectives.spec import ObjectiveSpec

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


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
    # at the end, hf_average/ beside hf/: the mean of the last K checkpoints' weights (training/state/average.py)
    average_last: int | None = Field(None, ge=2)


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


class RecipeSections(StrictModel):
    model: ModelSection
    tokenizer: TokenizerSection = TokenizerSection()
    data: DataConfig
    training: TrainingSection
    optimizer: OptimizerSection = OptimizerSection()
    deepspeed: DeepSpeedSection = DeepSpeedSection()
    precision: Precision = Precision.AUTO
    fp8: Fp8Section = Fp8Section()
    activation_checkpointing: bool = False
    # torch.compile each decoder layer (training/models/compile.py); auto: on where it is proven faster (CUDA,
    # ZeRO 0-2, data parallel), off on CPU
    compile: Literal["auto"] | bool = "auto"
    # the LM head and cross-entropy in chunks of tokens, gradients taken as it goes: the [tokens, vocab] fp32 logits
    # never exist whole (training/models/fused_loss.py); objective lm only
    fused_loss: bool = True
    parallelism: ParallelismSection = ParallelismSection()
    lora: LoraSection = LoraSection()
    moe: MoeSection = MoeSection()
    export: ExportSection = ExportSection()
    long_context: LongContextSection = LongContextSection()
    checkpointing: CheckpointingSection = CheckpointingSection()
    stability: StabilitySection = StabilitySection()
    logging: LoggingSection = LoggingSection()
    eval: EvalSection = EvalSection()

    _name: str = PrivateAttr("")
    _path: Path = PrivateAttr(Path())

    @property
    def name(self) -> str:
        return self._name

    @property
    def path(self) -> Path:
        """The YAML file the recipe came from."""
        return self._path

    @model_validator(mode="after")
    def consistent(self) -> "RecipeSections":
        if self.tokenizer.name_or_path is None and self.model.name_or_path is None:
            raise ValueError("tokenizer.name_or_path is needed when the model is built from model.config")
        if self.stability.enabled and self.stability.policy == "rewind" and not self.checkpointing.every_steps:
            raise ValueError("stability.policy=rewind goes back to the last checkpoint: set checkpointing.every_steps")
        if self.eval.benchmark_checkpoints and not self.checkpointing.every_steps:
            raise ValueError("eval.benchmark_checkpoints scores the checkpoints saved every checkpointing.every_steps "
                             "steps: set it (the final weights are scored by eval.benchmarks alone)")
        if self.eval.benchmark_checkpoints and self.lora.enabled:
            raise ValueError("eval.benchmark_checkpoints: a LoRA checkpoint holds the adapters alone; score the "
                             "run's merged export (export.merge: true) with eval.benchmarks instead")
        if self.parallelism.pipeline_stages > 1 and (self.long_context.tiled_mlp
                                                     or self.long_context.logits_tile_tokens):
            raise ValueError("long_context tiling with parallelism.pipeline_stages > 1: the pipeline builds its own "
                             "stages from the model's layers and does not tile them; use one or the other")
        if self.long_context.offload_checkpoints and (not self.activation_checkpointing
                                                      or self.parallelism.pipeline_stages > 1):
            raise ValueError("long_context.offload_checkpoints moves activation checkpointing's saved layer inputs "
                             "to host memory: set activation_checkpointing=true (without pipeline stages, whose "
                             "checkpointing DeepSpeed's pipeline engine does)")
        if self.export.merge and not self.lora.enabled:
            raise ValueError("export.merge merges LoRA adapters into the base weights: it needs lora.enabled=true "
                             "(a full fine-tune's hf/ holds its weights already)")
        if self.lora.enabled and not self.model.name_or_path:
            raise ValueError("lora.enabled trains adapters on a frozen base model: set model.name_or_path to the "
                             "checkpoint to adapt (from model.config alone the frozen weights would be random)")
        for spec in SPECS.values():
            if spec.settings and getattr(self, spec.name).model_fields_set and self.training.objective != spec.name:
                raise ValueError(f"{spec.name}.* is set but training.objective is {self.training.objective}: set "
                                 f"training.objective={spec.name} to train on {spec.trains_on}, or remove the "
                                 f"{spec.name} section")
        if check := self.training.spec.check_recipe:
            check(self)
        self.data.examples = self.training.spec.examples  # how the data stage reads and prepares the sources
        held = prepared_examples(Path(self.data.prepared)) if self.data.prepared else self.data.examples
        if held != self.data.examples:
            shown = {"documents": "packed rows", "pairs": "preference pairs", "prompts": "prompts"}
            raise ValueError(f"data.prepared={self.data.prepared} holds {shown[held]}, but training.objective is "
                             f"{self.training.objective}, which trains on {shown[self.data.examples]}; prepare the "
                             f"data with this recipe")
        if self.data.phases:
            self.check_phases()
        if self.data.seq_len_warmup:
            self.check_seq_len_warmup()
        if self.checkpointing.average_last:
            self.check_average()
        if self.data.streaming and self.training.max_steps is None:
            raise ValueError("data.streaming needs training.max_steps: the length of a stream is not known ahead")
        return self

    def check_phases(self) -> None:
        """data.phases against the run: packed documents, a fixed length, the decay phase last under WSD."""
        phases, training = self.data.phases, self.training
        if self.data.examples != "documents":
            raise ValueError(f"data.phases mixes packed documents (training.objective lm or distill), and "
                             f"{training.objective} trains on {training.spec.trains_on}; weight its sources with "
                             f"data.sources' weight")
        if training.max_steps is None:
            raise ValueError("data.phases: set training.max_steps (the phases' steps add up to it) in place of "
                             "training.epochs")
        for index, phase in enumerate(phases):
            if phase.steps == "decay" and (index != len(phases) - 1 or training.schedule != "wsd"):
                raise ValueError(f"data.phases.{index} ({phase.name}) lasts the WSD schedule's decay: it must be the "
                                 f"last phase and training.schedule wsd (it is {training.schedule})")
        phase_steps(phases, training.max_steps, training.decay_steps(training.max_steps),
                    training.global_batch_size * self.data.seq_len)

    def check_average(self) -> None:
        """checkpointing.average_last: the run saves and keeps that many checkpoints of the model's weights."""
        checkpointing, max_steps = self.checkpointing, self.training.max_steps
        last, every = checkpointing.average_last, checkpointing.every_steps
        if self.lora.enabled:
            raise ValueError("checkpointing.average_last averages the model's weights, and a LoRA run's checkpoints "
                             "hold adapters: remove it (or average merged exports with python -m training average)")
        if every is None:
            raise ValueError(f"checkpointing.average_last={last} averages the run's last {last} checkpoints: set "
                             f"checkpointing.every_steps (without it the run saves one, at the end)")
        if checkpointing.keep_last is not None and checkpointing.keep_last < last:
            raise ValueError(f"checkpointing.keep_last={checkpointing.keep_last} removes checkpoints that "
                             f"checkpointing.average_last={last} averages: keep at least {last}")
        if max_steps is not None and -(-max_steps // every) < last:
            raise ValueError(f"checkpointing.average_last={last}: training.max_steps={max_steps} with "
                             f"checkpointing.every_steps={every} saves {-(-max_steps // every)} checkpoints; save more "
                             f"often or average fewer")

    def check_seq_len_warmup(self) -> None:
        """data.seq_len_warmup cuts prepared rows of documents, into micro-batches whose shape changes."""
        start, objective = self.data.seq_len_warmup.start, self.training.objective
        if objective != "lm" or self.data.streaming:
            raise ValueError(f"data.seq_len_warmup cuts the prepared rows of packed documents (training.objective lm, "
                             f"not data.streaming); this run is {objective}"
                             + (" on data.streaming" if self.data.streaming else "") + ": remove it")
        if self.parallelism.pipeline_stages > 1:
            raise ValueError("data.seq_len_warmup changes the micro-batches' shape, and DeepSpeed's pipeline engine "
                             "passes activations of one shape between stages: remove it or parallelism.pipeline_stages")
        if start % self.parallelism.sequence_parallel:
            raise ValueError(f"data.seq_len_warmup.start={start} does not split over parallelism.sequence_parallel="
                             f"{self.parallelism.sequence_parallel} ranks: use a multiple of it")

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer.name_or_path or self.model.name_or_path


def recipe_schema(specs: dict[str, ObjectiveSpec]) -> type[RecipeSections]:
    """The recipe's model: the shared sections above and each objective's own section, under its name."""
    schema = create_model("Recipe", __base__=RecipeSections, __module__=__name__,
                          **{spec.name: (spec.settings, spec.settings()) for spec in specs.values() if spec.settings})
    schema.__doc__ = "A validated recipe: the shared sections and each objective's (training/objectives/registry.py)."
    return schema


Recipe = recipe_schema(SPECS)


def recipe_inputs(recipe: Recipe) -> list[Path]:
    """The local files and folders a run of the recipe reads (hub ids left out): what no output may hold or go
    inside."""
    data = recipe.data
    paths = [recipe.path, recipe.model.config, recipe.model.name_or_path, recipe.tokenizer.name_or_path, data.prepared]
    for source in data.sources + data.eval.sources:
        paths += matching_files(source.path) if source.path else []
    paths += [spec.local_model for spec in data.filters]
    spec = recipe.training.spec
    paths += spec.input_paths(getattr(recipe, spec.name)) if spec.input_paths else []
    return [Path(path) for path in paths if path and Path(path).exists()]


def available_recipes() -> list[str]:
    return sorted(p.parent.name for p in RECIPES_DIR.glob("*/recipe.yaml"))


def recipe_file(name_or_path: str) -> Path:
    """A name under recipes/, a recipe folder, or a YAML file."""
    path = Path(name_or_path)
    if path.is_dir() and (path / "recipe.yaml").is_file():
        return path / "recipe.yaml"
    if path.is_file():
        return path
    if (RECIPES_DIR / name_or_path / "recipe.yaml").is_file():
        return RECIPES_DIR / name_or_path / "recipe.yaml"
    if path.is_dir():
        raise ConfigError(f"--recipe {name_or_path}: a folder without recipe.yaml; name a recipe folder or a recipe "
                          f"YAML file. Available recipes: {', '.join(available_recipes())}")
    raise ConfigError(f"unknown recipe '{name_or_path}': not a folder under {RECIPES_DIR} nor a recipe file. "
                      f"Available recipes: {', '.join(available_recipes())}")


def validate(tree: dict, base_dir: Path, source: str) -> Recipe:
    try:
        return Recipe.model_validate(tree, context={"base_dir": base_dir})
    except ValidationError as error:
        problems = "\n".join(f"  {describe_error(e, Recipe)}" for e in error.errors())
        raise ConfigError(f"{source} has {error.error_count()} problem(s):\n{problems}") from None


def load_recipe(name_or_path: str, overrides: list[str] = ()) -> Recipe:
    """Validate the recipe file, then the file with the command-line overrides applied.

    Paths written in the file count from the file's folder; paths given as overrides from the
    current folder."""
    path = recipe_file(name_or_path).resolve()
    try:
        tree = yaml.safe_load(read_text(path)) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of sections (model, data, training, ...)")
    recipe = validate(tree, path.parent, str(path))
    if overrides:
        tree = recipe.model_dump(exclude_unset=True)
        for text in overrides:
            keys, value = parse_override(text)
            apply_override(tree, keys, value, text)
        recipe = validate(tree, Path.cwd(), f"{path} with the overrides {' '.join(overrides)}")
    recipe._name = path.parent.name if path.name == "recipe.yaml" else path.stem
    recipe._path = path
    return recipe
