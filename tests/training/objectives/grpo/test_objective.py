"""training.objective=grpo, its parts without a run: sampling, the prompts' batches, the reference under LoRA, what it
refuses and the dry run's lines. The loss and advantages against TRL: test_loss.py; runs: tests/test_grpo.py."""
import json
import math
import re
from types import SimpleNamespace

import datasets
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList, TopPLogitsWarper

from data_pipeline.config import DataConfig
from data_pipeline.loader import EvalPromptBatches, PromptBatches
from data_pipeline.prepare import build_dataset
from tests.conftest import REPO, save_small_checkpoint
from training.base.errors import ConfigError, DataError
from training.config.recipe import load_recipe
from training.objectives.grpo.loss import LOSS_TYPES, LossSettings, grpo_loss
from training.objectives.grpo.objective import Grpo
from training.objectives.grpo.report import loss_lines
from training.objectives.grpo.rollout import completion_logps, completion_rows
from training.objectives.grpo.sampling import SeededSampling, decoding, generation_config, sample
from training.objectives.grpo.spec import GenerationKwargs, GrpoSection
from training.planning.plan import RunPlan
from training.planning.precision import DTYPES
from training.planning.report import format_bytes

SECTION = GrpoSection(num_generations=4, max_completion_length=12, temperature=0.9, top_p=0.95)
SETTINGS = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3}  # the other sampling settings, TRL's names


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("small")
    save_small_checkpoint(path)
    return path, AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_a_completion_depends_on_its_seed_alone_not_on_its_batch(small):
    """Under any layout a rank samples its own prompts in one batch: each completion must be the one its seed gives
    when it is sampled alone (prompts of other lengths left-padded beside it). The other settings' warping of a row
    depends on the row alone too (the repetition penalty leaves the padding out: the test below)."""
    _, model, tokenizer = small
    prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in ("1=", "17+25=", "Write a function that")]
    assert len({len(p) for p in prompts}) == 3
    seeds = [11, 22, 33]
    together, cut = sample(model, prompts, seeds, SECTION, tokenizer.eos_token_id, 0, False)
    for prompt, seed, completion in zip(prompts, seeds, together):
        [alone], _ = sample(model, [prompt], [seed], SECTION, tokenizer.eos_token_id, 0, False)
        assert torch.equal(alone, completion)
    assert all(len(c) == SECTION.max_completion_length for c, truncated in zip(together, cut) if truncated)
    again, _ = sample(model, prompts, seeds, SECTION, tokenizer.eos_token_id, 0, False)
    assert all(map(torch.equal, together, again))
    other, _ = sample(model, prompts, [12, 23, 34], SECTION, tokenizer.eos_token_id, 0, False)
    assert not all(map(torch.equal, together, other))


@pytest.mark.parametrize("settings", [SETTINGS, {"repetition_penalty": 1.3, "top_p": 1.0}],
                         ids=["every-setting", "repetition-penalty-alone"])
def test_seeded_sampling_warps_the_logits_as_transformers_sampling_does(small, settings):
    """Every sampling setting, over a left-padded batch: our warpers give, at each step, the scores transformers'
    generate(do_sample=True) samples from (output_scores), from the same raw logits (output_logits) and tokens. With
    the repetition penalty alone every score is finite: the padding token's shows that the padding is left out."""
    from transformers import GenerationConfig
    _, model, tokenizer = small
    prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in ("1=", "17+25=", "Write a function that")]
    width = max(len(p) for p in prompts)
    inputs = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    section = SECTION.model_copy(update=settings)
    assert all(0 not in p for p in prompts)
    config = GenerationConfig(do_sample=True, max_new_tokens=6, temperature=section.temperature, top_p=section.top_p,
                              top_k=section.top_k, min_p=section.min_p, repetition_penalty=section.repetition_penalty,
                              pad_token_id=0, eos_token_id=None)
    torch.manual_seed(0)
    out = model.generate(input_ids=inputs, attention_mask=mask, generation_config=config, output_scores=True,
                         output_logits=True, return_dict_in_generate=True)
    ours = SeededSampling([0] * len(prompts), section, width - mask.sum(1), torch.device("cpu"))
    for step, (logits, scores) in enumerate(zip(out.logits, out.scores)):
        warped = ours.warpers(out.sequences[:, :width + step], logits.float())
        torch.testing.assert_close(warped, scores, rtol=0, atol=0)
        cut = (scores == -math.inf).any(-1)
        assert cut.all() if section.top_k else not cut.any()


class Forced(LogitsProcessor):
    """Notes our warpers' scores of what generate's processors give, then forces the next token of `sequences`."""

    def __init__(self, sampling: SeededSampling, sequences: torch.Tensor):
        self.sampling, self.sequences, self.warped = sampling, sequences, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.warped.append(self.sampling.warpers(input_ids, scores.float()))
        forced = torch.full_like(scores, -math.inf)
        return forced.scatter(1, self.sequences[:, input_ids.shape[1], None], 0.0)


KWARGS = {"top_h": 0.7, "typical_p": 0.9, "epsilon_cutoff": 3e-4, "eta_cutoff": 3e-4, "min_new_tokens": 3,
          "no_repeat_ngram_size": 2, "suppress_tokens": [5, 6], "begin_suppress_tokens": [7],
          "bad_words_ids": [[8], [9, 10]], "sequence_bias": [[[11], 4.0], [[12, 13], -3.0]]}


