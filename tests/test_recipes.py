"""Every shipped model recipe (tiny_llama and tiny_llama_sft have tests of their own, tiny_llama_distill in
tests/training/objectives/distill/; tiny_llama_dpo, which starts from tiny_llama_sft's export, has its own below):
its config.json is the published architecture, its model family keeps attention inside each document of a packed row,
its full-size plan fits the hardware it is written for, and the recipe itself trains on CPU with the model shrunk and
local data in place of the hub."""
import importlib.util
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import train
from data_pipeline.pack import pack_concat
from tests.conftest import REPO, run_train, save_small_checkpoint
from training.config.recipe import available_recipes, load_recipe
from training.models.attention import attention_for
from training.models.model import load_model_config

RECIPES = [name for name in available_recipes()
           if name not in ("tiny_llama", "tiny_llama_sft", "tiny_llama_dpo", "tiny_llama_grpo", "tiny_llama_distill")]

# Parameter counts of the published checkpoints (tied embeddings counted once).
PUBLISHED_PARAMETERS = {
    "llama2_7b": 6_738_415_616,  # meta-llama/Llama-2-7b-hf
    "llama2_7b_sft": 6_738_415_616,  # the same checkpoint
    "llama3_8b": 8_030_261_248,  # meta-llama/Meta-Llama-3-8B
    "llama3_8b_long": 8_030_261_248,  # the same checkpoint, its RoPE base and context raised
    "llama3_8b_anneal": 8_030_261_248,  # the same checkpoint, annealed
    "llama3_8b_lora": 8_030_261_248,  # the same checkpoint, frozen under adapters
    "llama3_8b_dpo": 8_030_261_248,  # princeton-nlp/Llama-3-Base-8B-SFT: Meta-Llama-3-8B fine-tuned
    "llama3_70b": 70_553_706_496,  # meta-llama/Meta-Llama-3-70B
    "mistral_7b": 7_241_732_096,  # mistralai/Mistral-7B-v0.1
    "qwen2_5_1_5b": 1_543_714_304,  # Qwen/Qwen2.5-1.5B
    "qwen2_5_1_5b_grpo": 1_543_714_304,  # the same checkpoint
    "gpt2": 124_439_808,  # openai-community/gpt2
    "mixtral_8x7b": 46_702_792_704,  # mistralai/Mixtral-8x7B-v0.1
    "qwen3_30b_a3b": 30_532_122_624,  # Qwen/Qwen3-30B-A3B-Base
}

# The GPUs each recipe is written for (its header and README): H100s, 80 GB.
TARGET_GPUS = {"llama2_7b": 8, "llama2_7b_sft": 8, "llama3_8b": 8, "llama3_8b_long": 8, "llama3_8b_anneal": 8,
               "llama3_8b_lora": 1,
               "llama3_8b_dpo": 8, "llama3_70b": 32, "mistral_7b": 8, "qwen2_5_1_5b": 1,
               "qwen2_5_1_5b_grpo": 8, "gpt2": 1, "mixtral_8x7b": 32,
               "qwen3_30b_a3b": 16}

TINY_TOKENIZER = str(REPO / "recipes/tiny_llama/tokenizer")  # 4,096 tokens: fits every model's vocabulary


def model_config(name: str):
    """The architecture a recipe trains: its shipped config.json with the recipe's own overrides."""
    recipe = load_recipe(name)
    assert recipe.model.config, f"{name}: ship the checkpoint's config.json as model.config"
    return load_model_config(recipe.model)


def cpu_attention(name: str, as_on_gpu: bool = False) -> str:
    """The recipe's attention as it resolves on a CPU (as_on_gpu: on a GPU), or sdpa where it names
    flash_attention_2 and the flash-attn package (CUDA only) is missing: the packed-row test of flash_attention_2's
    own kernels needs a GPU."""
    implementation = attention_for(load_recipe(name).model.attn_implementation, model_config(name), as_on_gpu)
    return "sdpa" if implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None \
        else implementation


def small_sizes(config) -> dict:
    """The recipe's model family at 2 layers of width 64 over tiny_llama's 4,096-token tokenizer."""
    if config.model_type == "gpt2":
        sizes = {"n_layer": 2, "n_embd": 64, "n_head": 4}
    else:
        sizes = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                 "num_key_value_heads": 2}
        if hasattr(config, "head_dim"):  # Llama and Mistral keep a head_dim; Qwen2 derives it
            sizes["head_dim"] = 16
        if config.model_type == "mixtral":
            sizes |= {"num_local_experts": 4, "num_experts_per_tok": 2}
        if config.model_type == "qwen3_moe":
            sizes |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    return sizes | {"vocab_size": 4096, "bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize("name", RECIPES)
def test_config_has_the_published_parameter_count(name):
    assert name in PUBLISHED_PARAMETERS, f"add {name}'s published parameter count to PUBLISHED_PARAMETERS"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(name))
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[name]


