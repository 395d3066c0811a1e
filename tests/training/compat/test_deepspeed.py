"""Canaries of training/compat/deepspeed/, and the upstream bugs behind three refusals (docs/compat.md). Each test
fails when a patched name disappears, when DeepSpeed stops calling it, or when DeepSpeed fixes the behaviour: its
message then says what can go."""
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import deepspeed
import pytest
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.zero import stage3

from tests.conftest import REPO, run_train
from training.compat.deepspeed.autoep import autoep_layers, autoep_output_recorders
from training.compat.deepspeed.checkpoint_files import expert_files, pipeline_layer_file
from training.compat.deepspeed.engine_step import withheld_step, zero0_grad_norm
from training.compat.deepspeed.initialize import muon_flags
from training.compat.deepspeed.zero import local_fp32_shares, weight_shape, zero3_whole_weights, zero_cuts
from training.planning.shape import weight_decay_groups

STAGE3 = stage3.DeepSpeedZeroOptimizer_Stage3


def source(function) -> str:
    return inspect.getsource(function)


def tiny_engine(zero_stage: int, optimizer: str = "AdamW", **config) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    params = {"lr": 0.01, **({"torch_adam": True} if optimizer == "AdamW" else {})}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": zero_stage},
              "optimizer": {"type": optimizer, "params": params}, **config}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def backward(engine: deepspeed.DeepSpeedEngine) -> None:
    engine.backward(engine(torch.arange(8.0).reshape(1, 8)).square().sum())


# --- start-up ------------------------------------------------------------------------------------------------------

def test_the_autotuner_still_imports_mlflow_when_it_can():
    """conftest imports training before DeepSpeed, as train.py does: the autotuner got no mlflow, though it is
    installed (requirements.txt) and importable by anyone else."""
    import importlib.util

    from deepspeed.autotuning import autotuner
    assert importlib.util.find_spec("mlflow") is not None
    module = source(autotuner)
    assert "try:\n    import mlflow\n    has_mlflow = True" in module, \
        "DeepSpeed's autotuner no longer imports mlflow at import: compat no_mlflow_for_autotuner can go"
    assert autotuner.has_mlflow is False


@pytest.mark.slow
def test_train_py_starts_without_mlflow():
    """Importing train.py (as each rank does) loads DeepSpeed without mlflow; mlflow still imports afterwards."""
    probe = ("import sys, train; loaded = 'mlflow' in sys.modules; import mlflow; "
             "print(loaded, mlflow.get_tracking_uri is not None)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1].split() == ["False", "True"]


# --- sequence parallelism ------------------------------------------------------------------------------------------

def test_zero3_reduce_scatter_still_averages_over_every_rank():
    assert callable(stage3.reduce_scatter_coalesced)
    module = source(stage3)  # the method is wrapped by instrument_w_nvtx, which keeps no __wrapped__
    start = module.index("def __avg_scatter_grads(")
    scatter = module[start:module.index("\n    def ", start + 1)]
    assert "reduce_scatter_coalesced(" in scatter
    assert "sequence_parallel_size" in source(STAGE3.allreduce_bucket)  # the all-reduce path divides right
    assert "sequence_parallel_size" not in scatter, \
        "ZeRO-3's reduce-scatter now accounts for sequence parallelism: compat sum_sequence_slices can go"


def test_ulysses_wraps_the_registered_attention_and_drops_the_mask():
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    register = source(UlyssesSPAttentionHF.register_with_transformers)
    assert "ALL_ATTENTION_FUNCTIONS[core_attn_implementation]" in register
    assert "attention_mask = None" in register, \
        "Ulysses keeps the attention mask now: compat use_attention_under_ulysses (document_sdpa) may go"
    rebuilt = source(UlyssesSPAttentionHF.forward)
    assert "def causal_mask(batch_idx, head_idx, q_idx, kv_idx):" in rebuilt and "kwargs[\"position_ids\"]" \
        in rebuilt, "Ulysses no longer rebuilds a plain causal BlockMask: check whether document_flex is still needed"


# --- fp16 at ZeRO-0, the gradient norm without ZeRO, a withheld step -----------------------------------------------

def test_zero0_fp16_gets_a_default_grad_scaler():
    engine_source = source(deepspeed.runtime.engine)
    assert "self.torch_autocast_z0_gradscaler = torch.amp.GradScaler(device=get_accelerator().device_name())" \
        in engine_source, "DeepSpeed builds ZeRO-0's fp16 grad scaler otherwise now (from the fp16 block?): check " \
                          "whether compat use_fp16_block_loss_scaling can go"


def test_zero0_reports_no_gradient_norm(one_rank):
    engine = tiny_engine(0)
    backward(engine)
    expected = torch.nn.utils.get_total_norm([p.grad for p in engine.module.parameters()])
    assert torch.equal(zero0_grad_norm(engine), expected)
    engine.step()
    assert engine.get_global_grad_norm() is None, \
        "DeepSpeed reports ZeRO-0's gradient norm now: compat zero0_grad_norm and the pipeline's patch can go"


def test_the_pipeline_steps_through_take_model_step():
    assert "self._take_model_step(" in source(PipelineEngine._exec_optimizer_step)
    assert "self._global_grad_norm" in source(deepspeed.DeepSpeedEngine.get_global_grad_norm)


def test_an_optimizer_reporting_overflow_skips_the_step(one_rank):
    engine = tiny_engine(0)
    before = [p.detach().clone() for p in engine.module.parameters()]
    backward(engine)
    with withheld_step(engine.optimizer):
        engine.step()
    assert engine.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))