@pytest.mark.parametrize("kwargs, top_k", [
    (KWARGS, 20), ({"typical_p": 0.8}, 20), ({"top_h": 0.2}, 20), ({"sequence_bias": [[[11], 4.0]]}, 20),
    ({"epsilon_cutoff": 3e-4}, 0), ({"eta_cutoff": 0.9}, 0),  # each cuts tokens that top_k=20 (or top_p) would have
], ids=["every-setting", "typical", "top-h", "bias", "epsilon", "eta"])
def test_generation_kwargs_sample_as_transformers_sampling_does(small, kwargs, top_k):
    """grpo.generation_kwargs beside every other sampling setting, over a left-padded batch: generate's own processors
    (built from the GenerationConfig that sample passes) and then our warpers give, at each step, the scores that
    transformers' generate(do_sample=True) with the same settings samples from. Our side runs on transformers' tokens,
    forced in a greedy run."""
    from transformers import GenerationConfig
    _, model, tokenizer = small
    prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in ("1=", "17+25=", "Write a function that")]
    width = max(len(p) for p in prompts)
    inputs = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    section = SECTION.model_copy(update={**SETTINGS, "top_k": top_k, "generation_kwargs": GenerationKwargs(**kwargs),
                                         "generation_engine": "generate"})  # transformers' cache: its very logits
    theirs = GenerationConfig(do_sample=True, temperature=section.temperature, top_p=section.top_p, top_k=section.top_k,
                              min_p=section.min_p, repetition_penalty=section.repetition_penalty, **kwargs,
                              max_new_tokens=section.max_completion_length, pad_token_id=0,
                              eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    out = model.generate(input_ids=inputs, attention_mask=mask, generation_config=theirs, output_scores=True,
                         return_dict_in_generate=True)
    forced = Forced(SeededSampling([0] * len(prompts), section, width - mask.sum(1), torch.device("cpu")),
                    out.sequences)
    again = model.generate(input_ids=inputs, attention_mask=mask,
                           generation_config=generation_config(section, tokenizer.eos_token_id, 0),
                           logits_processor=LogitsProcessorList([forced]))
    assert torch.equal(again, out.sequences)
    for warped, scores in zip(forced.warped, out.scores, strict=True):
        torch.testing.assert_close(warped, scores, rtol=0, atol=0)
    if kwargs is KWARGS:  # the bans act: suppressed, suppressed first, a banned word, EOS before min_new_tokens
        assert (forced.warped[0][:, [5, 6, 7, 8, tokenizer.eos_token_id]] == -math.inf).all()


def test_a_completion_ends_where_it_completes_a_stop_string(small):
    """generation_kwargs.stop_strings: a completion ends at the token that completes the string (kept, not counted as
    truncated); up to there it is the completion its seed gives without the stop strings."""
    _, model, tokenizer = small
    prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in ("1=", "17+25=", "Write a function that")]
    section = SECTION.model_copy(update={"max_completion_length": 24})
    free, _ = sample(model, prompts, [1, 2, 3], section, tokenizer.eos_token_id, 0, False)
    texts = [tokenizer.decode(c) for c in free]
    stop = texts[0][len(texts[0]) // 2:][:3]  # a string that the first completion makes midway
    section = section.model_copy(update={"generation_kwargs": GenerationKwargs(stop_strings=[stop])})
    stopped, truncated = sample(model, prompts, [1, 2, 3], section, tokenizer.eos_token_id, 0, False, tokenizer)
    for whole, cut, text, cut_short in zip(free, stopped, texts, truncated):
        if stop in text:
            assert torch.equal(whole[:len(cut)], cut) and not cut_short
            assert stop in tokenizer.decode(cut) and stop not in tokenizer.decode(cut[:-1])
        else:
            assert torch.equal(whole, cut)
    assert len(stopped[0]) < len(free[0])


def test_seeded_sampling_draws_from_the_tempered_top_p_distribution():
    """The Gumbel-max draw's token frequencies equal softmax(logits / temperature) renormalized within top_p, which is
    what transformers' sampling draws from (TopPLogitsWarper then a multinomial draw)."""
    torch.manual_seed(0)
    scores, draws = torch.randn(1, 12) * 2, 20_000
    expected = TopPLogitsWarper(0.9)(None, scores / 0.7).softmax(-1)[0]
    sampler = SeededSampling(list(range(draws)), GrpoSection(temperature=0.7, top_p=0.9), torch.zeros(draws),
                             torch.device("cpu"))
    picked = sampler(None, scores.expand(draws, -1)).argmax(-1)
    frequencies = torch.bincount(picked, minlength=12).float() / draws
    assert frequencies[expected == 0].sum() == 0  # nothing outside top_p
    torch.testing.assert_close(frequencies, expected, atol=0.012, rtol=0)  # 4 standard errors at p = 0.5


def test_rounding_sized_differences_of_the_logits_do_not_change_the_draws():
    """Another layout's weights differ from one's own by rounding, and so do its logits: 20,000 draws over a
    4,096-token vocabulary, the logits moved by 1e-6, pick the same tokens (an inverse transform draw over the
    cumulative distribution, which every entry before the token moves, changed 4 of them when measured)."""
    torch.manual_seed(0)
    logits = torch.randn(20_000, 4096) * 3
    moved = logits + torch.randn_like(logits) * 1e-6
    picks = [SeededSampling(list(range(len(scores))), GrpoSection(), torch.zeros(len(scores)),
                            torch.device("cpu"))(None, scores).argmax(-1) for scores in (logits, moved)]
    assert torch.equal(*picks)


def test_each_rank_samples_whole_groups_of_the_same_global_batch_under_any_layout():
    prompts = datasets.Dataset.from_dict({"prompt_ids": [[i, i + 1] for i in range(12)],
                                          "prompt": [json.dumps(f"p{i}") for i in range(12)],
                                          "fields": [json.dumps({"answer": str(i)}) for i in range(12)],
                                          "source": [0] * 12})
    one = PromptBatches(prompts, 4, 0, 1, seed=5, num_iterations=2, num_generations=2)
    two = [PromptBatches(prompts, 2, rank, 2, seed=5, num_iterations=2, num_generations=2) for rank in range(2)]
    assert one.steps_per_epoch == 6  # 3 generations of 4 prompts, 2 steps each
    for position in range(8):
        [whole] = one.micro_batches(position)
        halves = [ranks.micro_batches(position)[0] for ranks in two]
        assert whole["generation"] == position // 2 == halves[0]["generation"]
        assert list(whole["rows"]) == [*halves[0]["rows"], *halves[1]["rows"]]
        assert whole["prompt"] == halves[0]["prompt"] + halves[1]["prompt"]
    assert list(one.micro_batches(0)[0]["rows"]) == list(one.micro_batches(1)[0]["rows"])  # one generation, 2 steps


def test_a_resume_with_another_number_of_generations_names_it():
    """Issue 68: the refusal spoke of a changed "global_batch_size" (the prompts per generation, 4 against 2) while the
    user's training.global_batch_size was the same; it names grpo.num_generations, the checkpoint's and this run's."""
    prompts = datasets.Dataset.from_dict({"prompt_ids": [[i, i + 1] for i in range(8)], "fields": ["{}"] * 8,
                                          "prompt": [json.dumps(f"p{i}") for i in range(8)], "source": [0] * 8})
    saved = PromptBatches(prompts, 4, 0, 1, seed=5, num_iterations=1, num_generations=2).state_dict()
    resumed = PromptBatches(prompts, 2, 0, 1, seed=5, num_iterations=1, num_generations=4)  # the same 8 completions
    with pytest.raises(ConfigError) as refused:
        resumed.load_state_dict(saved)
    assert str(refused.value) == (
        "--resume: the checkpoint's data position counts batches of another shape: grpo.num_generations is 2 there "
        "and 4 in this run; the prompts of a generation (training.global_batch_size / grpo.num_generations x the "
        "generation's steps, grpo.generation_batch_size / training.global_batch_size) is 4 there and 2 in this run. "
        "Resume with the checkpoint's grpo.num_generations, or start a new run (another --output-dir, or --overwrite)")
    older = {key: value for key, value in saved.items() if key != "num_generations"}  # a checkpoint from before it
    with pytest.raises(ConfigError, match="the prompts of a generation .* is 4 there and 2 in this run"):
        resumed.load_state_dict(older)
    PromptBatches(prompts, 4, 0, 1, seed=5, num_iterations=1, num_generations=2).load_state_dict(older)


def test_a_generation_of_several_steps_samples_their_prompts_at_once_and_each_step_trains_on_its_own():
    """grpo.generation_batch_size of 2 global batches, num_iterations 2: one generation serves 4 data positions (steps
    0, 1, 0, 1 of it, TRL's order); each step's prompts, over the ranks, are those a run generating every step takes
    at that step (the data order does not change), and a rank generates its share of both steps at once."""
    prompts = datasets.Dataset.from_dict({"prompt_ids": [[i, i + 1] for i in range(16)],
                                          "prompt": [json.dumps(f"p{i}") for i in range(16)],
                                          "fields": ["{}"] * 16, "source": [0] * 16})
    every_step = PromptBatches(prompts, 4, 0, 1, seed=5, num_iterations=1, num_generations=2)
    one = PromptBatches(prompts, 4, 0, 1, seed=5, num_iterations=2, num_generations=2, steps_per_generation=2)
    two = [PromptBatches(prompts, 2, rank, 2, seed=5, num_iterations=2, num_generations=2, steps_per_generation=2)
           for rank in range(2)]
    assert one.steps_per_epoch == 8 and one.generations_per_epoch == 2  # 2 generations of 8 prompts, 4 steps each
    for position in range(10):
        generation, part = position // 4, position % 2
        [whole] = one.micro_batches(position)
        halves = [ranks.micro_batches(position)[0] for ranks in two]
        assert whole["generation"] == generation == halves[1]["generation"] and whole["part"] == part
        step = list(every_step.micro_batches(2 * generation + part)[0]["rows"])  # epoch 1 from position 8 on
        assert list(whole["rows"][4 * part:4 * part + 4]) == step
        assert [*halves[0]["rows"][2 * part:2 * part + 2], *halves[1]["rows"][2 * part:2 * part + 2]] == step
        assert sorted([*halves[0]["rows"], *halves[1]["rows"]]) == sorted(whole["rows"])


def test_completion_rows_take_the_loss_on_the_completion_alone(small):
    _, model, _ = small
    prompts, completions = [torch.tensor([5, 6, 7]), torch.tensor([8])], [torch.tensor([9, 2]), torch.tensor([3, 4, 2])]
    batch = completion_rows(prompts, completions, pad_id=0, seq_len=8, packing="none")
    assert batch["input_ids"].tolist() == [[5, 6, 7, 9, 2], [8, 3, 4, 2, 0]]
    assert batch["slots"].tolist() == [[-1, -1, 0, 1], [3, 4, 5, -1]]  # position t scores token t + 1
    assert batch["completion_mask"].tolist() == [[True, True, False], [True, True, True]]
    assert batch["length"].tolist() == [5, 4]
    logps, _ = completion_logps(model, batch, torch.device("cpu"), 1.0)
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([[8, 3, 4, 2]])).logits[0, :-1].log_softmax(-1)
    torch.testing.assert_close(logps[1], alone.gather(1, torch.tensor([[3], [4], [2]]))[:, 0])
    assert logps[0, 2] == 0  # past the first completion's end