def one_of_each_family(names: list[str]) -> list[str]:
    """The first recipe of each model type: what the GPU's attention (flex_attention for most) is checked on."""
    first = {}
    for name in names:
        first.setdefault(model_config(name).model_type, name)
    return list(first.values())


FAMILIES = one_of_each_family(RECIPES)


@pytest.mark.slow
@pytest.mark.parametrize("name, on_gpu", [*((name, False) for name in RECIPES), *((name, True) for name in FAMILIES)],
                         ids=lambda value: {False: "cpu", True: "gpu"}.get(value, value) if isinstance(value, bool)
                         else value)
def test_packed_documents_do_not_attend_to_each_other(name, on_gpu):
    """The recipe's model family (Llama, Mistral, Qwen2, GPT-2) on a packed row, with the attention it runs on a
    CPU (sdpa) and on a GPU (flex_attention for most, run here by FlexAttention's reference implementation): every
    document gets the per-token loss it has alone, because the position ids restart at each document."""
    config = model_config(name)
    config.update(small_sizes(config) | {"use_cache": False})  # as training builds it (training/models/model.py)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,  # not the config's torch_dtype
                                             attn_implementation=cpu_attention(name, on_gpu)).eval()
    rng = np.random.default_rng(0)
    lengths = np.array([7, 12, 5, 9])
    documents = [rng.integers(4, 4096, size=n) for n in lengths]
    rows = pack_concat(np.concatenate(documents), lengths, seq_len=int(lengths.sum()))
    row = {key: torch.from_numpy(rows[key][0]).long() for key in ("input_ids", "labels", "position_ids")}

    def per_token_loss(input_ids, position_ids, labels):
        logits = model(input_ids=input_ids[None], position_ids=position_ids[None]).logits[0]
        return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100, reduction="none")

    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        packed = per_token_loss(row["input_ids"], row["position_ids"], row["labels"])
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        for document, start in zip(documents, starts):
            ids = torch.from_numpy(document).long()
            alone = per_token_loss(ids, torch.arange(len(ids)), ids)
            torch.testing.assert_close(packed[start:start + len(ids) - 1], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_full_size_plan_fits_the_target_gpus(name, capsys, tmp_path):
    """--dry-run of the recipe as shipped, for its target GPUs, offline: the shipped config.json plans the
    model, and the hub tokenizer (not in the cache here) is left for the real run to download."""
    assert name in TARGET_GPUS, f"add the number of GPUs {name} is written for to TARGET_GPUS"
    args = ["--recipe", name, "--dry-run", "--num-gpus", str(TARGET_GPUS[name]), "--gpu-mem", "80",
            "--output-dir", str(tmp_path)]
    assert train.main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"{PUBLISHED_PARAMETERS[name]:,} parameters" in out
    row = next(line for line in out.splitlines() if "(this run)" in line)
    fits = row.strip("│ ").split("│")[-1].strip()  # the memory table's last column for the recipe's ZeRO stage
    assert fits == "yes" or (fits == "with checkpointing" and load_recipe(name).activation_checkpointing), row


def local_data(name: str, folder) -> list[str]:
    """The repository's own files in place of the hub data sets: chat for SFT recipes, text for pretraining, for DPO
    tiny_llama_dpo's pairs in UltraFeedback binarized's layout (written to `folder`), with 5% held out, and for GRPO
    sums in GSM8K's layout."""
    recipe = load_recipe(name)
    if recipe.training.objective == "grpo":  # GSM8K's layout: `question`, `answer` ending "#### N"
        prompts = folder / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"question": f"What is {a} plus {a + 1}?", "answer": f"#### {2 * a + 1}"})
                                   + "\n" for a in range(8)))
        return [f"data.sources=[{{path: {prompts}, prompt_field: question}}]", "data.seq_len=48", "data.num_proc=1",
                "grpo.num_generations=2", "grpo.max_completion_length=16"]
    if recipe.training.objective == "dpo":
        pairs = folder / "pairs.jsonl"
        pairs.write_text("".join(json.dumps(ultrafeedback_layout(json.loads(line))) + "\n" for line in
                                 (REPO / "recipes/tiny_llama_dpo/pairs.jsonl").read_text().splitlines()))
        return [f"data.sources=[{{path: {pairs}}}]", "data.eval={fraction: 0.05}", "data.seq_len=512",
                "data.num_proc=1"]  # 512: every pair's sequences whole
    if any(source.messages_field for source in recipe.data.sources):
        return ["data.sources=[{path: recipes/tiny_llama_sft/chat.jsonl, messages_field: messages}]",
                "data.seq_len=256", "data.num_proc=1"]  # 256: an assistant reply inside every row
    if recipe.data.phases:  # the corpus under each of the recipe's labels; a step for each phase, each one saved
        labels = [source.key for source in recipe.data.sources]
        return ["data.sources=[" + ", ".join(f"{{path: recipes/tiny_llama/corpus.jsonl, label: {label}}}"
                                             for label in labels) + "]",
                "data.seq_len=64", "data.num_proc=1", "training.decay_ratio=0.5", "checkpointing.every_steps=1",
                "checkpointing.keep_last=2", "checkpointing.average_last=2", "logging.every_steps=1",
                "data.dedup.exact=false"]  # the same documents under each label
    return ["data.sources=[{path: recipes/tiny_llama/corpus.jsonl}]", "data.seq_len=64", "data.num_proc=1"]


