"""parallelism.sequence_parallel: the checks before anything is built, the plan's layout and activations per
rank, and each rank's slice of a row (the runs themselves: tests/test_parallelism.py)."""
import re

import pytest
import torch

import train
from data_pipeline.loader import model_inputs
from training.planning.activations import ActivationInputs, activation_bytes
from training.planning.shape import model_shape


@pytest.mark.parametrize("overrides, gpus, message", [
    (["parallelism.sequence_parallel=3"], 3, "the model's 8 attention heads do not divide into 3 groups"),
    (["parallelism.sequence_parallel=4", "model.config_overrides={num_attention_heads: 12, num_key_value_heads: 6}"],
     4, "the model's 6 key/value heads neither divide into 4 groups nor into 4 copies"),
    (["parallelism.sequence_parallel=2", "data.seq_len=255"], 2, "data.seq_len=255 does not split into 2 equal slices"),
    (["parallelism.sequence_parallel=4"], 2, "2 rank(s) do not form groups of 4"),
    (["parallelism.sequence_parallel=2", "parallelism.pipeline_stages=2"], 4,
     "DeepSpeed's pipeline engine cannot run Ulysses attention"),
    (["parallelism.sequence_parallel=2", "model.attn_implementation=eager"], 2,
     "model.attn_implementation=eager: Ulysses runs sdpa, flash_attention_2 or flex_attention"),
    (["parallelism.sequence_parallel=2", "precision=bf16", "deepspeed.config=zero1"], 2,
     "precision=bf16 with ZeRO-1: DeepSpeed's BF16_Optimizer takes the sequence-parallel group"),
])
def test_bad_sequence_parallel_settings_exit_2(overrides, gpus, message, no_model_building, capsys):
    args = ["--recipe", "tiny_llama", "--dry-run", "--num-gpus", str(gpus), "--gpu-mem", "80", *overrides]
    assert train.main(args) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_key_value_heads_fewer_than_the_ranks_are_copied(no_model_building, capsys):
    """tiny_llama has 4 key/value heads: under SP=8 DeepSpeed gives each rank a copy of one; its 8 query heads
    split 8 ways."""
    args = ["--recipe", "tiny_llama", "--dry-run", "--num-gpus", "8", "--gpu-mem", "80", "model.config_overrides="
            "{num_attention_heads: 8, num_key_value_heads: 2, head_dim: 32}", "parallelism.sequence_parallel=8",
            "training.global_batch_size=8", "deepspeed.config=zero2"]
    assert train.main(args) == 0


def test_the_plan_shows_the_layout_and_a_ranks_slice(no_model_building, capsys):
    args = ["--recipe", "tiny_llama", "--dry-run", "--num-gpus", "4", "--gpu-mem", "80",
            "parallelism.sequence_parallel=2", "deepspeed.config=zero3"]
    assert train.main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "layout: 4 rank(s) = 2 data-parallel x 1 tensor-parallel x 2 sequence-parallel x 1 pipeline stage(s)" in out
    assert "8 rows/rank x 1 accumulation x 2 data-parallel ranks = 16 rows" in out
    assert "each row split over 2 ranks, 128 tokens each" in out
    assert "micro-batch 8 x 128 tokens on each rank" in out
    assert re.search(r"activations: \S+ MiB without checkpointing", out)


def test_activations_per_rank_shrink_with_the_slice_but_not_the_sdpa_mask():
    from training.config.recipe import load_recipe
    from training.models.model import load_model_config
    shape = model_shape(load_model_config(load_recipe("tiny_llama", []).model))
    whole = activation_bytes(shape, ActivationInputs(8 * 4096, 4096, 2, "flash_attention_2"))
    split = activation_bytes(shape, ActivationInputs(8 * 4096 // 4, 4096, 2, "flash_attention_2", sequence_parallel=4))
    assert split.without_checkpointing == pytest.approx(whole.without_checkpointing / 4)
    sdpa_whole = activation_bytes(shape, ActivationInputs(8 * 4096, 4096, 2, "sdpa"))
    sdpa_split = activation_bytes(shape, ActivationInputs(8 * 4096 // 4, 4096, 2, "sdpa", sequence_parallel=4))
    masks = 8 * 4096 * 4096 * 2 * shape.num_layers  # [seq, seq] per row and layer, on every rank of the group
    assert sdpa_split.without_checkpointing - split.without_checkpointing == pytest.approx(masks)
    assert sdpa_whole.without_checkpointing - whole.without_checkpointing == pytest.approx(masks)


def test_a_rows_slices_hold_its_tokens_and_the_shifted_labels():
    batch = {"input_ids": torch.arange(16).view(2, 8), "position_ids": torch.arange(8).repeat(2, 1),
             "labels": torch.arange(100, 116).view(2, 8)}
    slices = [model_inputs(batch, torch.device("cpu"), (index, 2)) for index in range(2)]
    assert torch.equal(torch.cat([s["input_ids"] for s in slices], dim=1), batch["input_ids"])
    assert torch.equal(torch.cat([s["position_ids"] for s in slices], dim=1), batch["position_ids"])
    labels = torch.cat([s["shift_labels"] for s in slices], dim=1)
    assert torch.equal(labels[:, :-1], batch["labels"][:, 1:])  # token t is scored on label t + 1 ...
    assert torch.all(labels[:, -1] == -100)  # ... and the last token on nothing
    assert all(s["labels"] is s["shift_labels"] for s in slices)
    assert model_inputs(batch, torch.device("cpu")).keys() == {"input_ids", "labels", "position_ids"}
