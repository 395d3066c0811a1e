"""GRPO's reward functions, in TRL's form: f(prompts, completions, **kwargs) -> one reward per completion, what TRL's
torch.tensor([nan if r is None else r for r in output]) takes: a list or tuple of numbers (Python's, numpy's or 0-d
tensors) or None, or a 1-D numpy array or tensor. None and NaN both mean no opinion (TRL turns None into NaN and
treats them alike: left out of the sums, means and stds); an infinity is refused (checked). prompts and completions
are lists of N (each prompt repeated once per generation); a completion is a string or, for chat, a list of messages
({"role": ..., "content": ...}) whose last message's text is what the built-ins read. The keyword arguments are
TRL's: the data set's other columns, each a list of N; completion_ids, each completion's token ids; trainer_state, a
transformers TrainerState whose global_step, max_steps and epoch say where the run is (the optimizer steps done
before the generation); log_metric(name, value), a scalar logged with the step's metrics under its name, the mean of
every call on every rank in the generation; and log_extra(column, values), one value per completion, a column of
completions.jsonl (RewardLog).

Built-ins, each named by load_reward with its parameters:
- exact_answer: 1.0 where the completion's final answer equals the row's reference (its `answer` field, else its
  `solution`), else 0.0; None where the row's reference is None. A final answer is the last \\boxed{...}, else the
  text after the last "####", else the last <answer>...</answer>, else the whole text; the reference's is taken the
  same way (a GSM8K solution "... #### 72" gives 72). Both are stripped of whitespace, enclosing $...$ and a final
  period, then compared as exact numbers when both read as one (3 = 3.0 = 6/2, 1,000 = 1000, 0.5 = 1/2), else as
  text with case and runs of whitespace ignored.
- format_regex(pattern): 1.0 where the regular expression matches the whole completion (re.fullmatch, "." matching
  newlines too), else 0.0.
- length_penalty(target): -min(1, |characters - target| / target): 0 at the target length in characters, down to -1
  at an empty completion or at twice the target and beyond.

A reward model (RewardModel, TRL's reward_funcs given a model) scores each prompt and completion with a sequence
classifier's one logit. reward_functions loads a recipe's grpo.rewards, the functions and the models.

What the user's function raises ends the run with one line naming it (RewardFunctionError), where the built-ins and
RewardModel, this module's code, keep their traceback as a bug (a DataError of theirs, such as exact_answer's missing
field, names the input already; a reward model out of memory gets errors.py's advice on fitting). A generation
whose completions none of the functions scored stops the run too (check_rewarded): TRL warns and trains on, every
advantage 0 (at beta 0 every step a loss and a gradient of 0).
"""
import functools
import importlib
import inspect
import math
import numbers
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from training.base.errors import ConfigError, DataError
from training.config.recipe import Recipe
from training.objectives.grpo.memory import reward_model_shape

RewardFunction = Callable[..., list[float | None]]
BOXED = re.compile(r"\\boxed\s*\{")
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")


def completion_text(completion: str | list[dict]) -> str:
    """A completion's text: the string, or a chat completion's last message's content (its text parts)."""
    if isinstance(completion, str):
        return completion
    content = completion[-1]["content"]
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content
                                                            if part.get("type") == "text")


def boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced; None if there is none (or it is not closed)."""
    starts = list(BOXED.finditer(text))
    if not starts:
        return None
    depth, begin = 1, starts[-1].end()
    for position in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[begin:position]
    return None


def final_answer(text: str) -> str:
    """The last \\boxed{...}, else what follows the last ####, else the last <answer>...</answer>, else the text."""
    if (found := boxed(text)) is not None:
        return found
    if "####" in text:
        return text.rsplit("####", 1)[1]
    tags = ANSWER_TAG.findall(text)
    return tags[-1] if tags else text


