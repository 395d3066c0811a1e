import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from training.base.errors import ConfigError
from training.config.recipe import load_recipe
from training.models.model import (
    build_model,
    cast_lm_head_to_fp32,
    check_recipe_against_model,
    disable_dropout,
    load_model_config,
)


def test_config_overrides_shrink_the_model():
    recipe = load_recipe("tiny_llama", ["model.config_overrides={num_hidden_layers: 2, hidden_size: 64}"])
    config = load_model_config(recipe.model)
    assert (config.num_hidden_layers, config.hidden_size, config.use_cache) == (2, 64, False)


def test_config_overrides_rederive_per_layer_values():
    recipe = load_recipe("qwen2_5_1_5b", ["model.config_overrides={num_hidden_layers: 3}"])
    config = load_model_config(recipe.model)
    assert config.num_hidden_layers == 3 and config.layer_types == ["full_attention"] * 3


def test_unknown_config_override_is_an_error():
    recipe = load_recipe("tiny_llama", ["model.config_overrides={num_layers: 2}"])
    with pytest.raises(ConfigError, match="model.config_overrides: num_layers not in LlamaConfig"):
        load_model_config(recipe.model)


def test_seq_len_longer_than_the_model_positions():
    recipe = load_recipe("tiny_llama", ["data.seq_len=2048"])
    with pytest.raises(ConfigError, match="data.seq_len=2048 is longer than the model's max_position_embeddings=1024"):
        check_recipe_against_model(recipe, load_model_config(recipe.model), vocab_size=4096)


def test_tokenizer_larger_than_the_model_vocabulary():
    recipe = load_recipe("tiny_llama", ["model.config_overrides={vocab_size: 1000}"])
    with pytest.raises(ConfigError, match="has 4096 tokens but the model's vocab_size is 1000"):
        check_recipe_against_model(recipe, load_model_config(recipe.model), vocab_size=4096)


def test_unreadable_model_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    recipe = load_recipe("tiny_llama", [f"model.config={tmp_path / 'config.json'}"])
    with pytest.raises(ConfigError, match=f"cannot read a model config from {tmp_path / 'config.json'}"):
        load_model_config(recipe.model)


