"""training/models/long_context.py: the tiled MLPs and the tiled head and loss compute what the model computes, with
the same gradients, and never hold more than a tile of the wide activations; offloaded checkpoints change
nothing but where the layers' saved inputs are held, and the plan counts them."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from training.config.sections import LongContextSection
from training.models.long_context import apply_long_context
from training.planning.activations import ActivationInputs, activation_bytes
from training.planning.shape import model_shape

HIDDEN, ROWS, SEQ_LEN, TILE = 32, 2, 80, 48


def model_and_batch() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=101, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    labels = torch.randint(0, 101, (ROWS, SEQ_LEN))
    labels[:, :5] = -100  # a prompt without targets
    batch = {"input_ids": torch.randint(0, 101, (ROWS, SEQ_LEN)), "labels": labels,
             "position_ids": torch.arange(SEQ_LEN).repeat(ROWS, 1)}
    return LlamaForCausalLM(config), batch


def rows_seen(module: torch.nn.Module) -> list[int]:
    """The tokens of every call's input, recorded by a hook."""
    seen = []
    module.register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0].shape[:-1].numel()))
    return seen


@pytest.mark.parametrize("section", [LongContextSection(tiled_mlp=True), LongContextSection(logits_tile_tokens=TILE),
                                     LongContextSection(tiled_mlp=True, logits_tile_tokens=TILE)],
                         ids=["mlp", "logits", "both"])
def test_tiles_give_the_models_loss_and_gradients(section):
    model, batch = model_and_batch()
    tiled = copy.deepcopy(model)
    apply_long_context(tiled, section)
    head_calls, mlp_calls = rows_seen(tiled.lm_head), rows_seen(tiled.model.layers[0].mlp.down_proj)
    targets = int((batch["labels"][:, 1:] != -100).sum())
    expected = model(**batch, num_items_in_batch=targets).loss
    loss = tiled(**batch, num_items_in_batch=targets).loss
    expected.backward()
    (loss * 3).backward()  # an incoming gradient other than 1 (accumulation, a loss scale) reaches every tile
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for (name, weight), tiled_weight in zip(model.named_parameters(), tiled.parameters()):
        torch.testing.assert_close(tiled_weight.grad, 3 * weight.grad, rtol=1e-5, atol=1e-6, msg=name)
    if section.logits_tile_tokens:
        assert max(head_calls) <= TILE and len(head_calls) >= 2 * -(-ROWS * SEQ_LEN // TILE)  # forward + recompute
    if section.tiled_mlp:
        assert max(mlp_calls) <= ROWS * HIDDEN < ROWS * SEQ_LEN


def test_without_a_token_count_the_loss_is_the_token_mean():
    model, batch = model_and_batch()
    tiled = copy.deepcopy(model)
    apply_long_context(tiled, LongContextSection(logits_tile_tokens=TILE))
    torch.testing.assert_close(tiled(**batch).loss, model(**batch).loss, rtol=1e-6, atol=1e-6)


def test_offloaded_checkpoints_hold_each_layers_input_in_host_memory(monkeypatch):
    model, batch = model_and_batch()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    offloaded = copy.deepcopy(model)
    apply_long_context(offloaded, LongContextSection(offload_checkpoints=True))
    packed = []

    class RecordingSaveOnCpu(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory: bool) -> None:
            super().__init__(pin_memory=pin_memory)
            pack = self.pack_hook
            self.pack_hook = lambda tensor: (packed.append(tensor), pack(tensor))[1]

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", RecordingSaveOnCpu)
    expected, loss = model(**batch).loss, offloaded(**batch).loss
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    for (name, weight), offloaded_weight in zip(model.named_parameters(), offloaded.parameters()):
        torch.testing.assert_close(offloaded_weight.grad, weight.grad, rtol=0, atol=0, msg=name)
    layers = model.config.num_hidden_layers
    assert [tuple(tensor.shape) for tensor in packed] == [(ROWS, SEQ_LEN, HIDDEN)] * layers  # nothing else
    plan = activation_bytes(model_shape(model.config), ActivationInputs(ROWS * SEQ_LEN, SEQ_LEN, 4, "sdpa",
                                                                   offload_checkpoints=True))
    one_layer_input = ROWS * SEQ_LEN * HIDDEN * 4  # brought back for the layer being recomputed
    assert plan.host + one_layer_input == sum(tensor.nbytes for tensor in packed)
    on_device = activation_bytes(model_shape(model.config), ActivationInputs(ROWS * SEQ_LEN, SEQ_LEN, 4, "sdpa"))
    assert on_device.with_checkpointing - plan.with_checkpointing == plan.host
