"""GRPO's reward functions: the built-ins on plain and chat completions, module:function rewards, and the named
errors for what cannot be loaded or scored."""
import math
import sys
import warnings

import numpy as np
import pytest
import torch

from training.base.errors import ConfigError, DataError, failure
from training.objectives.grpo import rewards as rewards_module
from training.objectives.grpo.logs import generation_metrics
from training.objectives.grpo.rewards import (
    RewardFunctionError,
    check_rewarded,
    exact_answer,
    format_regex,
    length_penalty,
    load_reward,
    score,
)


def chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_exact_answer_reads_the_final_answer_and_compares_numbers_exactly():
    completions = ["so the sum is \\boxed{1,000}.", "#### 0.5", "<answer> 7 </answer>", "Paris.", "$12$",
                   "\\boxed{\\frac{1}{2}} and later 9", "the answer is 4", "it is 3"]
    answers = ["1000", "1/2", "7.0", "paris", 12, "\\frac{1}{2}", "4", None]
    assert exact_answer(["p"] * 8, completions, answer=answers) == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, None]


def test_exact_answer_reads_a_gsm8k_solution_and_chat_completions():
    solutions = ["48 / 2 = 24 clips in May.\n#### 72", "#### 72", "#### 1,250"]
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "#### 70"}]}]
    completions = [chat("In all \\boxed{72}"), parts, chat("<answer>1250</answer>")]
    assert exact_answer(["p"] * 3, completions, solution=solutions) == [1.0, 0.0, 1.0]
    with pytest.raises(DataError, match="exact_answer: the rows have neither an `answer` nor a `solution`"):
        exact_answer(["p"], ["1"], question=["q"])


def test_format_regex_matches_the_whole_completion():
    pattern = r"<think>.*?</think>\s*<answer>.*?</answer>"
    completions = ["<think>a\nb</think>\n<answer>4</answer>", "<think>a</think><answer>4</answer> extra",
                   chat("<think></think><answer>x</answer>")]
    assert format_regex(["p"] * 3, completions, pattern=pattern) == [1.0, 0.0, 1.0]


def test_length_penalty_is_zero_at_the_target_and_minus_one_far_from_it():
    completions = ["x" * 10, "x" * 5, "", "x" * 30, chat("x" * 15)]
    assert length_penalty(["p"] * 5, completions, target=10) == [0.0, -0.5, -1.0, -1.0, -0.5]


def test_load_reward_binds_a_builtins_parameters_and_keeps_its_name():
    reward = load_reward("format_regex", {"pattern": "a+"})
    assert reward.__name__ == "format_regex"
    assert reward(prompts=["p", "p"], completions=["aaa", "ab"], answer=["x", "y"]) == [1.0, 0.0]
    assert load_reward("exact_answer", {})(prompts=["p"], completions=["\\boxed{2}"], answer=["2"]) == [1.0]