def test_zero3_builds_the_checkpoint_partitioned(tmp_path, one_rank):
    """Under ZeRO-3 the parameters are partitioned as they are created (zero.Init): the module holds
    empty tensors, each rank only its shard, and the shards hold the checkpoint's weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    recipe = load_recipe("tiny_llama", ["model.config=null", f"model.name_or_path={tmp_path}"])
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    model = build_model(recipe, load_model_config(recipe.model), ds_config, "bf16")
    saved = load_file(tmp_path / "model.safetensors")
    for name, param in model.named_parameters():
        assert param.numel() == 0 and param.ds_numel == saved[name].numel() and param.ds_tensor.dtype == torch.bfloat16
        torch.testing.assert_close(param.ds_tensor.view(saved[name].shape).float(), saved[name].bfloat16().float())


@pytest.mark.parametrize("precision, stage, dtype", [("bf16", 2, torch.bfloat16), ("bf16", 0, torch.float32),
                                                     ("fp32", 3, torch.float32), ("fp16", 1, torch.float16)])
def test_checkpoints_load_in_the_runs_precision(precision, stage, dtype, one_rank, tmp_path):
    """An fp32 checkpoint loads as the run keeps its weights: 16-bit under ZeRO (DeepSpeed keeps the fp32 master
    copy), fp32 at ZeRO-0, where bf16 and fp16 run as autocast over fp32 weights; the values are the
    checkpoint's, cast. (ZeRO-3 holds each parameter's values in its partition; gathered, they are the whole
    tensor.)"""
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    recipe = load_recipe("tiny_llama", ["model.config=null", f"model.name_or_path={tmp_path}"])
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
    model = build_model(recipe, load_model_config(recipe.model), ds_config, precision)
    saved = load_file(tmp_path / "model.safetensors")
    assert {value.dtype for value in saved.values()} == {torch.float32}
    parameters = dict(model.named_parameters())
    assert parameters.keys() == saved.keys()
    if stage == 3:  # built partitioned (zero.Init): each module holds an empty placeholder until gathered
        assert all(param.numel() == 0 for param in parameters.values())
    with deepspeed.zero.GatheredParameters(list(parameters.values()), enabled=stage == 3):
        for name, param in parameters.items():
            assert param.dtype == dtype and param.shape == saved[name].shape
            torch.testing.assert_close(param.detach(), saved[name].to(dtype), rtol=0, atol=0)


def test_disable_dropout_turns_off_the_modules_and_the_attentions_dropout_but_not_loras():
    """GPT-2's dropout is nn.Dropout modules (TRL's disable_dropout turns these off); Llama's attention reads a float
    off its attention module, which TRL leaves on. After disable_dropout two forward passes in training mode give
    the evaluation mode's logits; LoRA's adapter dropout keeps its rate."""
    from peft import LoraConfig, get_peft_model

    gpt2 = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=128)
    llama = AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                 num_attention_heads=2, num_key_value_heads=2, vocab_size=128, attention_dropout=0.5)
    input_ids = torch.randint(0, 128, (2, 12))
    # GPT-2: the embeddings' dropout, and each layer's attention's, its output's and its MLP's; Llama: each layer's
    for config, dropouts in ((gpt2, 1 + 2 * 3), (llama, 2)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
        assert not torch.equal(model(input_ids).logits, model(input_ids).logits)
        assert disable_dropout(model) == dropouts and disable_dropout(model) == 0
        logits = model(input_ids).logits
        assert torch.equal(logits, model(input_ids).logits)
        torch.testing.assert_close(logits, model.eval()(input_ids).logits)
    adapted = get_peft_model(AutoModelForCausalLM.from_config(llama), LoraConfig(r=4, lora_dropout=0.1,
                                                                               target_modules=["q_proj"]))
    assert disable_dropout(adapted) == 2
    assert {module.p for name, module in adapted.named_modules()
            if isinstance(module, torch.nn.Dropout) and "lora_dropout" in name} == {0.1}


def bf16_llama(tie: bool) -> torch.nn.Module:
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                  tie_word_embeddings=tie)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


@pytest.mark.parametrize("tie", [False, True])
def test_cast_lm_head_to_fp32_gives_fp32_logits_from_the_bf16_weights(tie):
    """The head's logits in fp32 (what GRPO's log-probabilities are taken from): equal to the fp32 product of the bf16
    hidden states and weight, where bf16 logits are rounded to 8 bits of mantissa; the weights, their names and
    their tying unchanged, and the gradient reaching the bf16 weight."""
    model = bf16_llama(tie)
    ids = torch.randint(0, 1000, (2, 12))
    hidden = model.model(input_ids=ids).last_hidden_state
    exact = hidden.double() @ model.lm_head.weight.double().T
    rounded = model(input_ids=ids).logits
    names = list(model.state_dict())
    cast_lm_head_to_fp32(model)
    logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float32 and rounded.dtype == torch.bfloat16
    torch.testing.assert_close(logits, hidden.float() @ model.lm_head.weight.float().T)
    assert (logits.double() - exact).abs().max() < 1e-5 < (rounded.double() - exact).abs().max()
    assert list(model.state_dict()) == names and model.lm_head.weight.dtype == torch.bfloat16
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    logits.logsumexp(-1).sum().backward()
    assert model.lm_head.weight.grad.dtype == torch.bfloat16 and model.lm_head.weight.grad.abs().sum() > 0


def test_cast_lm_head_to_fp32_leaves_zero_0s_autocast_and_follows_a_copy():
    """ZeRO-0's bf16 is autocast over fp32 weights, which would run the head in bf16; and a deep copy of the model
    (a frozen reference) computes with its own weight."""
    import copy
    model = bf16_llama(tie=False).float()
    ids = torch.randint(0, 1000, (1, 8))
    cast_lm_head_to_fp32(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(input_ids=ids).logits.dtype == torch.float32
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.zero_()
    assert twin(input_ids=ids).logits.abs().max() == 0 < model(input_ids=ids).logits.abs().max()


def test_cast_lm_head_to_fp32_refuses_a_head_another_module_replaced():
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(bf16_llama(tie=False), LoraConfig(target_modules=["lm_head"]))
    with pytest.raises(ConfigError, match=r"output layer is a peft\.tuners\.lora\.layer\.Linear, not a plain"):
        cast_lm_head_to_fp32(model)
