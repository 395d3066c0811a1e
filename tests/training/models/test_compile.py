"""training/models/compile.py: where `compile: auto` compiles, and each decoder layer compiled alone, one graph per
layer with no graph break, traced once for every layer and every step (dynamo's eager backend: its tracing and
guards, without generating code)."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from training.config.recipe import load_recipe
from training.models.compile import compile_layers, resolve_compile
from training.models.fused_loss import fuse_head_and_loss


@pytest.mark.parametrize("overrides, zero_stage, for_gpus, chosen", [
    ([], 1, False, False),  # a CPU
    ([], 1, True, True),
    ([], 0, True, True),
    ([], 2, True, True),
    ([], 3, True, False),  # DeepSpeed's parameter hooks would break each layer's graph
    (["parallelism.sequence_parallel=2"], 2, True, False),
    (["parallelism.pipeline_stages=2"], 1, True, False),
    (["parallelism.tensor_parallel=2"], 1, True, False),
    (["compile=true"], 3, False, True),  # as the recipe says
    (["compile=false"], 1, True, False),
])
def test_auto_compiles_on_gpus_with_zero_0_to_2_and_data_parallelism(overrides, zero_stage, for_gpus, chosen):
    assert resolve_compile(load_recipe("tiny_llama", overrides), zero_stage, for_gpus).compile is chosen


def model(checkpointing: bool, lora: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, use_cache=False))
    if checkpointing:
        llama.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    fuse_head_and_loss(llama)
    if lora:
        from peft import LoraConfig, get_peft_model
        llama = get_peft_model(llama, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    return llama.train()


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing, lora", [(False, False), (True, False), (False, True)],
                         ids=["plain", "checkpointing", "lora"])
def test_each_layer_compiles_to_one_graph_traced_once_for_every_layer_and_step(checkpointing, lora):
    from torch._dynamo.testing import CompileCounter

    reference, compiled = model(checkpointing, lora), model(checkpointing, lora)
    counter = CompileCounter()
    torch._dynamo.reset()
    assert compile_layers(compiled, backend=counter, fullgraph=True) == 3  # fullgraph: a graph break is an error
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)  # packed rows of two documents
    for targets in (40.0, 37.0, 41.0):  # a new target count every step, as train.py passes it
        for llama in (reference, compiled):
            llama(input_ids=ids, position_ids=positions, labels=ids, num_items_in_batch=targets).loss.backward()
    # one layer's forward, reused by the 3 layers and 3 steps; under LoRA the first layer's input (from the frozen
    # embedding) needs no gradient, the others' do: a second graph
    assert counter.frame_count == (2 if lora else 1)
    for (name, expected), got in zip(reference.named_parameters(), compiled.parameters()):
        if expected.requires_grad:
            torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-6, msg=name)
