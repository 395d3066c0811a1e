"""The recipe's `data:` section: a typed schema, validated once, unknown keys rejected."""
import glob
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    model_validator,
)

from data_pipeline.dedup import MinHasher
from data_pipeline.files import emptiness
from training.base.errors import DataError
from training.base.schema import StrictModel

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt")
PREPARE_AGAIN = ("prepare it again (`python -m data_pipeline prepare --recipe R --output NEW_DIR`) and set "
                 "data.prepared=NEW_DIR")


def resolve_path(value: str, info: ValidationInfo) -> str:
    """Make a path absolute. Relative paths count from `base_dir` in the validation context: the
    recipe file's folder for values written in the recipe, the current folder for command-line overrides."""
    path = Path(value).expanduser()
    base_dir = (info.context or {}).get("base_dir")
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return str(path.resolve())


def matching_files(path: str) -> list[str]:
    """The files a source path names: itself, or those a glob pattern (a sharded corpus) matches."""
    return sorted(glob.glob(path)) if any(c in path for c in "*?[") else [path]


def existing_data_file(value: str) -> str:
    files = matching_files(value)
    if not files:
        raise ValueError(f"no file matches {value}")
    for file in files:
        if not Path(file).is_file():
            raise ValueError(f"file not found: {file}")
        if Path(file).suffix not in SUPPORTED_SUFFIXES:
            raise ValueError(f"{file}: unsupported file type; use one of {', '.join(SUPPORTED_SUFFIXES)}")
    empty = [(file, how) for file in files if (how := emptiness(file))]
    if len(empty) == len(files):  # an empty shard among others is fine: the source still holds documents
        if len(files) == 1:
            raise ValueError(f"{files[0]} is empty ({empty[0][1]}): it holds no documents; fill it, or remove the "
                             f"source")
        raise ValueError(f"every file {value} matches is empty: the source holds no documents; fill them, or "
                         f"remove the source")
    return value


def existing_prepared_dir(value: str) -> str:
    if not (Path(value) / "stats.json").is_file():
        raise ValueError(f"{value} is not a prepared data set (no stats.json); make one with "
                         f"`python -m data_pipeline prepare --recipe R --output {value}`")
    check_prepared(Path(value), PREPARE_AGAIN)
    return value


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def read_arrow(path: Path) -> None:
    import pyarrow as pa  # here, not at the top: `python -m data_pipeline dedup` reads no Arrow file
    with pa.memory_map(str(path)) as source:
        pa.ipc.open_stream(source).read_all()


def check_prepared(folder: Path, fix: str) -> None:
    """Every file of a prepared folder (`datasets.save_to_disk` layout plus stats.json) reads: a truncated or damaged
    one is named before any work, not met as a traceback mid-run. Cheap: the Arrow files are memory-mapped and
    only their record batches' headers are read, as `datasets.load_from_disk` does."""
    def read(path: Path, reader: Callable[[Path], Any]) -> Any:
        try:
            return reader(path)
        except (OSError, ValueError, KeyError, TypeError) as error:  # pyarrow's ArrowInvalid and JSON's are ValueErrors
            reason = (error.strerror if isinstance(error, OSError) and error.strerror else
                      f"no {error} entry" if isinstance(error, KeyError) else str(error))
            raise DataError(f"{folder} is a damaged prepared data set: {path}: {reason}; {fix}") from None

    read(folder / "stats.json", read_json)
    for split in read(folder / "dataset_dict.json", lambda path: list(map(str, read_json(path)["splits"]))):
        read(folder / split / "dataset_info.json", read_json)
        for name in read(folder / split / "state.json",
                         lambda path: [str(entry["filename"]) for entry in read_json(path)["_data_files"]]):
            read(folder / split / name, read_arrow)


Examples = Literal["documents", "pairs", "prompts"]  # what a training example is: see DataConfig.examples


def prepared_examples(folder: Path) -> Examples:
    """What a prepared folder holds: packed rows of documents, preference pairs (training.objective=dpo) or prompts
    (grpo)."""
    features = read_json(folder / "train" / "dataset_info.json")["features"]
    return "pairs" if "chosen_ids" in features else "prompts" if "prompt_ids" in features else "documents"


