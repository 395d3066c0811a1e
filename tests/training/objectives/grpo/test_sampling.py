"""training/objectives/grpo/sampling.py's engines: grpo.generation_engine's static KV cache, eager or with its decoding
compiled, samples exactly the completions of generate's dynamic one (fp32), with every sampling setting; the sampling
itself against transformers' and its seeds: test_objective.py."""
from unittest import mock

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.conftest import save_small_checkpoint
from training.config.families import FAMILIES, family_of
from training.objectives.grpo.sampling import decoding, generation_config, sample
from training.objectives.grpo.spec import GenerationKwargs, GrpoSection, prompt_width

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
def test_each_in_process_engine_samples_generates_completions(small, settings, kwargs):
    """The same prompts (three lengths, left-padded) and seeds give the same completions, ends and truncations on
    every in-process engine: the static cache changes where the keys and values live, compiled decoding how each pass
    is computed (and the prompts' padding, to a power-of-two width), not what is sampled. Every setting runs on one
    compiled graph: the sampling is outside it."""
    model, tokenizer = small
    prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in ("1=", "17+25=", "Write a function that")] * 2
    section = GrpoSection(max_completion_length=16, **settings, generation_kwargs=GenerationKwargs(**kwargs))
    sampled = {engine: sample(model, prompts, [3, 1, 4, 1, 5, 9], section.model_copy(
                   update={"generation_engine": engine}), tokenizer.eos_token_id, 0, False, tokenizer)
               for engine in ("generate", "static", "compiled")}
    dynamic, dynamic_cut = sampled["generate"]
    for engine in ("static", "compiled"):
        completions, cut = sampled[engine]
        assert all(map(torch.equal, dynamic, completions)) and dynamic_cut == cut, engine
    if "stop_strings" in kwargs:  # where a stop string ends a completion early, it does on every engine
        assert any(len(c) < section.max_completion_length and not cut for c, cut in zip(dynamic, dynamic_cut))


def test_auto_is_generate_and_each_engine_is_its_config():
    """grpo.generation_engine=auto samples with generate's own (dynamic) cache; static with the static one, its decoding
    passes never compiled (decoding runs eagerly: sampling.py's decoding); compiled with the static one, compiled on
    any device, with CUDA graphs on a GPU; its prompts padded to a power-of-two width."""
    assert GrpoSection().engine == "generate" and GrpoSection(generation_engine="static").engine == "static"
    static = generation_config(GrpoSection(generation_engine="static"), eos_id=2, pad_id=0)
    assert static.cache_implementation == "static" and static.disable_compile
    assert generation_config(GrpoSection(), eos_id=2, pad_id=0).cache_implementation is None
    compiled = {device: generation_config(GrpoSection(generation_engine="compiled"), 2, 0, device)
                for device in ("cpu", "cuda")}
    assert all(c.cache_implementation == "static" and not c.disable_compile for c in compiled.values())
    assert [compiled[device].compile_config.mode for device in ("cpu", "cuda")] == ["default", "reduce-overhead"]
    assert [prompt_width(n, "compiled") for n in (1, 5, 8, 9, 200)] == [1, 8, 8, 16, 256]
    assert [prompt_width(n, engine) for n in (5, 9) for engine in ("generate", "static")] == [5, 5, 9, 9]


def counting_backend(traced: dict, name: str):
    """A torch.compile backend that counts the graphs it is handed under traced[name] and runs them as traced."""
    def backend(graph, inputs):
        traced[name] += 1
        return graph.forward
    return backend


def decoding_compiled_by(backend):
    """torch.compile as transformers' get_compiled_call calls it, with `backend` in inductor's place."""
    real_compile = torch.compile

    def compile_with(function, **options):
        return real_compile(function, fullgraph=options["fullgraph"], dynamic=options["dynamic"], backend=backend)
    return mock.patch("torch.compile", compile_with)


def test_compiled_decoding_never_runs_trainings_compiled_layers(small):
    """Under `decoding` the compiled engine compiles the whole model's call (one graph for the batch's shape), and the
    layers training compiled (training/models/compile.py) are never traced from it, nor run: their own compiled calls
    are set aside for the generation, and back after it. The completions are generate's."""
    from training.models.compile import compile_layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small[0].config).eval()  # a model of its own, compiled
    traced = {"layers": 0, "decoding": 0}
    compile_layers(model, backend=counting_backend(traced, "layers"))
    prompts, seeds = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])], [1, 2]
    section = GrpoSection(max_completion_length=6)
    with decoding(model, "sdpa", "generate"):
        expected = sample(model, prompts, seeds, section, eos_id=2, pad_id=0, synced=False)[0]
    with decoding(model, "sdpa", "compiled"), decoding_compiled_by(counting_backend(traced, "decoding")):
        compiled = sample(model, prompts, seeds, section.model_copy(update={"generation_engine": "compiled"}),
                          eos_id=2, pad_id=0, synced=False)[0]
    assert traced == {"layers": 0, "decoding": 1} and all(map(torch.equal, expected, compiled))
    model(input_ids=torch.tensor([[5, 6]]))  # outside the generation each layer runs its own compiled call
    assert traced["layers"] >= 1


def test_compiled_decoding_samples_a_lora_models_completions(small):
    """A LoRA model, peft's layers inside the compiled graph as in a LoRA run's generation, samples generate's
    completions on the compiled engine, from one graph."""
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(small[0].config),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    prompts, seeds, traced = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])], [1, 2], {"decoding": 0}
    section = GrpoSection(max_completion_length=6)
    expected = sample(model, prompts, seeds, section, eos_id=2, pad_id=0, synced=False)[0]
    with decoding(model, "sdpa", "compiled"), decoding_compiled_by(counting_backend(traced, "decoding")):
        compiled = sample(model, prompts, seeds, section.model_copy(update={"generation_engine": "compiled"}),
                          eos_id=2, pad_id=0, synced=False)[0]
    assert traced == {"decoding": 1} and all(map(torch.equal, expected, compiled))


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