# --- engine internals ----------------------------------------------------------------------------------------------

def test_zero1_parameters_map_to_their_fp32_fragments(one_rank):
    engine = tiny_engine(1)
    parameters = list(engine.module.parameters())
    shares = local_fp32_shares(engine, parameters)
    assert [(start, size) for start, size, _ in shares] == [(0, p.numel()) for p in parameters]
    assert all(torch.equal(share.view(p.shape), p.float()) for (_, _, share), p in zip(shares, parameters))


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_zero_cuts_are_deepspeeds_partitions(one_rank, zero_stage):
    """On one rank what can be seen of the cut: ZeRO-1's flat group padded to an even length, ZeRO-3's weights whole;
    the source lines below make the N-rank rule (tests/test_optimizers.py measures it on 2 ranks)."""
    engine = tiny_engine(zero_stage)  # 8 x 8 + 8 + 8 + 1 = 81 values in one group
    sizes = [p.ds_numel if zero_stage == 3 else p.numel() for p in engine.module.parameters()]
    assert zero_cuts([sizes], zero_stage, 1, 0) == [(i, 0, size) for i, size in enumerate(sizes)]
    if zero_stage == 1:
        assert [flat.numel() for flat in engine.optimizer.single_partition_of_fp32_groups] == [82]
    assert "self.nccl_start_alignment_factor = 2" in source(deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer)
    assert "alignment = self.nccl_start_alignment_factor * dist.get_world_size(" in \
        source(deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer)
    init = deepspeed.runtime.zero.partition_parameters.Init
    assert "remainder = param.ds_numel % partition_world_size" in source(init._padding_size)
    assert "partition_size = tensor_size // self._partition_world_size(param)" in \
        source(deepspeed.runtime.zero.partition_parameters)  # Init._partition_param, wrapped for NVTX


def test_zero3_weights_keep_their_shape_for_the_weight_decay_groups(one_rank):
    """A partitioned ZeRO-3 parameter is empty: taken by its own ndim every weight would land in the no-decay group
    (weight decay silently off under ZeRO-3, and one parameter group where the other stages have two)."""
    engine = tiny_engine(3)
    assert all(p.ndim == 1 and p.numel() == 0 for p in engine.module.parameters())
    decay, no_decay = weight_decay_groups(engine.module, 0.1)
    assert [weight_shape(p) for p in decay["params"]] == [(8, 8), (1, 8)] and len(no_decay["params"]) == 2