LocalPath = Annotated[str, AfterValidator(resolve_path)]


class DataSource(StrictModel):
    """One data set: a local file or a Hugging Face hub data set, with text for pretraining or chat
    `messages` (a list of {role, content}) for SFT."""
    path: Annotated[LocalPath, AfterValidator(existing_data_file)] | None = None  # a file or a glob of shards
    hub: str | None = None  # e.g. HuggingFaceFW/fineweb-edu (needs the network)
    subset: str | None = None  # the hub data set's configuration name
    split: str = "train"
    text_field: str | None = None  # default "text" unless messages_field is set
    messages_field: str | None = None
    prompt_field: str = "prompt"  # training.objective=dpo and grpo: a string or chat messages; dpo without it,
    # conversational chosen/rejected carry the prompt as their shared first messages (TRL's implicit prompt)
    chosen_field: str = "chosen"  # dpo: the preferred completion (a string, or chat messages)
    rejected_field: str = "rejected"  # dpo: the other completion
    weight: PositiveFloat = 1.0  # a sampling rate, not a probability: 0.5 = a random half, 2 = every document twice
    label: str | None = None  # what data.phases' weights call it; default: the file's name without its suffix (a
    # hub data set's name after its last /)
    score_field: str | None = None  # a numeric field of each record, the document's quality score (FineWeb-Edu's
    # `score`), which data.phases' order highest_score_first sorts by (data_pipeline/curriculum.py)

    @model_validator(mode="after")
    def one_location_one_kind(self) -> "DataSource":
        if (self.path is None) == (self.hub is None):
            raise ValueError("set exactly one of path (a local file) and hub (a Hugging Face data set name)")
        if self.text_field is not None and self.messages_field is not None:
            raise ValueError("set text_field (pretraining) or messages_field (chat SFT), not both")
        if self.messages_field is None and self.text_field is None:
            self.text_field = "text"
        return self

    @property
    def name(self) -> str:
        return self.path or f"{self.hub}:{self.subset or 'default'}:{self.split}"

    @property
    def key(self) -> str:
        """The label data.phases' weights use."""
        if self.label:
            return self.label
        return Path(self.path).name.split(".")[0] if self.path else self.hub.rsplit("/", 1)[-1]


class PhaseConfig(StrictModel):
    """One `data.phases` entry: a stretch of the run that draws its rows from the sources by its own weights
    (data_pipeline/curriculum.py). Its length is `steps`, `tokens` (rounded up to whole steps), `steps: decay` (the
    WSD schedule's final decay: the last phase then anneals while the learning rate falls) or, for one phase, nothing:
    the steps the others leave of training.max_steps."""
    name: str
    steps: PositiveInt | Literal["decay"] | None = None
    tokens: PositiveInt | None = None
    weights: dict[str, NonNegativeFloat]  # by source label; a source left out gets none of the phase's rows
    # the phase's rows in a seeded random order; those with the fewest real tokens first (with packing bfd or none:
    # short documents before long ones); or those whose documents score highest first (data.sources' score_field, or
    # the classifier filter's score)
    order: Literal["shuffled", "shortest_first", "highest_score_first"] = "shuffled"
    buckets: PositiveInt | None = None  # an ordered phase read in this many buckets, each in a seeded random order

    @model_validator(mode="after")
    def one_length(self) -> "PhaseConfig":
        if self.steps is not None and self.tokens is not None:
            raise ValueError(f"phase {self.name!r}: set steps or tokens, not both")
        if self.buckets and self.order == "shuffled":
            raise ValueError(f"phase {self.name!r}: buckets split an ordered phase (order shortest_first or "
                             f"highest_score_first), and its order is shuffled")
        if not any(self.weights.values()):
            raise ValueError(f"phase {self.name!r}: its weights are all 0; give a source a positive weight")
        return self


class LengthWarmupConfig(StrictModel):
    """`data.seq_len_warmup`: the sequence length grows from `start` to data.seq_len over the first `steps` steps,
    the tokens per step kept by cutting each row into shorter ones (data_pipeline/length_warmup.py)."""
    start: PositiveInt  # the first step's sequence length: it divides data.seq_len
    steps: PositiveInt  # the step from which the rows are data.seq_len long


