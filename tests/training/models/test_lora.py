"""LoRA's checks and plan (training/models/lora.py, training/planning/model_states.py): in process, no training."""
import pytest
import torch
from peft import get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

import train
from tests.conftest import REPO, save_small_checkpoint
from training.base.errors import ConfigError
from training.config.recipe import load_recipe
from training.planning.layout import Layout
from training.planning.model_states import lora_model_states
from training.planning.shape import lora_config, model_shape
from training.state.universal import needs_universal


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    save_small_checkpoint(path)
    return path


def plan(base, *overrides, num_gpus: int | None = None):
    args = ["--recipe", "tiny_llama_sft", f"model.name_or_path={base}", "--dry-run", *overrides]
    return train.make_plan(train.parse_args(args + (["--num-gpus", str(num_gpus)] if num_gpus else [])))


@pytest.mark.slow
def test_llama2_7b_adapter_count_is_peft_s():
    """Llama-2-7B with rank-16 adapters on every linear layer: peft's own count, 39,976,960 trainable parameters."""
    recipe = load_recipe("llama2_7b", ["lora.enabled=true", "model.name_or_path=meta-llama/Llama-2-7b-hf"])
    shape = model_shape(AutoConfig.from_pretrained("recipes/llama2_7b/config.json"), recipe.lora)
    assert shape.lora_parameters == 39_976_960
    assert shape.parameters == 6_738_415_616


def test_the_meta_count_is_the_real_model_s(base):
    recipe = load_recipe("tiny_llama_sft", [f"model.name_or_path={base}", "lora.enabled=true", "lora.rank=8",
                                            "lora.target_modules=[q_proj,v_proj]", "lora.modules_to_save=[lm_head]"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora_config(recipe.lora))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert model_shape(model.get_base_model().config, recipe.lora).lora_parameters == trained
    assert trained == 2 * (8 * (64 + 64) + 8 * (64 + 32)) + 4096 * 64  # 2 layers' q_proj, v_proj (2 x 16 wide); lm_head


def test_model_states_count_frozen_weights_without_gradients_or_optimizer_states():
    shape = model_shape(AutoConfig.from_pretrained("recipes/llama2_7b/config.json"))
    n, lora = shape.parameters, 40_000_000
    bf16_zero2 = lora_model_states("2", shape, lora, 8, 1, "bf16")
    assert bf16_zero2.device_bytes == pytest.approx(2 * n + 2 * lora + (2 + 16) * lora / 8)
    bf16_zero3 = lora_model_states("3", shape, lora, 8, 1, "bf16")
    assert bf16_zero3.device_bytes == pytest.approx((2 * n + 20 * lora) / 8)
    offload = lora_model_states("3_offload", shape, lora, 8, 2, "bf16")
    assert offload.device_bytes == pytest.approx((2 * n + 4 * lora) / 16)
    assert offload.host_bytes == pytest.approx(16 * lora / 16 * 8)
    assert lora_model_states("0", shape, lora, 8, 1, "bf16").device_bytes == pytest.approx(4 * n + 16 * lora)


def test_the_plan_prints_the_adapters_and_their_smaller_checkpoint(base, capsys):
    train.main(["--recipe", "tiny_llama_sft", f"model.name_or_path={base}", "lora.enabled=true", "--dry-run"])
    out = capsys.readouterr().out
    assert "LoRA: rank 16, alpha 32, on all-linear: 32,768 trainable parameters" in out
    assert "ZeRO arithmetic (LoRA)" in out and "4N + 6N_LoRA" in out


@pytest.mark.parametrize("overrides, message", [
    (["lora.rank=8"], "lora.rank is set but lora.enabled is false"),
    (["export.merge=true"], "export.merge merges LoRA adapters"),
    (["lora.enabled=true", "lora.target_modules=[qkv_proj]"], "Module names of this model: "),
    (["lora.enabled=true", "lora.target_modules=(q_proj"], "'(q_proj' is not a valid regular expression"),
    (["lora.enabled=true", "lora.modules_to_save=[lm_haed]"], "no module of this model is named 'lm_haed'"),
    (["lora.enabled=true", "optimizer.name=muon", "training.grad_clip=0"], "optimizer.name=muon"),
    (["lora.enabled=true", "parallelism.pipeline_stages=2", "deepspeed.config=zero1"], "pipeline_stages=2"),
])
def test_bad_lora_settings_are_refused_before_anything_is_built(base, overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        plan(base, *overrides, num_gpus=2)


def test_lora_needs_a_checkpoint_to_adapt():
    with pytest.raises(ConfigError, match="set model.name_or_path to the checkpoint to adapt"):
        load_recipe("tiny_llama", ["lora.enabled=true"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a CUDA GPU")
def test_qlora_is_refused_without_a_cuda_gpu_and_planned_for_one(base):
    qlora = ["lora.enabled=true", "lora.quantize=nf4", "precision=bf16"]
    with pytest.raises(ConfigError, match="lora.quantize=nf4 .* need a CUDA GPU"):
        plan(base, *qlora)
    assert plan(base, *qlora, num_gpus=1).recipe.lora.quantize == "nf4"
    with pytest.raises(ConfigError, match="set precision=bf16"):
        plan(base, *qlora[:2], "precision=fp32", num_gpus=1)


def test_a_lora_checkpoint_resumes_only_as_lora_in_its_own_layout():
    wrote = Layout(world_size=2, zero_stage=3, precision="fp32", lora=True)
    assert needs_universal(wrote, wrote, False, "export") is False
    with pytest.raises(ConfigError, match="resume with lora.enabled=true"):
        needs_universal(wrote, wrote.model_copy(update={"lora": False}), False, "export")
    with pytest.raises(ConfigError, match="resumes in the layout that wrote it"):
        needs_universal(wrote, wrote.model_copy(update={"world_size": 4}), False, "export")


def test_adapters_on_a_checkpointed_model_warn_nothing_on_every_rank():
    """peft reads a name transformers 5 deprecated: each rank would print a FutureWarning for nothing (compat
    quiet_gradient_checkpointing_warning, which importing training/models/lora.py installs for the process; pytest
    resets the filters around each test, so it is installed again here)."""
    import warnings

    from training.compat.peft import quiet_gradient_checkpointing_warning
    from training.config.sections import LoraSection
    from training.models.lora import with_lora
    config = AutoConfig.from_pretrained(REPO / "recipes/tiny_llama/config.json", num_hidden_layers=1, hidden_size=32,
                                        intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = AutoModelForCausalLM.from_config(config)
    model.activation_checkpointing_enable()
    with warnings.catch_warnings(record=True) as caught:
        quiet_gradient_checkpointing_warning()
        with_lora(model, LoraSection(enabled=True), seed=0)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)], [str(w.message) for w in caught]