def test_packed_completions_take_the_loss_and_gradient_they_take_one_per_row(small):
    """bfd packs a micro-batch's completions whole into rows of seq_len, each with its own positions: no token sees
    another sequence's, so the log-probabilities, the loss of every loss type (and GSPO's sequence-level ratio), off
    the policy, and its gradient equal those of one completion per row."""
    path, _, _ = small
    model = AutoModelForCausalLM.from_pretrained(path)
    generator = torch.Generator().manual_seed(0)
    lengths = [(3, 7), (6, 2), (2, 9), (4, 1), (5, 5), (1, 3)]
    prompts = [torch.randint(3, 100, (p,), generator=generator) for p, _ in lengths]
    completions = [torch.randint(3, 100, (c,), generator=generator) for _, c in lengths]
    advantages = torch.randn(len(lengths), generator=generator)
    alone = completion_rows(prompts, completions, pad_id=0, seq_len=16, packing="none")
    packed = completion_rows(prompts, completions, pad_id=0, seq_len=16, packing="bfd")
    assert packed["input_ids"].shape == (4, 16) and packed["length"].sum() == alone["length"].sum()  # 6 rows alone
    assert torch.equal(packed["completion_mask"], alone["completion_mask"])
    for loss_type, level in [(loss_type, "token") for loss_type in LOSS_TYPES] + [("grpo", "sequence")]:
        settings = LossSettings(loss_type=loss_type, importance_sampling_level=level, beta=0.04,
                                max_completion_length=9)
        results = []
        for batch in (alone, packed):
            model.zero_grad()
            logps, entropies = completion_logps(model, batch, torch.device("cpu"), 0.9)
            ref = (logps.detach() + 0.1).where(batch["completion_mask"], 0)
            old = (logps.detach() + 0.2 * advantages[:, None]).where(batch["completion_mask"], 0)  # ratios not 1
            loss, sums = grpo_loss(logps, old, ref, advantages, batch["completion_mask"], settings,
                                   tokens_per_micro_batch=20.0, entropies=entropies)
            loss.backward()
            results.append((loss.detach(), logps.detach(), sums, [p.grad.clone() for p in model.parameters()]))
        (loss, logps, sums, grads), (packed_loss, packed_logps, packed_sums, packed_grads) = results
        torch.testing.assert_close(packed_logps, logps, rtol=0, atol=1e-6)
        torch.testing.assert_close(packed_loss, loss, rtol=1e-6, atol=1e-7)  # float32's last bits: summed in rows
        torch.testing.assert_close(packed_sums, sums, rtol=1e-6, atol=1e-6)
        for packed_grad, grad in zip(packed_grads, grads):
            # summed over the tokens in another order: measured 1.3e-7 on one element of 262,144 with one thread
            torch.testing.assert_close(packed_grad, grad, rtol=1e-5, atol=1e-6)