def normalized(answer: str) -> Fraction | str:
    """An answer as an exact number when it reads as one, else as lower-case text with single spaces."""
    answer = answer.strip()
    if len(answer) > 1 and answer[0] == answer[-1] == "$":
        answer = answer[1:-1].strip()
    answer = answer.removesuffix(".").strip()
    number = answer.replace(",", "") if THOUSANDS.fullmatch(answer) else answer
    try:
        return Fraction(number)
    except (ValueError, ZeroDivisionError):
        return " ".join(answer.split()).casefold()


def exact_answer(prompts: list, completions: list, answer: list | None = None, solution: list | None = None,
                 **_) -> list[float | None]:
    references = answer if answer is not None else solution
    if references is None:
        raise DataError("reward exact_answer: the rows have neither an `answer` nor a `solution` field; add the "
                        "reference answer as one of them, or use another reward")
    return [None if reference is None else
            float(normalized(final_answer(completion_text(completion))) == normalized(final_answer(str(reference))))
            for completion, reference in zip(completions, references, strict=True)]


def format_regex(prompts: list, completions: list, *, pattern: str, **_) -> list[float | None]:
    return [float(re.fullmatch(pattern, completion_text(completion), re.DOTALL) is not None)
            for completion in completions]


def length_penalty(prompts: list, completions: list, *, target: int, **_) -> list[float | None]:
    return [-min(1.0, abs(len(completion_text(completion)) - target) / target) for completion in completions]


BUILTINS: dict[str, RewardFunction] = {"exact_answer": exact_answer, "format_regex": format_regex,
                                       "length_penalty": length_penalty}


def check_builtin(name: str, params: dict) -> None:
    """A built-in's parameters: its keyword-only ones, those without a default required, and their values usable."""
    accepted = {parameter.name: parameter for parameter in inspect.signature(BUILTINS[name]).parameters.values()
                if parameter.kind is parameter.KEYWORD_ONLY}
    unknown = sorted(set(params) - set(accepted))
    missing = [key for key, parameter in accepted.items() if parameter.default is parameter.empty and key not in params]
    if unknown or missing:
        raise ConfigError(f"reward {name}: " + "; ".join(
            ([f"unknown parameter(s) {', '.join(unknown)}"] if unknown else []) +
            ([f"missing parameter(s) {', '.join(missing)}"] if missing else [])) +
            f"; {name} takes {', '.join(accepted) or 'no parameters'}")
    if name == "format_regex":
        try:
            re.compile(params["pattern"])
        except (re.error, TypeError) as error:
            raise ConfigError(f"reward format_regex: pattern {params['pattern']!r} is not a regular expression "
                              f"({error}); fix the pattern") from None
    if name == "length_penalty" and not (isinstance(params["target"], numbers.Real) and params["target"] > 0):
        raise ConfigError(f"reward length_penalty: target={params['target']!r}; give the target length in "
                          f"characters, a number above 0")


def imported(name: str) -> RewardFunction:
    """`module:function`, imported; a ConfigError naming the part that is not found."""
    module_name, _, function_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not (module_name == error.name or module_name.startswith(error.name + ".")):
            raise  # the module was found, and an import of its own failed: its traceback says where
        raise ConfigError(f"reward {name}: no module named {error.name!r} on the Python path; fix the name, or run "
                          f"from the folder that holds it (or add that folder to PYTHONPATH)") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        found = "is not callable" if hasattr(module, function_name) else "is not defined there"
        raise ConfigError(f"reward {name}: {function_name!r} {found} (module {module_name}, {module.__file__}); "
                          f"name a function f(prompts, completions, **row_fields) of that module")
    return function


def load_reward(name: str, params: dict | None = None) -> RewardFunction:
    """A built-in reward (see the module's docstring) or `module:function`, with `params` bound as keyword
    arguments; it keeps the function's __name__, which names it in errors and in TRL's metrics
    (rewards/<name>/mean)."""
    params = params or {}
    if name in BUILTINS:
        check_builtin(name, params)
        function = BUILTINS[name]
    elif ":" in name:
        function = imported(name)
    else:
        raise ConfigError(f"reward {name!r}: not a built-in ({', '.join(BUILTINS)}) nor module:function; name one "
                          f"of those")
    return functools.update_wrapper(functools.partial(function, **params), function)