class DedupConfig(StrictModel):
    exact: bool = True  # identical text after lowercasing and collapsing whitespace
    near: bool = False  # MinHash + LSH near duplicates
    threshold: float = Field(0.8, gt=0, le=1)  # Jaccard similarity of the shingle sets
    num_perm: int = Field(128, ge=2, le=4096)  # hash functions per signature (the LSH bands split them)
    shingle: Literal["word", "char"] = "word"
    ngram: PositiveInt = 5

    def hasher(self) -> MinHasher:
        """The MinHash signatures these settings ask for."""
        return MinHasher(self.num_perm, self.shingle, self.ngram)


FILTER_TYPES = ("gopher_repetition", "gopher_quality", "c4", "fineweb_quality", "language", "length", "regex",
                "classifier")


class FilterConfig(BaseModel):
    """One `data.filters` entry: `type` and that filter's parameters (data_pipeline/filters.py checks them against its
    library's, importing datatrove only for a recipe that filters). A `model` naming a local file or folder is resolved
    as the recipe's other paths are."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    type: Literal[FILTER_TYPES]

    @model_validator(mode="after")
    def library_parameters(self, info: ValidationInfo) -> "FilterConfig":
        from data_pipeline.filters import check_parameters
        model = (self.model_extra or {}).get("model")
        if isinstance(model, str) and "://" not in model:
            local = resolve_path(model, info)
            if Path(local).exists():
                self.model_extra["model"] = local
            elif self.type == "language" and Path(model).suffix in (".bin", ".ftz"):
                raise ValueError(f"language model file not found: {local}")
        self.model_extra.update(check_parameters(self.type, self.model_extra))
        return self

    @property
    def parameters(self) -> dict:
        return dict(self.model_extra)

    @property
    def local_model(self) -> str | None:
        """The classifier folder or language model file it reads from this machine (an input of the command)."""
        model = self.model_extra.get("model")
        return model if isinstance(model, str) and Path(model).is_absolute() and Path(model).exists() else None


class EvalConfig(StrictModel):
    fraction: float = Field(0.0, ge=0, lt=1)  # hold out this share of the documents, after deduplication
    sources: list[DataSource] = []  # or evaluate on these instead
    decontaminate: bool = True  # drop training documents that near-duplicate an evaluation document

    @model_validator(mode="after")
    def one_kind(self) -> "EvalConfig":
        if self.fraction and self.sources:
            raise ValueError("set eval.fraction or eval.sources, not both")
        return self


class DataConfig(StrictModel):
    sources: list[DataSource] = []
    prepared: Annotated[LocalPath, AfterValidator(existing_prepared_dir)] | None = None  # from `prepare`
    seq_len: PositiveInt
    packing: Literal["concat", "bfd", "none"] = "concat"
    long_documents: Literal["split", "truncate", "drop"] = "split"  # for bfd and none; concat splits
    filters: list[FilterConfig] = []  # quality filters, in order, after reading and before deduplication
    # removed documents kept per filter in removed_samples.jsonl, chosen by a seeded hash
    filter_samples: NonNegativeInt = 5
    dedup: DedupConfig = DedupConfig()
    eval: EvalConfig = EvalConfig()
    seed: int = 1234  # mixture sampling and the evaluation split
    num_proc: PositiveInt = 1
    streaming: bool = False
    examples: Examples = "documents"  # set from training.objective: documents (lm), preference pairs (dpo) or
    # prompts (grpo, each row's other fields passed to the reward functions)
    completion_tokens: NonNegativeInt = 0  # set from grpo.max_completion_length: what a prompt leaves of seq_len
    chat_template_kwargs: dict[str, Any] = {}  # set from grpo.chat_template_kwargs: to the chat template of a prompt
    shuffle_buffer: NonNegativeInt = 10_000  # streaming only: documents held for shuffling (0: read in order)
    cache_dir: LocalPath = Field("~/.cache/deepspeed-recipes/data", validate_default=True)
    # a mixture that changes over the run (data_pipeline/curriculum.py): each source packed into rows of its own, and
    # each phase drawing from them by its weights; data.sources' weights stay 1
    phases: list[PhaseConfig] = []
    seq_len_warmup: LengthWarmupConfig | None = None  # shorter rows first (data_pipeline/length_warmup.py)

    @model_validator(mode="after")
    def consistent(self) -> "DataConfig":
        if (not self.sources) == (self.prepared is None):
            raise ValueError("set data.sources (to prepare) or data.prepared (a folder `python -m data_pipeline "
                             "prepare` wrote), not both")
        if self.prepared and self.filters:
            raise ValueError("data.filters apply while preparing, and data.prepared is already prepared: filter when "
                             "you prepare it (python -m data_pipeline prepare ... data.filters=[...]), or remove them")
        if self.streaming:
            unsupported = [name for name, on in (("packing other than concat", self.packing != "concat"),
                                                 ("dedup.exact", self.dedup.exact), ("dedup.near", self.dedup.near),
                                                 ("eval", self.eval.fraction or self.eval.sources)) if on]
            if unsupported:
                raise ValueError(f"data.streaming does not support {', '.join(unsupported)}: a stream sees each "
                                 f"document once, never the whole data set (deduplicate offline with `python -m "
                                 f"data_pipeline dedup`; set dedup.exact=false)")
        if self.phases:
            self.check_phases()
        warmup = self.seq_len_warmup
        if warmup and (warmup.start >= self.seq_len or self.seq_len % warmup.start):
            raise ValueError(f"data.seq_len_warmup.start is {warmup.start}: it must divide data.seq_len="
                             f"{self.seq_len} and be shorter (each row is cut into rows of the current length), "
                             f"such as {self.seq_len // next((d for d in (8, 4, 2) if self.seq_len % d == 0), 1)}")
        return self

    @property
    def scores_rows(self) -> bool:
        """Whether prepared rows carry a `score` (data.phases over scored documents: a score_field or a classifier)."""
        return bool(self.phases) and (any(source.score_field for source in self.sources)
                                      or any(spec.type == "classifier" for spec in self.filters))

    def check_phases(self) -> None:
        """The phases name sources that exist once each, and the sources leave the mixing to them."""
        if self.streaming:
            raise ValueError("data.phases draws each phase's rows from the prepared sources: it does not apply to "
                             "data.streaming (whose mixture is data.sources' weights); prepare the data instead")
        if self.prepared:
            return  # its sources are the prepared folder's: checked when the rows are read (curriculum.py)
        keys = [source.key for source in self.sources]
        for index, source in enumerate(self.sources):
            if keys.count(source.key) > 1:
                raise ValueError(f"data.phases: data.sources {[i for i, k in enumerate(keys) if k == source.key]} "
                                 f"are all labelled {source.key!r}; give them distinct `label`s")
            if source.weight != 1:
                raise ValueError(f"data.sources.{index}.weight is {source.weight:g}, and data.phases sets the "
                                 f"weights: remove it and weight {source.key!r} in each phase")
        for index, phase in enumerate(self.phases):
            unknown = sorted(set(phase.weights) - set(keys))
            if unknown:
                raise ValueError(f"data.phases.{index} ({phase.name}) weights {', '.join(unknown)}, not a source "
                                 f"label; the labels are {', '.join(keys)}")
        scored = {source.key for source in self.sources if source.score_field} if not any(
            spec.type == "classifier" for spec in self.filters) else set(keys)
        for index, phase in enumerate(self.phases):
            unscored = sorted(label for label, weight in phase.weights.items() if weight and label not in scored)
            if phase.order == "highest_score_first" and unscored:
                raise ValueError(f"data.phases.{index} ({phase.name}) orders its rows by their documents' scores, and "
                                 f"{', '.join(unscored)} has none: set its data.sources score_field (a numeric "
                                 f"field of its records), or score every source with a classifier filter")
        if self.packing == "concat" and any(phase.order == "shortest_first" for phase in self.phases):
            raise ValueError("data.phases: order shortest_first puts the rows with the fewest real tokens first, and "
                             "under data.packing=concat every row is full; set data.packing to bfd or none")
        names = [phase.name for phase in self.phases]
        if len(set(names)) < len(names):
            raise ValueError(f"data.phases: two phases share a name ({', '.join(names)}); name each once")