@pytest.mark.parametrize("name, params, message", [
    ("exact_answers", {}, "reward 'exact_answers': not a built-in .* nor module:function"),
    ("format_regex", {}, "reward format_regex: missing parameter\\(s\\) pattern; format_regex takes pattern"),
    ("length_penalty", {"target": 5, "unit": "words"}, "unknown parameter\\(s\\) unit; length_penalty takes target"),
    ("format_regex", {"pattern": "(a"}, "pattern '\\(a' is not a regular expression"),
    ("length_penalty", {"target": 0}, "length_penalty: target=0; .* a number above 0"),
])
def test_load_reward_names_what_is_wrong_with_a_builtin(name, params, message):
    with pytest.raises(ConfigError, match=message):
        load_reward(name, params)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """my_rewards.py on sys.path: a reward with a parameter, a constant that is not callable, and broken.py, whose
    own import fails."""
    (tmp_path / "my_rewards.py").write_text(
        "def contains(prompts, completions, word='yes', **kwargs):\n"
        "    return [float(word in c) for c in completions]\n"
        "NOT_A_FUNCTION = 3\n")
    (tmp_path / "broken.py").write_text("import a_dependency_that_is_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("my_rewards", "broken"):
        sys.modules.pop(name, None)


def test_load_reward_imports_module_function(user_module):
    reward = load_reward("my_rewards:contains", {"word": "no"})
    assert reward.__name__ == "contains"
    assert reward(prompts=["p", "p"], completions=["no way", "yes"], answer=["a", "b"]) == [1.0, 0.0]


@pytest.mark.parametrize("name, message", [
    ("not_my_rewards:contains", "reward not_my_rewards:contains: no module named 'not_my_rewards' on the Python path"),
    ("my_rewards.sub:contains", "no module named 'my_rewards.sub'"),
    ("my_rewards:missing", "reward my_rewards:missing: 'missing' is not defined there \\(module my_rewards, "),
    ("my_rewards:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is not callable"),
])
def test_load_reward_names_the_module_or_function_not_found(user_module, name, message):
    with pytest.raises(ConfigError, match=message):
        load_reward(name, {})


def test_a_reward_modules_own_failing_import_keeps_its_traceback(user_module):
    with pytest.raises(ModuleNotFoundError, match="a_dependency_that_is_missing"):
        load_reward("broken:anything", {})


def test_score_gives_one_column_per_function_none_as_nan():
    def half(prompts, completions, answer, **kwargs):
        return [0.5 if a == "1" else None for a in answer]

    rewards = score([load_reward("exact_answer"), half], ["p"] * 3, ["1", chat("2"), "3"], {"answer": ["1", "2", "4"]},
                    "generation 0, step 1")
    assert rewards.dtype == torch.float32 and rewards.shape == (3, 2)
    assert rewards[:, 0].tolist() == [1.0, 1.0, 0.0]
    assert rewards[0, 1].item() == 0.5 and math.isnan(rewards[1, 1]) and math.isnan(rewards[2, 1])


@pytest.mark.parametrize("returned, expected", [
    (np.array([0.5, -1.0]), [0.5, -1.0]),
    (np.array([1, 0], dtype=np.int64), [1.0, 0.0]),
    (np.array([0.5, None], dtype=object), [0.5, math.nan]),
    (torch.tensor([0.25, 2.0], requires_grad=True), [0.25, 2.0]),
    ([np.float32(0.5), np.int64(3)], [0.5, 3.0]),
    ([torch.tensor(0.5), None], [0.5, math.nan]),
    ((np.bool_(True), math.nan), [1.0, math.nan]),  # NaN, as None: no opinion
    ([np.array(2.0), 1], [2.0, 1.0]),
])
def test_score_takes_what_trl_takes_numpy_and_torch_rewards_too(returned, expected):
    def forms(prompts, completions, **kwargs):
        return returned

    rewards = score([forms], ["p", "p"], ["a", "b"], {}, "generation 0, step 1")
    assert rewards.dtype == torch.float32 and rewards.shape == (2, 1)
    torch.testing.assert_close(rewards[:, 0], torch.tensor(expected), equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("returned, message", [
    ([1.0], "reward function bad returned 1 rewards for 2 completions"),
    ([1.0, "1.0"], "reward function bad returned '1.0' \\(str\\) for completion 1; return a number"),
    ([1.0, [1.0]], "reward function bad returned \\[1.0\\] \\(list\\) for completion 1"),
    (None, "reward function bad returned a NoneType; return a list of 2 rewards"),
    ("ab", "reward function bad returned a str; return a list of 2 rewards"),
    ({"a": 1.0, "b": 0.0}, "reward function bad returned a dict; return a list of 2 rewards"),
    (np.zeros((2, 1)), "returned a 2-D ndarray of shape \\(2, 1\\); return 2 rewards, one per completion, in a list"),
    (torch.zeros(1, 2), "reward function bad returned a 2-D Tensor of shape \\(1, 2\\)"),
    (np.array(1.0), "reward function bad returned a 0-D ndarray of shape \\(\\)"),
    (np.zeros(3), "reward function bad returned 3 rewards for 2 completions"),
    (np.array(["1", "0"]), "reward function bad returned '1' \\(str\\) for completion 0"),
    ([torch.tensor([1.0]), 0.0], "reward function bad returned tensor\\(\\[1.\\]\\) \\(Tensor\\) for completion 0"),
    ([0.0, np.complex64(1)], "returned np.complex64\\(1\\+0j\\) \\(complex64\\) for completion 1"),
    ([0.0, math.inf], "reward function bad returned inf for completion 1: an infinite reward"),
    (np.array([-math.inf, 0.0]), "reward function bad returned -inf for completion 0: .* return a finite number"),
    ([torch.tensor(math.inf), np.float32(0)], "reward function bad returned inf for completion 0"),
])
def test_score_names_the_function_that_returns_the_wrong_rewards(returned, message):
    def bad(prompts, completions, **kwargs):
        return returned

    with pytest.raises(DataError, match=message):
        score([bad], ["p", "p"], ["a", "b"], {}, "generation 0, step 1")


@pytest.fixture
def flaky_module(tmp_path, monkeypatch):
    """flaky.py on sys.path: `flaky` fails inside a helper of its own."""
    path = tmp_path / "flaky.py"
    path.write_text("def check(completions):\n"
                    "    raise ValueError('my reward is broken')\n"
                    "\n"
                    "\n"
                    "def flaky(prompts, completions, **kwargs):\n"
                    "    check(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield path
    sys.modules.pop("flaky", None)


def test_a_reward_function_that_raises_is_named_with_its_own_frames_only(flaky_module):
    """One line (the function, what it raised, the run's moment), then the frames from the function inward: the
    message failure() prints after `error: ` once, exit code 2, and no frame of ours."""
    with pytest.raises(RewardFunctionError) as raised:
        score([load_reward("flaky:flaky")], ["p"], ["a"], {"answer": ["1"]}, "generation 2, step 3")
    lines = str(raised.value).splitlines()
    assert lines[0] == "reward function flaky raised ValueError: my reward is broken (generation 2, step 3)"
    assert [line.strip() for line in lines[1:] if not line.strip().startswith(("^", "~"))] == [
        f'File "{flaky_module}", line 6, in flaky', "check(completions)",
        f'File "{flaky_module}", line 2, in check', "raise ValueError('my reward is broken')"]
    assert raised.value.__suppress_context__ and isinstance(raised.value, DataError)
    code, message = failure(raised.value)
    assert code == 2 and message == "error: " + str(raised.value) and message.count("error:") == 1
    assert rewards_module.__file__ not in message


def test_what_a_reward_function_raises_that_is_not_its_bug_passes_through():
    """Ctrl-C stays Ctrl-C; a DataError of ours (exact_answer's missing field) names its input already; a built-in's
    bug keeps its traceback (here length_penalty given a completion that is no text)."""
    def interrupted(prompts, completions, **kwargs):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score([interrupted], ["p"], ["a"], {}, "generation 0, step 1")
    with pytest.raises(DataError, match="^reward exact_answer: the rows have neither") as raised:
        score([load_reward("exact_answer")], ["p"], ["a"], {}, "generation 0, step 1")
    assert not isinstance(raised.value, RewardFunctionError)
    with pytest.raises(TypeError):
        score([load_reward("length_penalty", {"target": 4})], ["p"], [3], {}, "generation 0, step 1")


def test_a_generation_without_any_reward_stops_the_run_by_name():
    """Every function returned None or NaN for every completion (of every rank: the gathered rewards): nothing to
    learn, a DataError naming the moment, the functions, the completions and the fix. One reward anywhere is
    enough."""
    missing = torch.full((16, 2), math.nan)
    with pytest.raises(DataError, match="^no reward for any of the 16 completions \\(generation 2, step 3, every "
                                        "rank's\\): reward function\\(s\\) exact_answer, closeness returned None or "
                                        "NaN for each, .* check that the rows hold the fields the functions read"):
        check_rewarded(missing, ["exact_answer", "closeness"], "generation 2, step 3")
    missing[5, 1] = 0.0
    check_rewarded(missing, ["exact_answer", "closeness"], "evaluation after step 4")


def test_a_function_with_one_reward_or_none_logs_a_std_of_0_without_torchs_warning():
    """generation_metrics' rewards/<name>/std: 0 where fewer than 2 values are present (torch's std() warns of its
    degrees of freedom there)."""
    per_function = torch.tensor([[math.nan, 1.0], [math.nan, math.nan], [math.nan, math.nan], [math.nan, math.nan]])
    rewards, lengths = per_function[:, 1], torch.tensor([3.0, 4.0, 5.0, 6.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics = generation_metrics(["none", "once"], per_function, rewards, torch.zeros(4), lengths,
                                     torch.zeros(4, dtype=torch.bool), 4)
    assert metrics["rewards/none/std"] == metrics["rewards/once/std"] == 0.0
    assert metrics["rewards/once/mean"] == 1.0 and math.isnan(metrics["rewards/none/mean"])


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    from tests.conftest import save_small_reward_model
    path = tmp_path_factory.mktemp("models") / "judge"
    save_small_reward_model(path)
    return path


def test_a_reward_model_scores_each_completion_as_it_scores_it_alone(reward_model):
    """TRL's reward model: the sequence classifier's logit at the last token of the prompt and completion, a string
    prompt joined to its completion, chat turns rendered by the reward model's chat template; right-padded among a
    group's other completions it gives each the score it has alone, and the metrics' name is its folder's."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from training.objectives.grpo.rewards import RewardModel
    judge = RewardModel(str(reward_model), 3, torch.device("cpu"), torch.float32, False, {})
    alone = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_model)

    def score_alone(text: str) -> float:
        with torch.no_grad():
            return alone(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
    prompts = ["17+25=", "17+25=", "17+25=", "3+4=", "3+4=", "3+4="]
    completions = [" 42", " 41 and some more words", "42", " 7", " eight", " 7 and then more and more words"]
    rewards = judge(prompts, completions)
    assert rewards == pytest.approx([score_alone(p + c) for p, c in zip(prompts, completions)], abs=1e-5)
    assert len({round(r, 3) for r in rewards}) == 6 and judge.__name__ == "judge"
    passes = []  # the rows of each pass: a prompt's group, at most `group` rows
    judge.model.register_forward_pre_hook(lambda _, args, kwargs: passes.append(len(kwargs["input_ids"])),
                                          with_kwargs=True)
    judge(prompts, completions)
    judge.group = 2
    assert judge(prompts, completions) == pytest.approx(rewards, abs=1e-5) and passes == [3, 3, 2, 1, 2, 1]
    chats = [[{"role": "user", "content": "17+25?"}]] * 3
    replies = [[{"role": "assistant", "content": text}] for text in (" 42", " 41 and more", "42")]
    rendered = [tokenizer.apply_chat_template(p + r, tokenize=False) for p, r in zip(chats, replies)]
    assert judge(chats, replies) == pytest.approx([score_alone(text) for text in rendered], abs=1e-5)
    assert not any(p.requires_grad for p in judge.model.parameters())


def test_a_reward_names_a_function_or_a_model(tmp_path, reward_model):
    from training.config.recipe import load_recipe
    for override in ("grpo.rewards=[{weight: 1}]", f"grpo.rewards=[{{function: exact_answer, model: {reward_model}}}]"):
        with pytest.raises(ConfigError, match="a reward names a function or a model, one of them"):
            load_recipe("tiny_llama_grpo", [override])
    with pytest.raises(ConfigError, match="a reward model takes no params"):
        load_recipe("tiny_llama_grpo", [f"grpo.rewards=[{{model: {reward_model}, params: {{a: 1}}}}]"])