def checked(values, name: str, count: int) -> list[float]:
    """A reward function's output as floats (None: NaN), or a DataError naming the function: `count` rewards in a
    list or tuple (each a number, numpy's too, a 0-d tensor, or None) or a 1-D numpy array or tensor. An infinity
    is refused, where TRL takes it: its group's mean is infinite too, so the group's advantages are NaN, trained as
    0, or under scale_rewards none float32's extreme, -3.4e38, and nothing says so."""
    if isinstance(values, (np.ndarray, torch.Tensor)):
        if values.ndim != 1:
            raise DataError(f"reward function {name} returned a {values.ndim}-D {type(values).__name__} of shape "
                            f"{tuple(values.shape)}; return {count} rewards, one per completion, in a list or a "
                            f"1-D array")
        values = values.tolist()
    elif isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise DataError(f"reward function {name} returned a {type(values).__name__}; return a list of {count} "
                        f"rewards, one per completion (a number, or None where it has no opinion)")
    if len(values) != count:
        raise DataError(f"reward function {name} returned {len(values)} rewards for {count} completions; return "
                        f"one per completion (None where it has no opinion)")
    rewards = []
    for index, value in enumerate(values):
        scalar = isinstance(value, (np.generic, np.ndarray, torch.Tensor)) and value.ndim == 0
        number = value.item() if scalar else value
        if number is not None and not isinstance(number, numbers.Real):
            raise DataError(f"reward function {name} returned {value!r} ({type(value).__name__}) for completion "
                            f"{index}; return a number, or None where it has no opinion")
        rewards.append(math.nan if number is None else float(number))
        if math.isinf(rewards[-1]):
            raise DataError(f"reward function {name} returned {rewards[-1]} for completion {index}: an infinite reward "
                            f"breaks its whole group's advantages; return a finite number (clip it to a range), or "
                            f"None where it has no opinion")
    return rewards


def check_rewarded(per_function: torch.Tensor, names: Sequence[str], where: str) -> None:
    """A DataError where no function scored any completion ([N, F] all NaN: each returned None or NaN for every
    one), at `where` (the run's moment). Pass every rank's rewards, gathered: every rank then raises it together,
    and none waits in a collective for a rank that left."""
    if per_function.isnan().all():
        raise DataError(f"no reward for any of the {len(per_function)} completions ({where}, every rank's): reward "
                        f"function(s) {', '.join(names)} returned None or NaN for each, which leaves nothing to learn "
                        f"from (every advantage 0) or to measure; check that the rows hold the fields the functions "
                        f"read (e.g. exact_answer's `answer` or `solution`, not None) and that the functions score "
                        f"these completions")


class RewardFunctionError(DataError):
    """A user's reward function raised: the message is one line naming it, what it raised and when, then the
    traceback's frames from the function inward."""


def function_name(function: RewardFunction) -> str:
    return getattr(function, "__name__", type(function).__name__)


def called(function: RewardFunction, where: str, **arguments) -> object:
    """function(**arguments). What a user's function raises (an Exception: not Ctrl-C nor SystemExit; not our own
    ConfigError or DataError, which name their input) becomes a RewardFunctionError naming the function and
    `where`, with the frames from the function inward only: training/'s above it say nothing to the user. This
    module's own functions (the built-ins, RewardModel, whose __module__ is this one) keep their traceback: a bug of
    ours."""
    try:
        return function(**arguments)
    except Exception as error:
        if getattr(function, "__module__", None) == __name__ or isinstance(error, (ConfigError, DataError)):
            raise
        frames = traceback.extract_tb(error.__traceback__)[1:]  # the first is the call above
        raised = type(error).__name__ + (f": {error}" if str(error) else "")
        raise RewardFunctionError(f"reward function {function_name(function)} raised {raised} ({where})\n"
                                  + "".join(traceback.format_list(frames)).rstrip()) from None