def ultrafeedback_layout(pair: dict) -> dict:
    """A conversational pair as HuggingFaceH4/ultrafeedback_binarized holds it: `prompt` the last user turn as a
    string, `chosen` and `rejected` whole conversations, whose shared first messages are the prompt."""
    return {"prompt": pair["prompt"][-1]["content"], "chosen": pair["prompt"] + pair["chosen"],
            "rejected": pair["prompt"] + pair["rejected"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_trains_two_steps_on_cpu(name, tmp_path, data_cache):
    """The recipe as shipped (its packing, streaming, evaluation, ZeRO stage, schedule, tiling), 2 steps in one
    process (under sequence or tensor parallelism 2 ranks, each holding half of every row or matrix): only the
    model size, the data files, the batch and the precision are changed, and flash_attention_2 where this
    machine cannot run it."""
    recipe = load_recipe(name)
    sequence_parallel = min(recipe.parallelism.sequence_parallel, 2)
    tensor_parallel = min(recipe.parallelism.tensor_parallel, 2)
    ranks = max(sequence_parallel, tensor_parallel)
    out = tmp_path / "run"
    # one key at a time, so that the recipe's own overrides (gpt2: no dropout) stay
    shrink = [f"model.config_overrides.{key}={json.dumps(value)}"
              for key, value in small_sizes(model_config(name)).items()]
    steps = ["training.epochs=null"] if recipe.training.epochs else []
    base = "null"
    if recipe.lora.enabled:  # adapters need a checkpoint to adapt: the shrunk model, saved
        base = tmp_path / "base"
        config = model_config(name)
        config.update(small_sizes(config))
        AutoModelForCausalLM.from_config(config).save_pretrained(base)
    result = run_train(["--recipe", name, "--output-dir", str(out), data_cache, *shrink, *local_data(name, tmp_path),
                        f"model.name_or_path={base}", f"tokenizer.name_or_path={TINY_TOKENIZER}", *steps,
                        "training.max_steps=2", "training.micro_batch_size=2", "training.global_batch_size=2",
                        "precision=fp32", f"model.attn_implementation={cpu_attention(name)}",
                        f"parallelism.sequence_parallel={sequence_parallel}",
                        f"parallelism.tensor_parallel={tensor_parallel}"],
                       ranks=ranks if ranks > 1 else None)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and math.isfinite(summary["final_loss"])
    ds_config = json.loads((REPO / "ds_configs" / f"{recipe.deepspeed.config}.json").read_text())
    assert summary["zero_stage"] == ds_config["zero_optimization"]["stage"]
    if recipe.data.eval.fraction or recipe.data.eval.sources:
        assert math.isfinite(summary["eval_loss"])
    if recipe.lora.enabled:
        assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == recipe.lora.rank
        assert (out / "adapter" / "adapter_model.safetensors").is_file() and not recipe.export.merge
        return
    exported = json.loads((out / "hf" / "config.json").read_text())
    assert exported["model_type"] == model_config(name).model_type
    assert {key: exported[key] for key in recipe.model.config_overrides} == recipe.model.config_overrides
    assert (out / "hf" / "model.safetensors").is_file()
    if recipe.data.phases:
        assert [record["phase"] for record in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if "loss" in record] == [phase.name for phase in recipe.data.phases]
        assert (out / "hf_average" / "model.safetensors").is_file()


@pytest.mark.slow
def test_tiny_llama_dpo_trains_two_steps_on_cpu(tmp_path, data_cache):
    """tiny_llama_dpo as shipped (its pairs, evaluation, ZeRO stage, reference pass) for 2 steps, from a small
    checkpoint in place of tiny_llama_sft's export."""
    save_small_checkpoint(tmp_path / "sft")
    out = tmp_path / "run"
    result = run_train(["--recipe", "tiny_llama_dpo", "--output-dir", str(out), data_cache,
                        f"model.name_or_path={tmp_path / 'sft'}", "training.max_steps=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and math.isfinite(summary["final_loss"]) and math.isfinite(summary["eval_loss"])
    assert (out / "reference_logps.npz").is_file() and (out / "hf" / "model.safetensors").is_file()