def test_zero3_hooks_release_gathered_weights_unless_taken_off(one_rank):
    """Inside GatheredParameters a module's forward pass still releases its weights (the hooks partition them
    after it): zero3_whole_weights takes the hooks off, so they stay whole through any number of passes, and puts
    them back: after it the weights are partitioned, and training steps as before."""
    engine, inputs = tiny_engine(3), torch.arange(8.0).reshape(1, 8)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        engine.module(inputs)
        released = [p.numel() == 0 for p in engine.module.parameters()]
    assert any(released), "DeepSpeed's hooks no longer release gathered weights: zero3_whole_weights can go"
    with zero3_whole_weights(engine):
        for _ in range(3):
            output = engine.module(inputs)
            assert [tuple(p.shape) for p in engine.module.parameters()] == [(8, 8), (8,), (1, 8), (1,)]
    assert all(p.numel() == 0 for p in engine.module.parameters())
    before = output.detach().clone()
    backward(engine)
    engine.step()
    with torch.no_grad():
        assert not torch.equal(engine(inputs), before)  # the hooks gathered the stepped weights again


def test_save_16bit_model_still_gathers_through_the_private_method():
    assert "_consolidated_16bit_state_dict(" in source(deepspeed.DeepSpeedEngine.save_16bit_model)
    assert "exclude_frozen_parameters" in inspect.signature(
        deepspeed.DeepSpeedEngine._consolidated_16bit_state_dict).parameters


def test_the_cpu_all_reduce_never_unlinks_its_buffer():
    shm = open(os.path.join(os.path.dirname(deepspeed.__file__), "ops/csrc/cpu/comm/shm.cpp")).read()
    assert '#define SHM_BUFFER_NAME "deepspeed_allreduce_buffer"' in shm and '"%s_%d_%s_%s"' in shm
    assert shm.count("shared_close(") == 1, \
        "DeepSpeed's CPU all-reduce closes its shared memory now: compat release_shared_memory_buffer can go"


def test_the_batch_size_is_checked_before_autotp_makes_its_groups():
    init = source(deepspeed.DeepSpeedEngine.__init__)
    assert init.index("self._config = ") < init.index("self._configure_tensor_parallel(")
    assert "train_batch == micro_batch * grad_acc * self.world_size" in \
        source(deepspeed.runtime.config.DeepSpeedConfig._batch_assertion)


def test_muon_is_chosen_by_name_and_marked_on_the_parameter():
    model = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(4, 2), "proj": torch.nn.Linear(2, 2)})
    assert muon_flags(model) == {"embed_tokens.weight": False, "proj.weight": True, "proj.bias": False}


@pytest.mark.parametrize("zero_stage, overlap_comm", [(1, False), (2, True), (3, True)])
def test_zero_keeps_the_buffers_the_memory_plan_counts(one_rank, zero_stage, overlap_comm):
    """What training/planning/model_states.py counts of DeepSpeed's own buffers (fp32_zero_states,
    gradient_bucket_bytes), on one rank in fp32: the master weights are a copy, not the weights; ZeRO-1/2 make
    reduce_bucket_size-element gradient buckets at the backward pass (two with overlap_comm) and free them before the
    step, ZeRO-3 keeps one for the run; ZeRO-1/2's Muon stages its momentum in a buffer of its own."""
    engine = tiny_engine(zero_stage, zero_optimization={"stage": zero_stage, "reduce_bucket_size": 40,
                                                        "overlap_comm": overlap_comm})
    optimizer, seen = engine.optimizer, []
    storage = lambda tensor: tensor.untyped_storage().data_ptr()  # noqa: E731
    if zero_stage == 3:
        assert storage(optimizer.fp32_partitioned_groups_flat[0]) != storage(optimizer.fp16_partitioned_groups_flat[0])
    else:
        assert storage(optimizer.single_partition_of_fp32_groups[0]) != storage(optimizer.bit16_groups_flat[0])
        reduce = optimizer.reduce_ipg_grads
        optimizer.reduce_ipg_grads = lambda *args, **kwargs: (  # the buckets as the backward pass reduces them
            seen.append([(b.numel(), b.dtype) for bucket in optimizer.ipg_buckets.values() for b in bucket.buffer]),
            reduce(*args, **kwargs))[1]
    backward(engine)
    engine.step()
    if zero_stage == 3:
        assert [(bucket.buffer.numel(), bucket.buffer.dtype) for bucket in optimizer.ipg_buckets.values()] == \
            [(40, torch.float32)]
    else:
        assert seen and all(buffers == [(40, torch.float32)] * (1 + overlap_comm) for buffers in seen)
        assert all(not bucket.buffer for bucket in optimizer.ipg_buckets.values())  # freed before the step
        assert "staged = torch.empty_like(committed)" in source(type(optimizer)._muon_staging_momentum)