def test_under_lora_the_reference_is_the_base_with_the_adapters_disabled(small):
    path, model, _ = small
    torch.manual_seed(0)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                          LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    objective = Grpo.__new__(Grpo)
    objective.section, objective.reference, objective.steps_per_generation = GrpoSection(beta=0.04), None, 1
    batch = completion_rows([torch.tensor([5, 6, 7])], [torch.tensor([9, 10, 2])], pad_id=0, seq_len=8,
                            packing="none")
    fixed = objective.with_fixed_logps(SimpleNamespace(module=lora, device=torch.device("cpu")), batch)
    base = completion_logps(model, batch, torch.device("cpu"), 1.0)[0]
    with torch.no_grad():
        adapted = completion_logps(lora, batch, torch.device("cpu"), 1.0)[0]
    torch.testing.assert_close(fixed["ref_logps"], base, rtol=0, atol=1e-6)
    assert (adapted - base).abs().max() > 1e-3  # the adapters do change the policy


def grpo_recipe(tmp_path, *overrides):
    save_small_checkpoint(tmp_path / "base")
    return load_recipe("tiny_llama_grpo", [f"model.name_or_path={tmp_path / 'base'}", *overrides])


@pytest.mark.parametrize("overrides, expected", [
    (["grpo.rewards=[]"], "needs grpo.rewards"),
    (["training.global_batch_size=60"], "multiple of grpo.num_generations=8"),
    (["grpo.max_completion_length=32"], "leaves no room for a prompt"),
    (["dpo.beta=0.2"], "dpo.* is set but training.objective is grpo"),
    (["grpo.loss_type=ppo"], r"grpo.loss_type: .*'bnpo', 'cispo', 'sapo', 'luspo' or 'vespo'"),
    (["grpo.delta=0.9"], r"grpo.delta: .*greater than 1"),
    (["grpo.top_entropy_quantile=1.5"], r"grpo.top_entropy_quantile: .*less than or equal to 1"),
    (["grpo.importance_sampling_level=group"], r"grpo.importance_sampling_level: .*'token' or 'sequence'"),
    (["grpo.use_adaptive_entropy=true", "grpo.entropy_coef_min=0.5", "grpo.entropy_coef_max=0.1"],
     r"grpo.entropy_coef_min=0.5 is above grpo.entropy_coef_max=0.1"),
])
def test_the_recipe_refuses_a_grpo_section_that_cannot_run(tmp_path, overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        grpo_recipe(tmp_path, *overrides)


@pytest.mark.parametrize("overrides, expected", [
    (["grpo.rewards=[{function: no_such_module:score}]"], "no module named 'no_such_module'"),
    (["grpo.rewards=[{function: rewards:nothing_here}]"], "'nothing_here' is not defined there"),
    (["grpo.rewards=[{function: format_regex}]"], "missing parameter"),
    ([f"grpo.rewards=[{{model: {REPO / 'recipes/tiny_llama_grpo'}}}]"], "cannot read the reward model's config"),
    (["data.packing=concat"], "data.packing=concat: it would cut completions across rows"),
    (["grpo.sync_ref_model=true", "grpo.beta=0"], "grpo.sync_ref_model with beta=0: there is no reference to sync"),
    (["grpo.sync_ref_model=true", "lora.enabled=true"], "grpo.sync_ref_model with lora: the reference is the base"),
    (["grpo.generation_batch_size=96"], "grpo.generation_batch_size=96 with training.global_batch_size=64: each "
                                        "optimizer step trains on a whole global batch"),
    (["grpo.cast_lm_head_to_fp32=true", "lora.enabled=true", "lora.target_modules=[q_proj, lm_head]"],
     "grpo.cast_lm_head_to_fp32 with another module in the LM head's place"),
    (["grpo.cast_lm_head_to_fp32=true", "lora.enabled=true", "lora.modules_to_save=[lm_head]"],
     "grpo.cast_lm_head_to_fp32 with another module in the LM head's place"),
    (["grpo.generation_batch_size=128", "grpo.num_iterations=2", "checkpointing.every_steps=6"],
     r"checkpointing.every_steps=6 with 4 steps per generation .*save every multiple of 4"),
])
def test_grpo_refuses_before_anything_is_built(tmp_path, overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        Grpo.check(grpo_recipe(tmp_path, *overrides), None)


def test_min_new_tokens_above_the_completion_length_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="grpo.generation_kwargs.min_new_tokens=20 is above "
                                          "grpo.max_completion_length=16: no completion could end"):
        grpo_recipe(tmp_path, "grpo.generation_kwargs.min_new_tokens=20")


def test_a_generation_kwargs_token_beyond_the_vocabulary_is_named(tmp_path):
    recipe = grpo_recipe(tmp_path, "grpo.generation_kwargs.bad_words_ids=[[5, 4096]]")
    Grpo.check(recipe, SimpleNamespace(vocab_size=4097))
    with pytest.raises(ConfigError, match="grpo.generation_kwargs names token id 4096, beyond the model's vocabulary "
                                          "of 4096"):
        Grpo.check(recipe, SimpleNamespace(vocab_size=4096))


def test_a_prompt_over_the_budget_is_named_or_dropped(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": text, "answer": "1"}) + "\n"
                            for text in ["1+0=", "word " * 40, "0+1="]))
    tokenizer = AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer")
    config = DataConfig(sources=[{"path": str(path)}], seq_len=32, examples="prompts", completion_tokens=16)
    with pytest.raises(DataError,
                       match=rf"{path}: row 2: the prompt is \d+ tokens, over the 16 .*data.long_documents=drop"):
        build_dataset(config, tokenizer)
    prepared, stats, _ = build_dataset(config.model_copy(update={"long_documents": "drop"}), tokenizer)
    assert stats["long_documents_dropped"] == 1 and len(prepared["train"]) == 2
    assert {json.loads(f)["answer"] for f in prepared["train"]["fields"]} == {"1"}


