"""training/objectives/grpo/sampling.py's engines: grpo.generation_engine's static KV cache samples exactly the
completions of generate's dynamic one (fp32), with every sampling setting; the sampling itself against transformers'
and its seeds: test_objective.py."""
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.conftest import save_small_checkpoint
from training.config.families import FAMILIES, family_of
from training.objectives.grpo.sampling import generation_config, sample
from training.objectives.grpo.spec import GenerationKwargs, GrpoSection

BANS = {"min_new_tokens": 3, "no_repeat_ngram_size": 2, "suppress_tokens": [5, 6], "begin_suppress_tokens": [7],
        "bad_words_ids": [[8], [9, 10]], "sequence_bias": [[[11], 4.0], [[12, 13], -3.0]]}
WARPERS = {"top_h": 0.7, "typical_p": 0.9, "epsilon_cutoff": 3e-4, "eta_cutoff": 3e-4}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("small")
    save_small_checkpoint(path)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("settings, kwargs", [
    ({}, {}),
    ({"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3}, {}),
    ({"temperature": 1.2}, WARPERS),
    ({"top_k": 20}, BANS),
    ({"temperature": 0.9, "top_p": 0.95}, {"stop_strings": ["e", " t"]}),
], ids=["defaults", "grpo-settings", "warpers", "bans-and-biases", "stop-strings"])
def test_the_static_cache_samples_generates_completions(small, settings, kwargs):
    """The same prompts (three lengths, left-padded) and seeds give the same completions, ends and truncations on
    either engine: the static cache changes where the keys and values live, not what is sampled."""
    model, tokenizer = small
    prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in ("1=", "17+25=", "Write a function that")] * 2
    section = GrpoSection(max_completion_length=16, **settings, generation_kwargs=GenerationKwargs(**kwargs))
    sampled = {engine: sample(model, prompts, [3, 1, 4, 1, 5, 9], section.model_copy(
                   update={"generation_engine": engine}), tokenizer.eos_token_id, 0, False, tokenizer)
               for engine in ("generate", "static")}
    (dynamic, dynamic_cut), (static, static_cut) = sampled["generate"], sampled["static"]
    assert all(map(torch.equal, dynamic, static)) and dynamic_cut == static_cut
    if "stop_strings" in kwargs:  # where a stop string ends a completion early, it does on both
        assert any(len(c) < section.max_completion_length and not cut for c, cut in zip(static, static_cut))


def test_auto_is_generate_and_each_engine_is_its_config():
    """grpo.generation_engine=auto samples with generate's own (dynamic) cache; static with the static one, its decoding
    passes never compiled (decoding runs eagerly: sampling.py's decoding)."""
    assert GrpoSection().engine == "generate" and GrpoSection(generation_engine="static").engine == "static"
    static = generation_config(GrpoSection(generation_engine="static"), eos_id=2, pad_id=0)
    assert static.cache_implementation == "static" and static.disable_compile
    assert generation_config(GrpoSection(), eos_id=2, pad_id=0).cache_implementation is None


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_samples_the_same_completions_on_either_engine(model_type):
    """Each decoder family's record (training/config/families.py), and a LoRA model over one, on transformers' static
    cache: the completions of its dynamic one (a family whose attention kept no static cache would fail here)."""
    experts = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, bos_token_id=1,
                                  eos_token_id=2, **(experts if family_of(model_type).autoep_preset else {}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    models = [model] + ([get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                          init_lora_weights=False)).eval()]
                        if model_type == "llama" else [])
    prompts = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10]), torch.tensor([11, 12, 13])]
    for sampled in models:
        completions = [sample(sampled, prompts, [1, 2, 3],
                              GrpoSection(max_completion_length=8, generation_engine=engine), eos_id=2, pad_id=0,
                              synced=False)[0] for engine in ("generate", "static")]
        assert all(map(torch.equal, *completions)), model_type