# --- checkpoint files ----------------------------------------------------------------------------------------------

def test_pipeline_layer_files_are_named_layer_nn_model_states():
    from types import SimpleNamespace

    from deepspeed.pipe import PipelineModule
    module = SimpleNamespace(_local_start=3, global_rank=0,
                             _grid=SimpleNamespace(_topo=SimpleNamespace(get_rank_repr=lambda rank: "")))
    assert PipelineModule.ckpt_layer_path(module, "", 2) == pipeline_layer_file(5)


def test_zero_to_fp32_reads_model_parallel_rank_00_only():
    from deepspeed.utils import zero_to_fp32
    for name in ("natural_keys", "parse_model_states", "parse_optim_states", "to_torch_tensor",
                 "_get_fp32_state_dict_from_zero2_checkpoint", "_get_fp32_state_dict_from_zero3_checkpoint"):
        assert callable(getattr(zero_to_fp32, name)), name
    assert "mp_rank_00_model_states.pt" in source(zero_to_fp32.get_model_state_file)
    assert "mp_rank_0" not in source(zero_to_fp32.get_model_state_files), \
        "zero_to_fp32 picks its model-parallel rank's files now: check compat zero_rank_files"


def test_universal_fp32_files_hold_the_param_entry():
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.checkpoint.universal_checkpoint import load_hp_checkpoint_state
    loader = source(load_hp_checkpoint_state)
    assert 'f"{key}.pt"' in loader and "ckpt_dict[PARAM]" in loader
    assert '"fp32", "exp_avg", "exp_avg_sq"' in source(ds_to_universal), "the states' file names changed"


def test_the_engine_saves_the_models_universal_info():
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
    assert "UNIVERSAL_CHECKPOINT_INFO" in source(deepspeed.DeepSpeedEngine._save_checkpoint)
    assert UNIVERSAL_CHECKPOINT_INFO == "universal_checkpoint_info"


def test_universal_files_are_still_read_per_stage():
    from deepspeed.checkpoint import ds_to_universal
    assert "optimizer_state.pt" in source(ds_to_universal)
    stage3_load = source(STAGE3.load_hp_checkpoint_state_from_checkpoint_dir_stage3)
    assert '"optimizer_state.pt"' in stage3_load and "[OPTIMIZER_STATE_DICT]['state'][0]['step']" in stage3_load


def test_zero3_universal_loader_still_copies_the_first_group():
    loader = source(STAGE3.load_hp_checkpoint_state_from_checkpoint_dir_stage3)
    assert '["param_groups"][0]' in loader and "['step'] = state_step" in loader, \
        "ZeRO-3's universal loader keeps each group's settings now: compat universal_load_repaired can go"


def test_deepspeed_reads_load_universal_from_the_engine_config():
    assert "self._config.load_universal_checkpoint" in source(deepspeed.DeepSpeedEngine.load_universal_checkpoint)


