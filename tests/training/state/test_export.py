"""`python -m training export` of layouts other than plain data parallelism, on checkpoint folders laid out as
DeepSpeed 0.19.8 writes them (built here from a small model's weights, so that no test trains): a pipeline's
layer files and tensor-parallel ranks' slices give the model's weights back, and a missing or truncated file is
named as a damaged checkpoint (exit 2), with nothing written. One slow test exports a real bf16 tensor-parallel
ZeRO-3 run; tests/test_parallelism.py exports the fp32 tensor- and sequence-parallel runs it trains."""
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import SMALL_MODEL, run_train, save_small_checkpoint
from training.__main__ import main as training_cli
from training.parallel.pipeline import hf_name

# Which dimension of each weight AutoTP splits (DeepSpeed's row and column parallel layers) and which it keeps whole.
SPLIT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "lm_head": 0, "o_proj": 1,
             "down_proj": 1}


def checkpoint_folder(tmp_path: Path, run_state: dict) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tag folder as train.py leaves it (run state, hf/ with config and tokenizer), without DeepSpeed's files; and
    the small model's weights that those files are to hold."""
    tag = tmp_path / "checkpoints" / "global_step2"
    save_small_checkpoint(tag / "hf")
    (tag / "hf" / "model.safetensors").unlink()  # the export reads the weights from DeepSpeed's files alone
    (tag / "run_state.json").write_text(json.dumps({"step": 2, "tokens_seen": 64, "world_size": 2, "zero_stage": 1,
                                                    "precision": "fp32", **run_state}))
    (tmp_path / "checkpoints" / "latest").write_text("global_step2")
    torch.manual_seed(0)
    weights = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tag / "hf")).state_dict()
    return tag, weights


@pytest.fixture
def pipeline_checkpoint(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Two stages' layer files, layer_NN-model_states.pt: each pipeline layer's module state dict."""
    tag, weights = checkpoint_folder(tmp_path, {"pipeline_stages": 2})
    config = AutoConfig.from_pretrained(tag / "hf")
    for layer in range(config.num_hidden_layers + 3):  # embedding, decoder layers, norm, untied LM head
        prefix = hf_name(layer, "", config)
        torch.save({name.removeprefix(prefix): tensor for name, tensor in weights.items() if name.startswith(prefix)},
                   tag / f"layer_{layer:02d}-model_states.pt")
    return tag, weights


@pytest.fixture
def tensor_parallel_checkpoint(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Two tensor-parallel ranks' module weights, mp_rank_NN_model_states.pt (as without ZeRO partitions): each
    split weight's half, the other weights whole."""
    tag, weights = checkpoint_folder(tmp_path, {"tensor_parallel": 2})
    for rank in range(2):
        module = {}
        for name, tensor in weights.items():
            dim = SPLIT_DIM.get(name.split(".")[-2])
            module[name] = tensor if dim is None else tensor.chunk(2, dim)[rank].clone()
        torch.save({"module": module}, tag / f"mp_rank_{rank:02d}_model_states.pt")
    return tag, weights


def export(tag: Path, out: Path) -> int:
    return training_cli(["export", str(tag.parent), str(out)])


def assert_exported(out: Path, weights: dict[str, torch.Tensor]) -> None:
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert exported.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("layout", ["pipeline_checkpoint", "tensor_parallel_checkpoint"])
def test_the_export_gives_the_weights_back(layout, request, tmp_path):
    tag, weights = request.getfixturevalue(layout)
    assert export(tag, tmp_path / "out") == 0
    assert_exported(tmp_path / "out", weights)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:1000])


@pytest.mark.parametrize("layout, damage, message", [
    ("pipeline_checkpoint", lambda tag: (tag / "layer_02-model_states.pt").unlink(),
     "layer_02-model_states.pt is missing: the checkpoint {tag} is damaged or partial"),
    ("pipeline_checkpoint", lambda tag: truncate(tag / "layer_03-model_states.pt"),
     "layer_03-model_states.pt cannot be read (PytorchStreamReader failed"),
    ("tensor_parallel_checkpoint", lambda tag: (tag / "mp_rank_01_model_states.pt").unlink(),
     "mp_rank_01_model_states.pt is missing: the checkpoint {tag} is damaged or partial"),
    ("tensor_parallel_checkpoint", lambda tag: truncate(tag / "mp_rank_00_model_states.pt"),
     "mp_rank_00_model_states.pt cannot be read"),
], ids=["pipeline layer missing", "pipeline layer truncated", "tensor-parallel rank missing",
        "tensor-parallel rank truncated"])
def test_a_damaged_checkpoint_names_its_file(layout, damage, message, request, tmp_path, tree_guard, capsys):
    tag, _ = request.getfixturevalue(layout)
    damage(tag)
    with tree_guard():
        assert export(tag, tmp_path / "out") == 2
    error = " ".join(capsys.readouterr().err.split())
    assert message.format(tag=tag) in error and "export another checkpoint" in error
    assert "Traceback" not in error and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_bf16_tensor_parallel_zero3_checkpoint_exports_its_fp32_master_weights(tmp_path, data_cache):
    """bf16 runs name their ZeRO files bf16_zero_pp_rank_*: at ZeRO-3 they are the only copy of the weights. The
    export in bf16 is the engine's hf/; with --dtype fp32 it is the fp32 master weights, which round to it."""
    run = tmp_path / "run"
    result = run_train(["--recipe", "tiny_llama", "--output-dir", str(run), SMALL_MODEL, data_cache, "precision=bf16",
                        "deepspeed.config=zero3", "parallelism.tensor_parallel=2", "training.max_steps=1",
                        "training.warmup_steps=0"], ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert any((run / "checkpoints" / "global_step1").glob("bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"))
    trained = AutoModelForCausalLM.from_pretrained(run / "hf").state_dict()
    assert export(run / "checkpoints" / "global_step1", tmp_path / "bf16") == 0
    assert training_cli(["export", str(run / "checkpoints"), str(tmp_path / "fp32"), "--dtype", "fp32"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").state_dict()
    master = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).state_dict()
    assert exported.keys() == master.keys() == trained.keys()
    for name, tensor in trained.items():
        assert tensor.dtype == exported[name].dtype == torch.bfloat16 and master[name].dtype == torch.float32
        assert torch.equal(exported[name], tensor) and torch.equal(master[name].bfloat16(), tensor), name
    assert any(not torch.equal(master[name], tensor.float()) for name, tensor in trained.items())  # more precise


def test_the_export_decodes_with_a_kv_cache_by_default(tensor_parallel_checkpoint, tmp_path):
    """Training turns the KV cache off, and the checkpoint's config says so; the export carries inference's default,
    which transformers' generate (and TRL's sampling from the export) follows when the caller does not set it."""
    tag, _ = tensor_parallel_checkpoint
    config = json.loads((tag / "hf/config.json").read_text())
    (tag / "hf/config.json").write_text(json.dumps({**config, "use_cache": False}))  # as train.py saves it
    assert export(tag, tmp_path / "out") == 0
    assert json.loads((tmp_path / "out/generation_config.json").read_text())["use_cache"] is True
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert out.past_key_values is not None and out.sequences.shape == (1, 5)
