"""`python -m training average` (training/state/average.py): the element-wise mean of checkpoints' fp32 weights as a
Hugging Face folder, from checkpoints of different layouts (their files as train.py's checkpoints hold them, read as
the export reads them: tests/training/state/test_export.py), and what it refuses."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import save_small_checkpoint
from tests.training.state.test_export import SPLIT_DIM
from training.__main__ import main as training_cli
from training.base.errors import ConfigError
from training.config.recipe import load_recipe


def saved_checkpoint(run: Path, step: int, seed: int, tensor_parallel: int = 1,
                     shape: dict | None = None) -> dict[str, torch.Tensor]:
    """checkpoints/global_step{step}/ with seeded weights, whole (ZeRO-0's module file) or split over
    `tensor_parallel` model-parallel ranks' files as AutoTP splits them; returns the weights."""
    tag = run / "checkpoints" / f"global_step{step}"
    save_small_checkpoint(tag / "hf", shape)
    (tag / "hf" / "model.safetensors").unlink()
    (tag / "run_state.json").write_text(json.dumps({"step": step, "tokens_seen": 64 * step, "world_size": 2,
                                                    "zero_stage": 0, "precision": "fp32",
                                                    "tensor_parallel": tensor_parallel}))
    (run / "checkpoints" / "latest").write_text(tag.name)
    torch.manual_seed(seed)
    weights = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tag / "hf")).state_dict()
    for rank in range(tensor_parallel):
        module = {}
        for name, tensor in weights.items():
            dim = SPLIT_DIM.get(name.split(".")[-2]) if tensor_parallel > 1 else None
            module[name] = tensor if dim is None else tensor.chunk(tensor_parallel, dim)[rank].clone()
        torch.save({"module": module}, tag / f"mp_rank_{rank:02d}_model_states.pt")
    return weights


def test_the_average_is_the_element_wise_mean_of_the_fp32_weights(tmp_path):
    """Three checkpoints, one of them tensor-parallel: each exported weight is their float64 mean rounded to fp32,
    exactly; --last 2 takes the two latest by step."""
    run = tmp_path / "run"
    weights = [saved_checkpoint(run, 2, 1), saved_checkpoint(run, 4, 2, tensor_parallel=2),
               saved_checkpoint(run, 6, 3)]
    tags = [run / "checkpoints" / f"global_step{step}" for step in (2, 4, 6)]
    assert training_cli(["average", *map(str, tags), str(tmp_path / "all")]) == 0
    assert training_cli(["average", str(run / "checkpoints"), "--last", "2", str(tmp_path / "last")]) == 0
    for out, chosen in ((tmp_path / "all", weights), (tmp_path / "last", weights[1:])):
        averaged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        assert averaged.keys() == chosen[0].keys()
        for name, tensor in averaged.items():
            expected = (sum(state[name].double() for state in chosen) / len(chosen)).float()
            assert torch.equal(tensor, expected), name
        assert not torch.equal(averaged["lm_head.weight"], chosen[0]["lm_head.weight"])


@pytest.mark.parametrize("case, message", [
    ("one", "takes two or more checkpoints"),
    ("another model", "holds another model than"),
    ("inside", "OUT_DIR"),
])
def test_what_cannot_be_averaged_is_refused_before_anything_is_written(tmp_path, capsys, case, message):
    run = tmp_path / "run"
    saved_checkpoint(run, 2, 1)
    tags = [run / "checkpoints" / "global_step2"]
    if case == "another model":
        saved_checkpoint(run, 4, 2, shape={"num_hidden_layers": 3})
        tags.append(run / "checkpoints" / "global_step4")
    out = tmp_path / "out"
    if case == "inside":
        saved_checkpoint(run, 4, 2)
        tags.append(run / "checkpoints" / "global_step4")
        out = run / "checkpoints" / "averaged"
    assert training_cli(["average", *map(str, tags), str(out)]) != 0
    assert message in capsys.readouterr().err and not out.exists()


def universal_copy(run: Path, step: int, weights: dict[str, torch.Tensor]) -> Path:
    """checkpoints/universal/global_step{step}/ as ds_to_universal lays it out: each weight's zero/<name>/fp32.pt."""
    from deepspeed.checkpoint.constants import PARAM
    folder = run / "checkpoints" / "universal" / f"global_step{step}"
    for name, tensor in weights.items():
        (folder / "zero" / name).mkdir(parents=True)
        torch.save({PARAM: tensor.clone()}, folder / "zero" / name / "fp32.pt")
    return folder


def test_a_universal_checkpoint_averages_as_the_checkpoint_it_was_converted_from(tmp_path, capsys):
    run = tmp_path / "run"
    saved_checkpoint(run, 2, 1)
    universal = universal_copy(run, 4, saved_checkpoint(run, 4, 2))
    first, second = run / "checkpoints" / "global_step2", run / "checkpoints" / "global_step4"
    assert training_cli(["average", str(first), str(second), str(tmp_path / "plain")]) == 0
    assert training_cli(["average", str(first), str(universal), str(tmp_path / "universal")]) == 0
    plain, mixed = (AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).state_dict()
                    for name in ("plain", "universal"))
    assert all(torch.equal(plain[name], mixed[name]) for name in plain)
    shutil.rmtree(second)
    assert training_cli(["average", str(first), str(universal), str(tmp_path / "gone")]) != 0
    assert "the checkpoint it was converted from, is gone" in capsys.readouterr().err


@pytest.mark.parametrize("recipe, overrides, message", [
    ("tiny_llama", ["checkpointing.average_last=2", "checkpointing.every_steps=null"],
     "set checkpointing.every_steps"),
    ("tiny_llama", ["checkpointing.average_last=3"],
     "checkpointing.keep_last=2 removes checkpoints that checkpointing.average_last=3 averages"),
    ("tiny_llama", ["checkpointing.average_last=5", "checkpointing.every_steps=60", "checkpointing.keep_last=null"],
     "training.max_steps=200 with checkpointing.every_steps=60 saves 4 checkpoints"),
    ("llama3_8b_lora", ["checkpointing.average_last=2", "checkpointing.every_steps=50"],
     "a LoRA run's checkpoints hold adapters"),
    ("tiny_llama", ["checkpointing.average_last=1"], "greater than or equal to 2"),
])
def test_a_run_that_cannot_average_its_last_checkpoints_is_refused_before_it_starts(recipe, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(recipe, overrides)