def test_the_converter_reads_the_tensor_parallel_degree_where_it_is_replaced():
    """If DeepSpeed moves this reader, sequence-parallel checkpoints would convert as tensor-parallel ones again."""
    from deepspeed.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_TP_DEGREE
    from deepspeed.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint
    dimensions = {CHECKPOINT_PARALLEL_DIMS: {"pp_degree": 1, CHECKPOINT_TP_DEGREE: 2}}
    assert DeepSpeedCheckpoint._lightweight_parallel_dimensions(dimensions)[CHECKPOINT_TP_DEGREE] == 2
    assert "_lightweight_parallel_dimensions(model_state)" in \
        source(DeepSpeedCheckpoint._discover_model_state_metadata)
    assert "bwc_tensor_model_parallel_world_size(mpu)" in source(deepspeed.runtime.engine)


# --- the upstream bugs behind refusals: when one of these fails, its refusal can be lifted -------------------------

@pytest.fixture(scope="module")
def upstream_bugs() -> dict[int, dict]:
    """tests/helpers/upstream_bugs.py's report, by rank: the refused layouts run as they would run."""
    result = run_train([], ranks=2, script="tests/helpers/upstream_bugs.py")
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"rank"')]
    assert len(reports) == 2, result.stdout[-3000:] + result.stderr[-3000:]
    return {report["rank"]: report for report in reports}


@pytest.mark.slow
def test_autotp_still_drops_the_sequence_parallel_groups(upstream_bugs):
    assert not any(report["autotp_keeps_the_sequence_groups"] for report in upstream_bugs.values()), \
        "AutoTP keeps the sequence-parallel mpu now: the refusal of tensor with sequence parallelism can be lifted"


@pytest.mark.slow
def test_bf16_zero1_still_takes_the_sequence_rank_for_a_tensor_parallel_one(upstream_bugs):
    assert upstream_bugs[1]["bf16_zero1_step_error"] == "RuntimeError: stack expects a non-empty TensorList", \
        "bf16 at ZeRO-1 steps under sequence parallelism now: the refusal of bf16/fp8 sequence parallelism at " \
        "ZeRO-1 (training/parallel/sequence_parallel.py) can be lifted"


def test_autotp_replaces_the_engines_mpu_with_its_own_groups():
    """The fast tier's sign of the bug above: AutoTP sets the engine's mpu to its tensor-parallel groups, dropping the
    sequence-parallel mpu given to deepspeed.initialize."""
    assert "self.mpu = groups" in source(deepspeed.DeepSpeedEngine._configure_tensor_parallel_states)


@pytest.mark.slow  # seconds alone, but a minute once in a whole fast-tier run (not yet understood)
def test_zero_muon_reports_the_norm_of_its_updates(one_rank):
    """Muon with gradient clipping under ZeRO: the norm ZeRO's Muon takes (and would clip by) is its orthogonalized
    updates', not the gradients'. Eager: DeepSpeed compiles Muon's Newton-Schulz step, a minute of inductor on a CPU
    for the same numbers."""
    with torch._dynamo.config.patch(disable=True):
        muon_norm_ratio = updates_over_gradients_norm()
    assert abs(muon_norm_ratio - 1) > 0.5, \
        "ZeRO's Muon reports the gradients' norm now: the refusal of training.grad_clip with Muon can be lifted"


def updates_over_gradients_norm() -> float:
    engine = tiny_engine(1, optimizer="Muon", gradient_clipping=0.0)
    copy = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    copy.load_state_dict(engine.module.state_dict())
    copy(torch.arange(8.0).reshape(1, 8)).square().sum().backward()
    gradients = torch.nn.utils.get_total_norm([p.grad for p in copy.parameters()])
    backward(engine)
    engine.step()
    return float(engine.get_global_grad_norm()) / float(gradients)


