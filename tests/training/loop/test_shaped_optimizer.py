"""The memory-lean optimizers inside a one-rank DeepSpeed engine (in-process): what ZeRO hands them is a flat
partition, and they step each weight in its own shape, exactly as the library optimizer on the plain model, with
the states the plan counts; their checkpoints load back; AdamW8bit keeps fp32 moments on embeddings, for the reason
measured here. The 2-rank proofs, where ZeRO splits weights between ranks, are tests/test_optimizers.py's."""
import copy

import deepspeed
import pytest
import torch
from torchao.optim import AdamW8bit
from transformers import AutoConfig, AutoModelForCausalLM

from tests.helpers.optimizer_steps import STEPS, Pieces, start_engine
from training.config.recipe import load_recipe
from training.loop.shaped_optimizer import state_bytes
from training.planning.ds_config import load_ds_config, resolve_ds_config
from training.planning.optimizer_states import rank_shares, rank_state_bytes, share_parts
from training.planning.shape import model_shape

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, use_cache=False)
# ZeRO-3 reduces the gradients through its own hooks, whose float sums differ from autograd's in the last bits:
# measured 3e-8 on the embedding (rows Adam divides by tiny second moments) and, where that flips an 8-bit code
# of AdamW8bit's moments, 3e-7 on one weight (steps of lr = 3e-3)
TOLERANCE = {"zero0": 0.0, "zero2": 0.0, "zero3": 1e-4}  # ZeRO-3 sums the gradients in its own order, and a
# last-bit difference can move an 8-bit state across a quantization step: on an AVX2 CPU (AMD EPYC) one weight in
# thousands lands 1.2e-5 and 3.3e-5 away (under 1e-5 on the machine where it was first measured)


def shaped_engine(name: str, ds_config_name: str) -> tuple[deepspeed.DeepSpeedEngine, torch.nn.Module, object]:
    """A one-rank engine of a tiny Llama with `name` under tiny_llama's resolved `ds_config_name`, a copy of the
    model as it starts, and the recipe."""
    recipe = load_recipe("tiny_llama", [f"optimizer.name={name}", f"deepspeed.config={ds_config_name}",
                                        "precision=fp32", "training.schedule=constant", "training.warmup_steps=0",
                                        "training.grad_clip=0", "training.micro_batch_size=2",
                                        "training.global_batch_size=2"])
    raw, path = load_ds_config(recipe)
    ds_config = resolve_ds_config(raw, path, recipe, CONFIG["hidden_size"], 1, "fp32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG), dtype=torch.float32)
    reference = copy.deepcopy(model)
    return start_engine(model, ds_config, recipe), reference, recipe


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(step))


def client_of(engine: deepspeed.DeepSpeedEngine) -> torch.optim.Optimizer:
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw8bit", "adafactor"])
@pytest.mark.parametrize("ds_config_name", ["zero0", "zero2", "zero3"])
def test_steps_equal_the_library_optimizer_and_the_states_the_plan(one_rank, name, ds_config_name):
    engine, reference, recipe = shaped_engine(name, ds_config_name)
    initial = {name_: weight.detach().clone() for name_, weight in reference.named_parameters()}
    shape, training = model_shape(AutoConfig.for_model("llama", **CONFIG)), recipe.training
    library = Pieces(name, reference, rank_shares(shape.trained_shapes, 0, 1, 0),  # the library on whole weights
                     {"lr": training.lr, "betas": training.betas, "eps": training.eps}, training.weight_decay)
    for step in range(STEPS):
        engine.backward(engine(input_ids=batch(step), labels=batch(step)).loss)
        engine.step()
        reference.zero_grad()
        reference(input_ids=batch(step), labels=batch(step)).loss.backward()
        with torch.no_grad():
            library.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        trained = dict(engine.module.named_parameters())
        for name_, weight in reference.named_parameters():
            assert not torch.equal(weight, initial[name_]), f"{name_} did not move"
            torch.testing.assert_close(trained[name_], weight, rtol=0, atol=TOLERANCE[ds_config_name],
                                       msg=lambda m: f"{name_}: {m}")
    measured = state_bytes(client_of(engine))
    assert measured == rank_state_bytes(name, shape, engine.zero_optimization_stage(), 1)[0]
    assert measured == sum(state_bytes(optimizer) for optimizer in library.optimizers)