def test_chat_prompts_go_through_the_chat_template_with_grpo_chat_template_kwargs(tmp_path):
    """grpo.chat_template_kwargs reach the chat template of a prompt of chat messages (as TRL passes them): here a
    template that opens a think block unless enable_thinking is false (Qwen3's switch)."""
    path = tmp_path / "prompts.jsonl"
    messages = [{"role": "user", "content": "1+2="}]
    path.write_text(json.dumps({"prompt": messages, "answer": "3"}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% if enable_thinking is not defined or "
                               "enable_thinking %} <think>{% endif %}{% endif %}")
    recipe = grpo_recipe(tmp_path, f"data.sources=[{{path: {path}}}]", "data.dedup.exact=false",
                         "grpo.chat_template_kwargs={enable_thinking: false}")
    assert recipe.data.chat_template_kwargs == {"enable_thinking": False}
    thinking, plain = (build_dataset(recipe.data.model_copy(update={"chat_template_kwargs": kwargs}), tokenizer)[0]
                       ["train"]["prompt_ids"][0] for kwargs in ({}, {"enable_thinking": False}))
    assert tokenizer.decode(thinking).endswith("assistant: <think>")
    assert plain == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False, enable_thinking=False)
    assert tokenizer.decode(plain).endswith("assistant:")