def test_autoep_still_treats_the_output_capture_registry_as_a_dict():
    """AutoEP reads and writes transformers' output-capture registry with class-name keys and a default, and
    transformers' registry takes a model: this fails when either side changes (then the patch goes, or is redone)."""
    from deepspeed.module_inject.auto_ep_presets import base
    from transformers.utils import output_capturing
    assert "registry.get(registry_key, _MISSING_REGISTRY_ENTRY)" in \
        inspect.getsource(base._install_instance_transformers_output_recorders)
    registry, key = output_capturing._CAN_RECORD_REGISTRY, "<class 'Probe'>"
    with pytest.raises(TypeError):
        registry.get(key, None)
    with autoep_output_recorders():
        registry[key] = {"router_logits": 1}
        assert registry.get(key, None) == {"router_logits": 1} and registry.get("<class 'Other'>", 5) == 5
        del registry[key]
    with pytest.raises(TypeError):  # put back
        registry.get(key, None)


def test_autoep_layers_still_carry_their_private_mark():
    """AutoEP's layer class carries the mark that autoep_layers finds, and its own AutoTP still reads it so."""
    from deepspeed.module_inject import auto_ep_layer, auto_tp
    assert auto_ep_layer.AutoEPMoELayer._is_autoep_layer is True
    assert 'getattr(child, "_is_autoep_layer", False)' in inspect.getsource(auto_tp)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1]._is_autoep_layer = True
    assert autoep_layers(model) == [("1", model[1])]


def test_expert_files_are_named_by_layer_and_expert(tmp_path):
    names = [Path(DeepSpeedEngine._get_expert_ckpt_name(str(tmp_path), layer, expert, None)).name
             for layer, expert in ((1, 3), (0, 10), (0, 2))]
    for name in [*names, "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]:
        (tmp_path / name).touch()
    assert [path.name for path in expert_files(tmp_path)] == [names[2], names[1], names[0]]


# --- checkpoints written in the background -------------------------------------------------------------------------

@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_every_file_of_a_save_goes_through_the_checkpoint_engine(one_rank, tmp_path, zero_stage):
    """write_in_background replaces engine.checkpoint_engine: a save through it writes DeepSpeed's own files, the
    same names, which load to the same states; none is written before start()."""
    from training.compat.deepspeed.background_save import write_in_background
    engine = tiny_engine(zero_stage)
    backward(engine)
    engine.step()
    engine.save_checkpoint(str(tmp_path / "direct"), tag="t", save_latest=False)
    writer = write_in_background(engine)
    assert writer.zipfile_serialization  # DeepSpeed's default format, read from the engine it replaces
    engine.save_checkpoint(str(tmp_path / "background"), tag="t", save_latest=False)
    assert not (tmp_path / "background" / "t").exists() or not any((tmp_path / "background" / "t").iterdir())
    writer.start()
    writer.wait()
    names = {kind: sorted(p.name for p in (tmp_path / kind / "t").iterdir()) for kind in ("direct", "background")}
    assert names["direct"] == names["background"] and len(names["direct"]) >= (1 if zero_stage == 0 else 2), names
    for name in names["direct"]:
        if name.endswith(".pt"):
            direct, background = (torch.load(tmp_path / kind / "t" / name, weights_only=False)
                                  for kind in ("direct", "background"))
            assert_same_states(direct, background)
    assert "self.checkpoint_engine.commit(commit_info)" in source(DeepSpeedEngine.save_checkpoint)


def assert_same_states(a, b) -> None:
    if torch.is_tensor(a):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_states(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_states(x, y)


def test_the_host_copy_is_a_snapshot_that_keeps_tied_tensors_one():
    from training.compat.deepspeed.background_save import host_copy
    weight = torch.ones(4, 4)
    state = {"embed": weight, "head": weight, "groups": [{"lr": 0.1, "params": [0, 1]}], "step": 3}
    copied = host_copy(state)
    weight.add_(1)
    state["groups"][0]["lr"] = 0.2
    assert torch.equal(copied["embed"], torch.ones(4, 4)) and copied["embed"] is copied["head"]
    assert copied["groups"][0]["lr"] == 0.1 and copied["step"] == 3