def test_adafactor_factors_each_matrix_under_zero():
    """What ZeRO alone would give it, a flat partition, has a whole second moment."""
    matrix = torch.nn.Parameter(torch.zeros(64, 32))
    matrix.grad = torch.ones(64, 32)
    flat = torch.nn.Parameter(torch.zeros(64 * 32))
    flat.grad = torch.ones(64 * 32)
    optimizer = torch.optim.Adafactor([matrix, flat])
    optimizer.step()
    assert state_bytes(optimizer) == 4 * (64 + 32) + 4 * 64 * 32


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw8bit", "adafactor"])
@pytest.mark.parametrize("ds_config_name", ["zero0", "zero2", "zero3"])
def test_a_checkpoint_loads_back_at_every_zero_stage(one_rank, tmp_path, name, ds_config_name):
    """Through DeepSpeed's own save and load (at ZeRO-0 its reader cannot rebuild torchao's 8-bit states as they
    are: training/compat/torch.py plain_optimizer_states): the loaded engine's next step is the saved one's."""
    engine, *_ = shaped_engine(name, ds_config_name)
    engine.backward(engine(input_ids=batch(0), labels=batch(0)).loss)
    engine.step()
    for group in engine.optimizer.param_groups:  # as a schedule leaves it: its own state does not set it again
        group["lr"] /= 3
    engine.save_checkpoint(str(tmp_path), tag="step1")
    loaded, *_ = shaped_engine(name, ds_config_name)
    loaded.load_checkpoint(str(tmp_path), tag="step1", load_lr_scheduler_states=False)
    assert state_bytes(client_of(loaded)) == state_bytes(client_of(engine)) > 0
    assert [g["lr"] for g in loaded.optimizer.param_groups] == [g["lr"] for g in engine.optimizer.param_groups]
    for each in (engine, loaded):
        each.backward(each(input_ids=batch(1), labels=batch(1)).loss)
        each.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()) + list(loaded.module.parameters())):
        for (name_, weight), (_, loaded_weight) in zip(engine.module.named_parameters(),
                                                        loaded.module.named_parameters()):
            assert torch.equal(weight, loaded_weight), name_


@pytest.mark.slow
def test_8bit_moments_move_rarely_seen_embedding_rows_far_beyond_the_rate():
    """Why AdamW8bit keeps fp32 moments on embeddings: in a quantized block beside rows with large gradients, a
    row with small ones keeps a first moment while its second rounds to zero, and moves by up to lr / eps."""
    torch.manual_seed(0)
    start = torch.randn(256, 64) * 0.02
    moved = {}
    for library in (torch.optim.AdamW, AdamW8bit):
        weight = torch.nn.Parameter(start.clone())
        optimizer = library([weight], lr=1e-3, weight_decay=0.0)
        for step in range(3):
            grad = torch.zeros(256, 64)
            grad[torch.randint(0, 256, (60,))] = torch.randn(60, 64) * 1e-2
            grad[torch.randint(0, 256, (3,))] *= 100
            weight.grad = grad
            optimizer.step()
        moved[library] = (weight - start).abs().max().item()
    assert moved[torch.optim.AdamW] <= 1.01 * 3e-3  # Adam moves a weight by about lr per step at most
    assert moved[AdamW8bit] > 100 * moved[torch.optim.AdamW]


@pytest.mark.parametrize("shape, start, numel, expected", [
    ((8, 4), 0, 32, [(0, 32, (8, 4))]),  # whole
    ((8, 4), 8, 16, [(0, 16, (4, 4))]),  # whole rows
    ((8, 4), 6, 16, [(0, 2, (2,)), (2, 12, (3, 4)), (14, 2, (2,))]),  # cut inside rows: its whole rows as rows
    ((8, 4), 5, 2, [(0, 2, (2,))]),  # inside one row
    ((16,), 4, 8, [(0, 8, (8,))]),
    ((2, 3, 4), 12, 12, [(0, 12, (1, 3, 4))]),
])
def test_share_parts(shape, start, numel, expected):
    assert share_parts(shape, start, numel) == expected
    assert sum(length for _, length, _ in expected) == numel
