"""Recipes: a typed schema (pydantic, unknown keys rejected) loaded from YAML plus `key.path=value` overrides.

Every problem is reported at once, naming the file or override, the key and the fix, before
anything expensive starts.
"""
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    PrivateAttr,
    ValidationError,
    create_model,
    model_validator,
)

from data_pipeline.config import DataConfig, LocalPath, matching_files, prepared_examples
from training.base.errors import ConfigError, read_text
from training.base.schema import StrictModel
from training.config.cross_checks import check_average, check_phases, check_seq_len_warmup
from training.config.overrides import apply_override, parse_override
from training.config.precision import Precision
from training.config.problems import describe_error
from training.config.sections import (
    CheckpointingSection,
    DeepSpeedSection,
    EvalSection,
    ExportSection,
    Fp8Section,
    LoggingSection,
    LongContextSection,
    LoraSection,
    ModelSection,
    MoeSection,
    OptimizerSection,
    ParallelismSection,
    StabilitySection,
    TokenizerSection,
    TrainingSection,
)
from training.objectives.registry import SPECS
from training.objectives.spec import ObjectiveSpec

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


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
    # what compiling makes (torch's FX-graph and AOT-autograd caches; on a GPU Triton's kernels too), kept for the next
    # run of the recipe on this machine and for a resume, which reuse it (training/models/compile.py); null:
    # TORCHINDUCTOR_CACHE_DIR where it is set, else ~/.cache/deepspeed-recipes/compile
    compile_cache_dir: LocalPath | None = None
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
            check_phases(self.data, self.training)
        if self.data.seq_len_warmup:
            check_seq_len_warmup(self.data, self.training, self.parallelism)
        if self.checkpointing.average_last:
            check_average(self.checkpointing, self.training, self.lora)
        if self.data.streaming and self.training.max_steps is None:
            raise ValueError("data.streaming needs training.max_steps: the length of a stream is not known ahead")
        return self

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