class RewardLog:
    """What the reward functions log in a generation through TRL's log_metric and log_extra."""

    def __init__(self):
        self.metrics: dict[str, list[float]] = {}
        self.columns: dict[str, list] = {}

    def metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))

    def extra(self, column: str, values: list) -> None:
        self.columns.setdefault(column, []).extend(values)


def score(functions: Sequence[RewardFunction], prompts: list, completions: list, row_fields: dict[str, list],
          where: str, **extras) -> torch.Tensor:
    """[N, F] float32: each function's rewards for the N completions, None as NaN (as TRL's); `extras` (TRL's
    completion_ids, trainer_state, log_metric, log_extra) passed to each beside the row's fields. `where`, the run's
    moment (e.g. "generation 2, step 3"), names it in the error of a function that raises (called)."""
    columns = [checked(called(function, where, prompts=prompts, completions=completions, **row_fields, **extras),
                       function_name(function), len(prompts))
               for function in functions]
    return torch.tensor(columns, dtype=torch.float32).reshape(len(functions), len(prompts)).T


class RewardModel:
    """TRL's reward model: a sequence classifier with one label (AutoModelForSequenceClassification, num_labels=1),
    whose logit at each sequence's last token is its reward. A chat prompt and its completion are rendered by the
    reward model's own tokenizer's chat template (with grpo.chat_template_kwargs), a string prompt is joined to its
    completion; tokenized without special tokens added and right-padded, its pad token the EOS where it has none, as
    TRL's. Frozen, in the run's dtype, a whole copy on each rank. It scores one group (the completions of a prompt,
    which come together; at most `group` at a time) per pass, so that a completion's reward does not depend on which
    other groups share its rank, and the pass's memory is one group's."""

    def __init__(self, name_or_path: str, group: int, device: torch.device, dtype: torch.dtype,
                 trust_remote_code: bool, chat_template_kwargs: dict):
        self.model = AutoModelForSequenceClassification.from_pretrained(
            name_or_path, num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code).to(device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id  # where each row ends
        self.group, self.device, self.chat_template_kwargs = group, device, chat_template_kwargs
        self.__name__ = name_or_path.rstrip("/").rsplit("/", 1)[-1]  # TRL's: rewards/<name>/mean

    def text(self, prompt: str | list[dict], completion: str | list[dict]) -> str:
        if isinstance(prompt, str):
            return prompt + completion
        return self.tokenizer.apply_chat_template(prompt + completion, tokenize=False, **self.chat_template_kwargs)

    def __call__(self, prompts: list, completions: list, **_) -> list[float]:
        texts = [self.text(prompt, completion) for prompt, completion in zip(prompts, completions, strict=True)]
        rewards, start = [], 0
        while start < len(texts):
            end = start + 1
            while end < min(len(texts), start + self.group) and prompts[end] == prompts[start]:
                end += 1
            inputs = self.tokenizer(text=texts[start:end], return_tensors="pt", padding=True, padding_side="right",
                                    add_special_tokens=False).to(self.device)
            with torch.inference_mode():
                rewards += self.model(**inputs).logits[:, 0].float().tolist()
            start = end
        return rewards


def reward_functions(recipe: Recipe, device: torch.device | None = None, dtype: torch.dtype | None = None) -> list:
    """grpo.rewards loaded (a module beside the recipe's YAML found by its name), and its reward models built on
    `device` in `dtype` (without a device only their configs are read: the check before anything is built); a
    ConfigError names a bad one."""
    folder = str(Path(recipe.path).resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)
    functions = []
    for spec in recipe.grpo.rewards:
        if spec.function:
            functions.append(load_reward(spec.function, spec.params))
        elif device is None:
            reward_model_shape(spec.model, recipe.model.trust_remote_code)
        else:
            functions.append(RewardModel(spec.model, recipe.grpo.num_generations, device, dtype,
                                         recipe.model.trust_remote_code, recipe.grpo.chat_template_kwargs))
    return functions
