"""parallelism.expert_parallel: the checks before anything is built, the DeepSpeed config AutoEP runs with, the
plan's layout line, the way the weights go back under the original model's names, and the router meter's expert
counts (the runs themselves: tests/test_expert_parallel.py)."""
import pytest
import torch
from deepspeed.module_inject.auto_ep import AutoEP
from deepspeed.module_inject.auto_ep_config import parse_autoep_config
from deepspeed.moe.ep_repack import repack_expert_weights
from transformers import AutoConfig, AutoModelForCausalLM

import train
from training.models.moe import router_meter
from training.parallel.expert_parallel import original_weights
from training.planning.ds_config import with_expert_parallel

MIXTRAL = ["--recipe", "mixtral_8x7b", "--dry-run", "--num-gpus", "8", "--gpu-mem", "80"]


@pytest.mark.parametrize("args, message", [
    ([*MIXTRAL, "parallelism.expert_parallel=3", "deepspeed.config=zero2"],
     "the model's 8 experts per layer do not split into 3 equal groups: choose parallelism.expert_parallel from "
     "[2, 4, 8]"),
    ([*MIXTRAL, "parallelism.expert_parallel=8", "deepspeed.config=zero2", "--num-gpus", "4"],
     "4 rank(s) do not form groups of 8"),
    ([*MIXTRAL, "parallelism.expert_parallel=4", "deepspeed.config=zero0"],
     "ZeRO-0: train.py computes ZeRO-0's gradient norm itself"),
    ([*MIXTRAL, "parallelism.expert_parallel=4", "deepspeed.config=zero3"],
     "ZeRO-3: ZeRO-3 with AutoEP is not proven here"),
    ([*MIXTRAL, "parallelism.expert_parallel=4", "deepspeed.config=zero2_offload"],
     "ZeRO-2 with offload: offload with AutoEP is not proven here"),
    ([*MIXTRAL, "parallelism.expert_parallel=4", "deepspeed.config=zero2", "lora.enabled=true"],
     "lora.enabled with parallelism.expert_parallel=4: not built"),
    ([*MIXTRAL, "parallelism.expert_parallel=4", "deepspeed.config=zero2", "parallelism.tensor_parallel=2"],
     "parallelism.tensor_parallel=2: AutoTP does not split 3-D expert weights"),
    (["--recipe", "tiny_llama", "--dry-run", "--num-gpus", "2", "--gpu-mem", "80", "parallelism.expert_parallel=2"],
     "llama is not a mixture of experts that AutoEP splits here"),
])
def test_bad_expert_parallel_settings_exit_2(args, message, no_model_building, capsys):
    assert train.main(args) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_the_plan_shows_each_ranks_experts(no_model_building, capsys):
    assert train.main([*MIXTRAL, "parallelism.expert_parallel=4", "deepspeed.config=zero2"]) == 0
    assert ("experts: 4 expert-parallel x 2 expert-data-parallel (2 of each layer's 8 experts per rank)"
            in " ".join(capsys.readouterr().out.split()))


def test_the_deepspeed_config_turns_on_autoep_with_the_models_preset():
    config = AutoConfig.for_model("qwen3_moe")
    assert with_expert_parallel({"a": 1}, 1, config) == {"a": 1}
    section = with_expert_parallel({"a": 1}, 4, config)["expert_parallel"]
    assert section["enabled"] and section["autoep_size"] == 4 and section["preset_model"] == "qwen3_moe"


def small_mixtral(**overrides) -> torch.nn.Module:
    config = AutoConfig.for_model("mixtral", vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=4,
                                  num_experts_per_tok=2, **overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_the_weights_go_back_under_the_original_names_as_autoep_took_them():
    """DeepSpeed's own repacking of each rank's experts (2 ranks), saved as AutoEP's checkpoint names them (the
    module's weights with the router and its alias, one file per expert), comes back as the model's state dict."""
    model = small_mixtral()
    original = model.state_dict()
    specs = AutoEP(model, parse_autoep_config({"enabled": True, "autoep_size": 2,
                                               "preset_model": "mixtral"})).ep_parser()
    module = {name: t for name, t in original.items() if ".mlp." not in name}
    files = []
    for spec in specs:
        block = model.get_submodule(spec.moe_module_name)
        prefix = spec.moe_module_name
        module[f"{prefix}.router.gate.weight"] = module[f"{prefix}.gate.gate.weight"] = block.gate.weight
        for rank in range(2):
            local = dict(zip(("w1", "w2", "w3"), repack_expert_weights(block.experts, spec, rank, 2)))
            files += [{f"{prefix}.experts.{w}.{2 * rank + e}": local[w][e] for w in local} for e in range(2)]
    weights = original_weights(module, files)
    assert weights.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(weights[name], tensor), name


def test_the_router_meter_counts_each_micro_batch_once(one_rank):
    """With activation checkpointing the routers run again in the backward pass: the meter counts the forward's."""
    model = small_mixtral(output_router_logits=True, router_aux_loss_coef=0.02)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    meter = router_meter(model, micro_batches=2)
    for _ in range(2):
        model(input_ids=torch.randint(0, 64, (3, 10)), labels=torch.randint(0, 64, (3, 10))).loss.backward()
    metrics = meter.metrics()
    assert [sum(layer) for layer in metrics["expert_tokens"]] == [2 * 3 * 10 * 2] * 2  # micro x rows x tokens x top-2
    assert metrics["aux_loss"] > 0 and metrics["expert_load_max"] >= 1
    assert meter.metrics()["expert_tokens"] == [[0] * 4] * 2  # counted since the last call


def test_an_expert_parallel_checkpoint_resumes_with_expert_parallelism_of_any_degree():
    from training.base.errors import ConfigError
    from training.planning.layout import Layout
    from training.state.universal import needs_universal
    wrote = Layout(world_size=2, zero_stage=1, precision="fp32", expert_parallel=2)
    assert needs_universal(wrote, wrote, False, "export") is False
    for change in ({"world_size": 4, "zero_stage": 2}, {"world_size": 4, "expert_parallel": 4}):
        assert needs_universal(wrote, wrote.model_copy(update=change), False, "export") is True
    with pytest.raises(ConfigError, match="expert_parallel 2 -> 1.*: an expert-parallel checkpoint keeps"):
        needs_universal(wrote, wrote.model_copy(update={"expert_parallel": 1}), False, "export")
    with pytest.raises(ConfigError, match="expert_parallel 1 -> 2.*: this checkpoint was written without expert "
                                          "parallelism.*resume with parallelism.expert_parallel=1"):
        needs_universal(wrote.model_copy(update={"expert_parallel": 1}), wrote, False, "export")
