"""The memory plan under expert parallelism (training/planning/model_states.py, activations.py): a rank's share of the
experts' model states, and the activations of AutoEP's layers."""
from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.training.planning.test_memory import CONFIGS, saved_activation_bytes
from training.planning.activations import ActivationInputs, activation_bytes
from training.planning.model_states import expert_parallel_states, model_states, zero_arithmetic
from training.planning.shape import model_shape


def shape_of(model_type: str, layers: int = 3):
    return model_shape(AutoConfig.for_model(model_type, **CONFIGS[model_type], num_hidden_layers=layers))


@pytest.mark.parametrize("setting", ["1", "2"])
def test_a_ranks_expert_states_shrink_by_the_expert_parallel_size(setting):
    shape = shape_of("mixtral")  # 6 experts
    dense, experts = shape.parameters - shape.expert_parameters, shape.expert_parameters

    def states(parameters: int, ranks: int) -> float:
        return model_states(setting, replace(shape, parameters=parameters), ranks, 1, "bf16",
                            zero_init=False).device_bytes

    # one rank per expert group (6 ranks, expert_parallel=6): a rank's expert states are 1/6 of all experts' states
    split = expert_parallel_states(setting, shape, 6, 1, 6, "bf16").device_bytes
    assert split - states(dense, 6) == pytest.approx(states(experts, 1) / 6)
    # 12 ranks, expert_parallel=3: 2 of 6 experts per rank, sharded over the 4 ranks that hold the same two
    split = expert_parallel_states(setting, shape, 12, 1, 3, "bf16").device_bytes
    assert split == pytest.approx(states(dense, 12) + states(experts // 3, 4))
    assert split < model_states(setting, shape, 12, 1, "bf16", zero_init=False).device_bytes


def test_the_expert_parallel_arithmetic_in_numbers():
    """ZeRO-1 in bf16 with AdamW: weights and gradients whole (4 bytes), fp32 master weights, moments and gradient
    partition sharded (16)."""
    shape = shape_of("qwen3_moe")
    dense, experts = shape.parameters - shape.expert_parameters, shape.expert_parameters
    states = expert_parallel_states("1", shape, 8, 2, 4, "bf16")
    assert states.device_bytes == pytest.approx(dense * (4 + 16 / 16) + experts / 4 * (4 + 16 / 4))
    assert states.device_bytes == pytest.approx(zero_arithmetic(dense, 1, 16, "bf16")
                                                + zero_arithmetic(experts / 4, 1, 4, "bf16"))
    with pytest.raises(ValueError, match="no estimate for ZeRO-3 with expert parallelism"):
        expert_parallel_states("3", shape, 8, 1, 4, "bf16")


def test_expert_parallelism_adds_one_layers_all_to_all_buffers():
    shape, tokens, a = shape_of("qwen3_moe"), 2 * 96, 2
    whole = activation_bytes(shape, ActivationInputs(tokens, 96, a, "sdpa"))
    split = activation_bytes(shape, ActivationInputs(tokens, 96, a, "sdpa", expert_parallel=4))
    buffers = tokens * 2 * shape.experts_per_token * a * shape.hidden_size  # sent and received, one layer's
    assert split.without_checkpointing - whole.without_checkpointing == buffers
    assert split.with_checkpointing - whole.with_checkpointing == buffers
    dense = shape_of("llama")
    assert activation_bytes(dense, ActivationInputs(tokens, 96, a, "sdpa", expert_parallel=4)) == \
        activation_bytes(dense, ActivationInputs(tokens, 96, a, "sdpa"))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_autoeps_layers_save_what_the_moe_rule_counts(model_type):
    """AutoEP's MoE layer (one process: expert_parallel=1, no all-to-all) saves for the backward pass what the MoE rule
    counts of transformers' block: the experts' gathered input, their intermediate-wide tensors and the combined
    outputs. Its all-to-alls (_AllToAllV) save nothing, so the rule holds under expert parallelism. 2,048 tokens: AutoEP
    pads each expert's rows to a multiple of 8, a few % of a few hundred tokens' activations."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    from training.compat.deepspeed.autoep import autoep_output_recorders
    rows, seq_len = 4, 512
    config = AutoConfig.for_model(model_type, **CONFIGS[model_type], num_hidden_layers=3)
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).train()
    autoep = AutoEP(model, parse_autoep_config({"enabled": True, "autoep_size": 1, "preset_model": model_type,
                                                "use_grouped_mm": False}))
    with autoep_output_recorders():
        autoep.replace_moe_layers(autoep.ep_parser(), ep_size=1, ep_rank=0)
    model.to(torch.bfloat16)  # AutoEP's new router and experts
    input_ids = torch.randint(0, config.vocab_size, (rows, seq_len))
    position_ids = torch.cat([torch.arange(40), torch.arange(seq_len - 40)]).repeat(rows, 1)  # two documents
    measured = saved_activation_bytes(model, input_ids, position_ids)
    shape, tokens = model_shape(config), rows * seq_len
    estimate = activation_bytes(shape, ActivationInputs(tokens, seq_len, 2, "sdpa")).without_checkpointing
    logits_transient = tokens * 6 * shape.vocab_size
    assert estimate - logits_transient == pytest.approx(measured, rel=0.005)