def test_evaluation_prompts_are_held_out_and_every_rank_generates_the_same_batches(tmp_path):
    """data.eval holds prompts out (training sees none of them); EvalPromptBatches gives every evaluation prompt to
    one rank once, in batches of the same count and size on every rank (ZeRO-3 gathers weights in each decoding
    pass), the last padded with copies marked not real."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
    tokenizer = AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer")
    config = DataConfig(sources=[{"path": str(path)}], seq_len=32, examples="prompts", completion_tokens=16,
                        eval={"fraction": 0.25})
    prepared, stats, _ = build_dataset(config, tokenizer)
    assert len(prepared["eval"]) == 5 == stats["eval"]["prompts"] and len(prepared["train"]) == 15
    assert not set(prepared["eval"]["prompt"]) & set(prepared["train"]["prompt"])
    ranks = [EvalPromptBatches(prepared["eval"], 2, rank, 2) for rank in range(2)]
    batches = [list(batches) for batches in ranks]
    assert [len(b) for b in batches] == [2, 2] and all(len(batch["prompt_ids"]) == 2 for b in batches for batch in b)
    real = [row for b in batches for batch in b for row, kept in zip(batch["rows"], batch["real"]) if kept]
    assert sorted(real) == [0, 1, 2, 3, 4]  # each once
    assert [list(batch["real"]) for batch in batches[1]] == [[True, True], [False, False]]
    assert len(list(EvalPromptBatches(prepared["eval"], 2, 0, 2, max_rows=3))) == 1


def test_an_evaluation_batch_holds_as_many_completions_as_a_rank_generates_in_training(tmp_path):
    """grpo.num_generations_eval (TRL's) sets the completions per evaluation prompt; a batch holds as many completions
    as a rank's training generation (which the memory plan counts), so fewer per prompt is more prompts per batch, and
    more than a rank generates is refused."""
    import train
    save_small_checkpoint(tmp_path / "base")
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
    prepared, _, _ = build_dataset(DataConfig(sources=[{"path": str(path)}], seq_len=32, examples="prompts",
                                              completion_tokens=16, eval={"fraction": 0.25}),
                                   AutoTokenizer.from_pretrained(REPO / "recipes/tiny_llama/tokenizer"))

    def plan(*overrides):  # tiny_llama_grpo: 64 completions a step, groups of 8; 2 ranks generate 32 each
        return train.make_plan(train.parse_args(["--recipe", "tiny_llama_grpo", "--dry-run",
                                                 f"model.name_or_path={tmp_path / 'base'}", *overrides]), world_size=2)

    assert [Grpo(plan(*overrides)).batches(prepared, 0)[1].micro_batch_size
            for overrides in ([], ["grpo.num_generations_eval=2"])] == [4, 16]
    with pytest.raises(ConfigError, match=r"grpo.num_generations_eval=40: more completions of one evaluation prompt "
                                          r"than a rank generates in training \(32\)"):
        Grpo.check(grpo_recipe(tmp_path, "grpo.num_generations_eval=40"), None, world_size=2)


def test_the_dry_run_shows_prompts_generations_and_generation_memory(tmp_path, capsys):
    import train
    save_small_checkpoint(tmp_path / "base")
    assert train.main(["--recipe", "tiny_llama_grpo", "--dry-run", "--output-dir", str(tmp_path / "out"),
                       f"model.name_or_path={tmp_path / 'base'}", "grpo.top_k=20", "grpo.min_p=0.1",
                       "grpo.generation_kwargs={stop_strings: [</answer>], typical_p: 0.9}",
                       "grpo.sync_ref_model=true", "grpo.ref_model_sync_steps=2"]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    assert "batch: 8 prompts x 8 generations = 64 completions per step; 32 completions/rank x 2 accumulation" in out
    assert ("in one batch, sampled at temperature 1 (top_k 20, min_p 0.1, stop_strings ['</answer>'], typical_p 0.9), "
            "up to 16 decoding passes") in out
    assert "GRPO: loss dapo (token-level ratio, scale_rewards group), beta 0.04, epsilon 0.2/0.2" in out
    assert "rewards: rewards:closeness x 1, exact_answer x 1" in out and "note" not in out
    assert "KV cache" in out
    assert re.search(r"reference: the starting checkpoint, a frozen copy on each rank \(([\d.]+) MiB\), synced to the "
                     r"policy every 2 steps \(alpha 0.6\) and saved with each checkpoint by rank 0 \(\1 MiB,", out)
    assert re.search(r"generation cost per step and rank: [\d.e+]+ FLOPs at most \(33% of training on the same "
                     r"tokens\), in 16 decoding passes", out)


def test_on_a_gpu_of_the_table_the_plan_gives_the_generations_floor(monkeypatch):
    """Memory-bound: every decoding pass reads the bf16 weights and the KV cache so far, for the rank's 32 rows
    (256 completions over 8 ranks), at the GPU's bandwidth; compute-bound with 8 new tokens after 1,016."""
    import train
    from training.objectives.grpo import report as grpo

    def cost(*overrides: str) -> tuple[RunPlan, str]:
        plan = train.make_plan(train.parse_args(["--recipe", "qwen2_5_1_5b_grpo", "--dry-run", "precision=bf16",
                                                 *overrides]), world_size=8)
        return plan, grpo.generation_cost(plan, 32)

    assert "at least" not in cost()[1]  # a CPU
    monkeypatch.setattr(grpo, "device_name", lambda: "NVIDIA H100 80GB HBM3")
    plan, line = cost()
    shape, completion, prompt = plan.shape, 768, 1024 - 768
    kv_per_token = 2 * shape.num_layers * shape.kv_dim * 2 * 32
    reads = completion * shape.parameters * 2 + kv_per_token * sum(prompt + t for t in range(completion))
    assert f"; at least {reads / 3.35e12:.3g} s on NVIDIA H100 80GB HBM3 ({format_bytes(reads)} read at 3.35 TB/s;" \
        in line
    plan, line = cost("grpo.max_completion_length=8")
    assert (f"; at least {2 * shape.matmul_parameters * 32 * 1024 / 989e12:.3g} s on NVIDIA H100 80GB HBM3 (at 989 "
            f"TFLOP/s;") in line


@pytest.mark.parametrize("settings, expected", [
    ({"loss_type": "grpo", "importance_sampling_level": "sequence", "delta": 4},
     ["GRPO: loss grpo (sequence-level ratio, delta 4, scale_rewards group), beta 0, epsilon 0.2/0.2"]),
    ({"loss_type": "cispo", "epsilon_high": 5, "delta": 4, "multi_objective_aggregation": "normalize_then_sum"},
     ["GRPO: loss cispo (token-level ratio, delta unused by cispo, rewards normalize_then_sum), beta 0, "
      "epsilon 0.2/5"]),
    ({"loss_type": "bnpo", "beta": 0.04, "off_policy_mask_threshold": 0.5, "top_entropy_quantile": 0.2,
      "entropy_coef": 0.01, "use_bias_correction_kl": False},
     ["GRPO: loss bnpo (token-level ratio, scale_rewards group, off-policy mask above KL 0.5, top 0.2 of tokens by "
      "entropy, entropy bonus 0.01, KL without the ratio), beta 0.04"]),
    ({"loss_type": "grpo", "entropy_coef": 0.01, "use_adaptive_entropy": True},
     ["GRPO: loss grpo (token-level ratio, scale_rewards group, adaptive entropy bonus from 0.01, +/-0.005 within "
      "[0, 1] by the entropy against 0.2), beta 0"]),
    ({"loss_type": "luspo"}, ["GRPO: loss luspo", "note (TRL warns alike): luspo is meant with "
                                                  "importance_sampling_level=sequence"]),
    ({"loss_type": "dapo", "importance_sampling_level": "sequence"},
     ["GRPO: loss dapo (sequence-level ratio", "note (TRL warns alike): dapo sums per-token losses"]),
    ({"loss_type": "vespo", "importance_sampling_level": "sequence"},
     ["GRPO: loss vespo", "note (TRL warns alike): vespo weighs each sequence's whole ratio itself"]),
])
def test_the_plan_names_the_loss_and_the_combinations_trl_warns_of(settings, expected):
    section = GrpoSection(rewards=[{"function": "exact_answer"}], **settings)
    lines = loss_lines(section)
    assert len(lines) == len(expected) and all(line.startswith(start) for line, start in zip(lines, expected))


def test_adaptive_entropy_control_keeps_the_bonus_in_the_memory_plan_at_a_coefficient_of_0(tmp_path):
    """Its coefficient may start at 0 and rise: the bonus's fp32 [tokens, vocabulary] tensor is planned from the
    start, as for a fixed coefficient."""
    from transformers import AutoConfig

    from training.planning.activations import activation_bytes, activation_inputs
    from training.planning.shape import model_shape
    recipes = [grpo_recipe(tmp_path, *overrides) for overrides in
               ([], ["grpo.entropy_coef=0.1"], ["grpo.use_adaptive_entropy=true", "grpo.entropy_coef=0"])]
    shape = model_shape(AutoConfig.from_pretrained(tmp_path / "base"))
    plain, fixed, adaptive = (activation_bytes(shape, activation_inputs(recipe, "bf16", shape).at_setting("2"))
                              .peak(False) for recipe in recipes)
    assert plain < fixed == adaptive


def test_each_rank_must_hold_whole_groups(tmp_path):
    recipe = grpo_recipe(tmp_path)  # 64 completions, groups of 8
    Grpo.check(recipe, None, world_size=8)
    with pytest.raises(ConfigError, match="over 16 data-parallel ranks is not whole groups .* multiple of 128"):
        Grpo.check(recipe, None, world_size=16)


def test_compiled_decoding_under_zero_3_gathers_the_whole_weights(tmp_path):
    """A compiled decoding graph cannot hold ZeRO-3's per-layer gathering hooks: the compiled engine runs at ZeRO-3
    only with the whole weights gathered once per generation (the hooks off), and at any other stage as it is."""
    compiled = grpo_recipe(tmp_path, "grpo.generation_engine=compiled")
    with pytest.raises(ConfigError, match="compiled under ZeRO-3 without grpo.ds3_gather_for_generation.*set "
                                          "grpo.ds3_gather_for_generation=true"):
        Grpo.check(compiled, None, world_size=8, zero_stage=3)
    for stage in (0, 1, 2):
        Grpo.check(compiled, None, world_size=8, zero_stage=stage)
    Grpo.check(grpo_recipe(tmp_path, "grpo.generation_engine=compiled", "grpo.ds3_gather_for_generation=true"), None,
               world_size=8, zero_stage=3)
    Grpo.check(grpo_recipe(tmp_path, "grpo.generation_engine=static"), None, world_size=8, zero_stage=3)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_memory_plan_holds_the_reference_whole_at_zero_0_to_2_and_a_share_of_it_at_zero_3(tmp_path, precision):
    """beta > 0 without LoRA: the starting checkpoint in the trained weights' dtype (fp32 at ZeRO-0, which runs 16-bit
    precision as autocast over fp32 weights), whole on every rank at ZeRO 0-2, 1/ranks of it at ZeRO-3 (in the node's
    memory where zero3_offload.json offloads the parameters); nothing with beta 0 or under LoRA (the base with the
    adapters disabled). In the run's own plan, every row of the table and the dry run's reference line."""
    import train
    from training.planning.memory import planned_model_states, states_per_setting
    from training.planning.plan import Machine
    save_small_checkpoint(tmp_path / "base")
    ranks, itemsize = 4, DTYPES[precision].itemsize

    def plan(config, *overrides):
        args = train.parse_args(["--recipe", "tiny_llama_grpo", "--dry-run", f"model.name_or_path={tmp_path / 'base'}",
                                 f"precision={precision}", f"deepspeed.config={config}", "training.micro_batch_size=16",
                                 *overrides])
        return train.make_plan(args, world_size=ranks)

    whole = plan("zero2").shape.parameters * itemsize
    for config, grown in (("zero2", whole), ("zero3", whole / ranks)):
        kl, none = plan(config), plan(config, "grpo.beta=0")
        assert planned_model_states(kl).device_bytes - planned_model_states(none).device_bytes == grown
        lora = [plan(config, "lora.enabled=true", *beta) for beta in ([], ["grpo.beta=0"])]
        assert planned_model_states(lora[0]) == planned_model_states(lora[1])
    rows = [states_per_setting(p.recipe, precision, p.shape, Machine(ranks, 1, 2**34, "test"), p.ds_config)
            for p in (kl, none)]  # the ZeRO-3 plans' tables, every setting a row
    device = {setting: rows[0][setting].device_bytes - rows[1][setting].device_bytes for setting in rows[0]}
    host = {setting: rows[0][setting].host_bytes - rows[1][setting].host_bytes for setting in rows[0]}
    offloaded = {"2_offload": whole, "3_offload": 0} if precision == "bf16" else {}  # no offload in fp32
    assert device == {"0": whole * 4 / itemsize, "1": whole, "2": whole, "3": whole / ranks, **offloaded}
    assert host == {**dict.fromkeys(rows[0], 0), **({"3_offload": whole} if offloaded else {})}  # ranks x 1/ranks
    assert (f"reference: the starting checkpoint, frozen, partitioned over the {ranks} ranks by ZeRO-3: "
            f"{format_bytes(whole / ranks)} per rank, on the device") in " ".join(Grpo.describe(kl))


def test_the_memory_plan_counts_a_generation_in_place_of_the_activations(tmp_path):
    """A generation's memory (grpo/memory.py, generation) comes between the steps: the peak is the model states
    plus the larger of it and a micro-batch's activations, in the run's plan, every row of the table and
    micro_batch_size=auto's refusal. Under ZeRO-3 with grpo.ds3_gather_for_generation it holds the whole weights too;
    an lm run holds none."""
    import train
    from training.objectives.grpo.memory import generation
    from training.planning.activations import activation_bytes, activation_inputs
    from training.planning.auto_config import with_training
    from training.planning.memory import planned_model_states, states_per_setting
    from training.planning.micro_batch import choose_micro_batch
    from training.planning.plan import Machine
    save_small_checkpoint(tmp_path / "base")
    ranks = 2

    def plan(config, *overrides):
        args = train.parse_args(["--recipe", "tiny_llama_grpo", "--dry-run", f"model.name_or_path={tmp_path / 'base'}",
                                 "precision=bf16", f"deepspeed.config={config}", *overrides])
        return train.make_plan(args, world_size=ranks)

    small = ["training.micro_batch_size=1", "training.global_batch_size=512", "data.seq_len=512",
             "grpo.max_completion_length=448"]
    gathered, sharded = (plan("zero3", *small, f"grpo.ds3_gather_for_generation={gather}")
                         for gather in ("true", "false"))
    zero2 = plan("zero2", *small, "grpo.ds3_gather_for_generation=true")
    memory = {name: generation(p.recipe, "bf16", p.shape, p.zero_stage, ranks)
              for name, p in (("gathered", gathered), ("sharded", sharded), ("zero2", zero2))}
    assert memory["gathered"].gathered_weights == gathered.shape.parameters * 2
    assert memory["sharded"].gathered_weights == memory["zero2"].gathered_weights == 0
    assert memory["gathered"].total == memory["sharded"].total + gathered.shape.parameters * 2
    acts = activation_bytes(sharded.shape, activation_inputs(sharded.recipe, "bf16", sharded.shape).at_setting("3")
                            ).peak(False)
    assert memory["sharded"].total > acts  # 256 completions of 512 tokens against one row's activations
    states = planned_model_states(sharded)
    assert states.generation_bytes == memory["sharded"].total
    assert states.peak_with(acts) == states.device_bytes + memory["sharded"].total
    for p in (sharded, gathered):
        table = states_per_setting(p.recipe, "bf16", p.shape, Machine(ranks, 1, 2**34, "test"), p.ds_config)
        expected = {setting: memory["gathered" if p is gathered and setting.startswith("3") else "sharded"].total
                    for setting in table}
        expected["0"] = generation(p.recipe, "bf16", p.shape, 0, ranks).total  # autocast over fp32 weights
        assert expected["0"] > expected["1"]
        assert {setting: states.generation_bytes for setting, states in table.items()} == expected
    language_model = train.make_plan(train.parse_args(["--recipe", "tiny_llama", "--dry-run"]), world_size=ranks)
    assert planned_model_states(language_model).generation_bytes == 0
    needed = states.peak_with(acts) / 0.9
    with pytest.raises(ConfigError, match=r"a generation holds more than the activations, between the steps"):
        choose_micro_batch(with_training(sharded.recipe, micro_batch_size="auto"), sharded.model_config, "bf16", "3",
                           Machine(ranks, 1, 0.99 * needed, "test"), ranks)
    assert "generation memory per rank, between the steps" in " ".join(Grpo.describe(gathered))
    assert "+ the whole weights gathered" in " ".join(Grpo.describe(gathered))
    assert ("weights: the rank's own full weights (grpo.ds3_gather_for_generation is ZeRO-3's and does nothing at "
            "ZeRO-2)") in " ".join(Grpo.describe(zero2))
    assert "does nothing" not in " ".join(Grpo.describe(gathered) + Grpo.describe(sharded))


def test_under_flex_attention_generation_and_packed_log_probabilities_equal_sdpas():
    """flex_attention, what `auto` picks on a GPU: a left-padded batch sampled with the KV cache gives sdpa's
    completions, and their log-probabilities packed into rows (bfd, transformers' document BlockMask) equal sdpa's.
    Run by FlexAttention's reference implementation (its kernel compiles for CUDA: tests/test_gpu_invariants.py), on
    generate's dynamic cache: transformers' static cache takes no BlockMask (grpo decodes with sdpa: `decoding`)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    shape = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)  # heads of 16, FlexAttention's least
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 97, (length,), generator=generator) for length in (3, 7, 5, 9) for _ in range(2)]
    results = {}
    with torch.compiler.set_stance("force_eager"):
        for attention in ("sdpa", "flex_attention"):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation=attention)).eval()
            completions, _ = sample(model, prompts, list(range(len(prompts))),
                                    SECTION.model_copy(update={"generation_engine": "generate"}), eos_id=2, pad_id=0,
                                    synced=False)
            batch = completion_rows(prompts, completions, 0, 32, "bfd")
            assert len(batch["input_ids"]) < len(prompts)  # packed: rows of several completions
            with torch.no_grad():
                results[attention] = completions, completion_logps(model, batch, torch.device("cpu"), 0.9)[0]
    assert [c.tolist() for c in results["flex_attention"][0]] == [c.tolist() for c in results["sdpa"][0]]
    torch.testing.assert_close(results["flex_attention"][1], results["sdpa"][1], rtol=1e-5, atol=1e-5)


def test_decoding_runs_compiled_layers_eagerly_and_flex_attention_models_with_sdpa():
    """Under `decoding` a compiled layer is never traced (outside it, the first call would trace it, and on a GPU every
    layer's new KV cache traced it again: docs/grpo.md), and a FlexAttention model decodes with sdpa, to the same
    completions, and holds FlexAttention again after."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from training.models.compile import compile_layers
    shape = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    prompts, traced = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])], []

    def counting_backend(graph, inputs):
        traced.append(graph)
        return graph.forward
    completions = {}
    for attention in ("sdpa", "flex_attention"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation=attention)).eval()
        compile_layers(model, backend=counting_backend)
        with decoding(model, attention, "generate"):
            assert model.config._attn_implementation == "sdpa"
            completions[attention], _ = sample(model, prompts, [1, 2], SECTION, eos_id=2, pad_id=0, synced=False)
        assert model.config._attn_implementation == attention and not traced
    assert [c.tolist() for c in completions["flex_attention"]] == [c.tolist() for c in completions["sdpa"]]


def test_a_log_extra_column_of_another_length_is_named():
    from training.objectives.grpo.logs import extra_columns
    from training.objectives.grpo.rewards import RewardLog
    log = RewardLog()
    log.extra("ids", [1, 2, 3])
    assert extra_columns(log, 3) == {"ids": [1, 2, 3]}
    log.extra("ids", [4])
    with pytest.raises(DataError, match=r"log_extra\('ids', ...\) gave 4 values for 3 completions"):
        extra_columns(log, 3)
