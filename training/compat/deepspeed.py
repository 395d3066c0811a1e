"""Workarounds of DeepSpeed behaviour (verified for deepspeed 0.19.8, requirements.txt): process-wide replacements,
reads and writes of its private attributes, and its checkpoint files' names and formats. Each is declared in PATCHES
with the canary test (tests/training/compat/test_deepspeed.py) that fails when it is no longer right."""
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine, set_optimizer_flags
from deepspeed.checkpoint.constants import PARAM, UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY, \
    UNIVERSAL_CHECKPOINT_VERSION_VALUE
from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
from deepspeed.runtime.precision_config import DeepSpeedFP16Config
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.zero import stage3
from deepspeed.utils import safe_get_local_fp32_param, zero_to_fp32
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from training.compat import NO_ISSUE, Patch, no_mlflow_for_autotuner  # noqa: F401 (declared in PATCHES)
from training.compat.torch import found_inf

VERIFIED_FOR = "0.19.8"
CANARIES = "tests/training/compat/test_deepspeed.py::"


def deepspeed_patch(name: str, why: str, canary: str, issue: str = NO_ISSUE, *, proofs: tuple[str, ...]) -> Patch:
    return Patch(name, "deepspeed", VERIFIED_FOR, why, issue, CANARIES + canary, proofs)


PATCHES = (
    deepspeed_patch("no_mlflow_for_autotuner", "`import deepspeed` imports its autotuner, which imports mlflow when it "
                    "is installed (logging.report_to: mlflow needs it) to log autotuning experiments, which no run here "
                    "makes: 1.1 s of every rank's start. training/__init__.py puts an import finder first that refuses "
                    "mlflow to that module alone, once (the autotuner catches the ImportError)",
                    "test_the_autotuner_still_imports_mlflow_when_it_can",
                    proofs=("tests/training/compat/test_deepspeed.py::test_train_py_starts_without_mlflow",)),
    deepspeed_patch("expert_files", "an expert-parallel checkpoint keeps each expert's module weights in a file of "
                    "its own, named by DeepSpeedEngine._get_expert_ckpt_name (layer_L_expert_E_mp_rank_00_model_"
                    "states.pt): the export reads them", "test_expert_files_are_named_by_layer_and_expert",
                    proofs=("tests/test_expert_parallel.py::test_the_checkpoint_exports_as_the_hf_folder",)),
    deepspeed_patch("autoep_layers", "AutoEP marks the layers it puts in place of a model's MoE blocks only by a "
                    "private class attribute, AutoEPMoELayer._is_autoep_layer (its own AutoTP finds them the same "
                    "way); no public name tells them. The export and the expert-parallel weight gathering find them "
                    "by it",
                    "test_autoep_layers_still_carry_their_private_mark",
                    proofs=("tests/test_expert_parallel.py::test_the_checkpoint_exports_as_the_hf_folder",)),
    deepspeed_patch("autoep_output_recorders", "AutoEP moves transformers' router-logit recorders onto its own router "
                    "through the output-capture registry as a plain dict (registry.get(key, default), registry[key] = "
                    "value, with class names for keys); transformers 5.23's _CanRecordRegistry takes a model in get "
                    "and __setitem__, so deepspeed.initialize fails with a TypeError. While AutoEP replaces the MoE "
                    "blocks the registry also takes the class-name keys it stores",
                    "test_autoep_still_treats_the_output_capture_registry_as_a_dict",
                    proofs=("tests/test_expert_parallel.py::test_expert_parallel_gives_the_data_parallel_run",)),
    deepspeed_patch("sum_sequence_slices", "ZeRO-3's reduce-scatter path (stage3.reduce_scatter_coalesced, the "
                    "default) averages the gradients over every rank, its all-reduce path over the data-parallel "
                    "ranks only: under sequence parallelism the gradients come out N times too small",
                    "test_zero3_reduce_scatter_still_averages_over_every_rank",
                    "https://github.com/deepspeedai/DeepSpeed/issues/6841",
                    proofs=("tests/test_parallelism.py::test_model_parallel_runs_give_the_data_parallel_losses",)),
    deepspeed_patch("use_attention_under_ulysses", "UlyssesSPAttentionHF wraps the attention function registered "
                    "in transformers' ALL_ATTENTION_FUNCTIONS and drops the attention mask (a FlexAttention BlockMask "
                    "it rebuilds as plain causal), so packed documents would attend across each other under sdpa "
                    "and flex_attention: the registered function is replaced process-wide",
                    "test_ulysses_wraps_the_registered_attention_and_drops_the_mask",
                    proofs=("tests/test_parallelism.py::test_a_packed_row_keeps_its_documents_apart",)),
    deepspeed_patch("use_fp16_block_loss_scaling", "fp16 at ZeRO-0 (torch autocast) gets a default torch GradScaler, "
                    "engine.torch_autocast_z0_gradscaler, whatever the config's fp16 block says, and checkpoints "
                    "leave its scale out: it is replaced by FP16BlockGradScaler",
                    "test_zero0_fp16_gets_a_default_grad_scaler", "https://github.com/deepspeedai/DeepSpeed/pull/7619",
                    proofs=("tests/test_train_fp16_gpu.py::"
                            "test_resumed_fp16_run_continues_its_loss_scale",
                            "tests/training/state/test_checkpoint.py::"
                            "test_the_zero0_fp16_loss_scale_survives_save_and_resume")),
    deepspeed_patch("zero0_grad_norm", "a plain torch optimizer at ZeRO-0 reports no gradient norm "
                    "(get_global_grad_norm() is None; clipping computes one and drops it), and under fp16 the "
                    "gradients are still scaled by engine.torch_autocast_z0_gradscaler at the step",
                    "test_zero0_reports_no_gradient_norm",
                    proofs=("tests/test_train.py::test_loss_is_the_token_mean_of_the_whole_global_batch",)),
    deepspeed_patch("measure_before_model_step", "PipelineEngine steps through the private _take_model_step and "
                    "keeps the norm in the private _global_grad_norm: the engine's method is replaced on the "
                    "instance to measure the norm before the step", "test_the_pipeline_steps_through_take_model_step",
                    proofs=("tests/test_train_pipeline.py::"
                            "test_pipeline_reports_the_data_parallel_runs_gradient_norm",)),
    deepspeed_patch("withheld_step", "the engine skips a step (no scheduler step, skipped_steps + 1) when its "
                    "optimizer's `overflow` attribute is true; a torch optimizer has none and steps on NaN gradients",
                    "test_an_optimizer_reporting_overflow_skips_the_step",
                    proofs=("tests/test_stability.py::test_a_skipped_batch_is_the_only_difference",)),
    deepspeed_patch("local_fp32_shares", "a rank's fp32 master copy is reachable only through private attributes: "
                    "ZeRO-1/2 and the bf16 optimizer's param._hp_mapping, ZeRO-3's param.ds_tensor/ds_numel/ds_shape "
                    "(weight_shape, which weight decay's groups also take a weight's shape from)",
                    "test_zero1_parameters_map_to_their_fp32_fragments",
                    proofs=("tests/test_train_distributed.py::test_health_signals_are_the_same_under_every_stage",
                            "tests/training/compat/test_deepspeed.py::"
                            "test_zero3_weights_keep_their_shape_for_the_weight_decay_groups")),
    deepspeed_patch("zero_cuts", "how ZeRO cuts the weights between ranks is not an API: the plan counts the memory-"
                    "lean optimizers' states, and fp32 ZeRO's master copy and gradient buffer, on the parts each rank "
                    "holds, by stage_1_and_2's padding of each flat group to 2 x ranks and equal ranges, and ZeRO-3's "
                    "ceil(size / ranks) per weight",
                    "test_zero_cuts_are_deepspeeds_partitions",
                    proofs=("tests/test_optimizers.py::test_memory_lean_optimizers_equal_the_library_on_zeros_parts",
                            "tests/tools/test_compare_zero.py::test_compare_stages_on_tiny_llama")),
    deepspeed_patch("zero3_whole_weights", "ZeRO-3's per-module hooks (DeepSpeedZeRoOffload.forward_hooks and "
                    "backward_hooks, registered by its private _register_deepspeed_module) fetch a module's weights "
                    "before its forward pass and release them after, also inside GatheredParameters: whole weights "
                    "for a whole generation need the hooks taken off and put back (as TRL's "
                    "unwrap_model_for_generation does), the coordinator's recorded trace invalidated",
                    "test_zero3_hooks_release_gathered_weights_unless_taken_off",
                    proofs=("tests/test_grpo.py::test_a_killed_grpo_run_resumes_in_another_layout_on_the_same_curve",)),
    deepspeed_patch("gathered_16bit_state_dict", "the whole 16-bit weights under ZeRO-3 and AutoTP come from the "
                    "private engine._consolidated_16bit_state_dict (save_16bit_model writes a file instead)",
                    "test_save_16bit_model_still_gathers_through_the_private_method",
                    proofs=("tests/test_train_finetune.py::test_exported_folder_gives_the_engines_logits",)),
    deepspeed_patch("release_shared_memory_buffer", "the CPU accelerator's shared-memory all-reduce creates "
                    "/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> per rank and never unlinks it "
                    "(shm.cpp's shared_close is never called)", "test_the_cpu_all_reduce_never_unlinks_its_buffer",
                    "https://github.com/deepspeedai/DeepSpeed/pull/4115 (its discussion: the file stays until reboot)",
                    proofs=("tests/test_train_distributed.py::test_runs_leave_no_shared_memory_behind",)),
    deepspeed_patch("without_train_batch_size", "AutoTP: the config checks train_batch_size against the whole "
                    "world before _configure_tensor_parallel makes the groups, and under ZeRO-3 against the "
                    "data-parallel ranks after: no value passes both, so it is left for DeepSpeed to derive",
                    "test_the_batch_size_is_checked_before_autotp_makes_its_groups",
                    proofs=("tests/test_parallelism.py::test_model_parallel_runs_give_the_data_parallel_losses",)),
    deepspeed_patch("muon_flags", "Muon's parameters are chosen by name in set_optimizer_flags (2-D, not embed or "
                    "lm_head), which needs only the config's optimizer_name/params, and marked param.use_muon",
                    "test_muon_is_chosen_by_name_and_marked_on_the_parameter",
                    proofs=("tests/training/loop/test_optimizer.py::test_muon_refusals_exit_2",)),
    deepspeed_patch("pipeline_layer_file", "PipelineModule names each layer's checkpoint file "
                    "layer_NN-model_states.pt (ckpt_layer_path); export and the universal check read them by name",
                    "test_pipeline_layer_files_are_named_layer_nn_model_states",
                    proofs=("tests/test_train_pipeline.py::test_export_gives_the_trained_weights",)),
    deepspeed_patch("zero_fp32_weights", "zero_to_fp32 joins only model-parallel rank 00's files "
                    "(get_model_state_file names mp_rank_00); its private per-stage readers are run here on one "
                    "rank's files at a time", "test_zero_to_fp32_reads_model_parallel_rank_00_only",
                    proofs=("tests/test_parallelism.py::test_the_export_command_gives_the_engines_weights",)),
    deepspeed_patch("provide_universal_info", "ds_to_universal needs the Megatron-style UNIVERSAL_CHECKPOINT_INFO "
                    "attribute on the saved model, which Hugging Face models lack (train.py's own conversions also "
                    "pass --inject_missing_state, for checkpoints saved without it; a user's run of the converter "
                    "does not)",
                    "test_the_engine_saves_the_models_universal_info",
                    proofs=("tests/training/state/test_checkpoint.py::"
                            "test_a_checkpoint_of_a_model_with_universal_info_converts_without_injected_state",)),
    deepspeed_patch("make_stage_neutral", "ds_to_universal writes a universal checkpoint's common files as the "
                    "writing ZeRO stage reads them, and stage 3 reads other names and formats than stages 1/2",
                    "test_universal_files_are_still_read_per_stage",
                    proofs=("tests/test_resume_anywhere.py::test_resumed_run_continues_the_uninterrupted_curve",)),
    deepspeed_patch("universal_load_repaired", "ZeRO-3's universal loader gives every parameter group the first "
                    "group's settings and every state one shared step tensor",
                    "test_zero3_universal_loader_still_copies_the_first_group",
                    proofs=("tests/test_resume_anywhere.py::test_resumed_optimizer_state_is_the_uninterrupted_runs",)),
    deepspeed_patch("loading_universal", "checkpoint.load_universal is read from the private engine._config at "
                    "each load_checkpoint", "test_deepspeed_reads_load_universal_from_the_engine_config",
                    proofs=("tests/training/state/test_checkpoint.py::"
                            "test_a_run_resumed_through_a_universal_conversion_loads_its_own_checkpoints",
                            "tests/test_resume_anywhere.py::"
                            "test_a_rewind_after_a_resume_in_another_layout_loads_the_universal_conversion")),
    deepspeed_patch("convert_with_tensor_parallel", "the engine records parallel_dims.tp_degree as the mpu's "
                    "model-parallel size (Ulysses' sequence-parallel size); the converter reads it through the "
                    "private DeepSpeedCheckpoint._lightweight_parallel_dimensions, replaced here",
                    "test_the_converter_reads_the_tensor_parallel_degree_where_it_is_replaced",
                    proofs=("tests/test_resume_anywhere.py::"
                            "test_resumed_run_continues_the_uninterrupted_curve",
                            "tests/test_train.py::"
                            "test_a_sequence_parallel_checkpoint_resumes_in_another_layout_through_a_universal_one")),
)


# --- sequence parallelism ------------------------------------------------------------------------------------------

def sum_sequence_slices(size: int) -> None:
    """ZeRO-3's reduce-scatter averages over every rank; a sequence group's gradients are to be summed."""
    def reduce_scatter_summing_groups(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
        return [partition.mul_(size) for partition in reduce_scatter_coalesced(tensors, group)]

    stage3.reduce_scatter_coalesced = reduce_scatter_summing_groups


def use_attention_under_ulysses(name: str, attention: Callable) -> None:
    """Have Ulysses' wrapper, which takes the function registered under `name` ("sdpa", "flex_attention"), run
    `attention` instead."""
    ALL_ATTENTION_FUNCTIONS[name] = attention


# --- fp16 at ZeRO-0 and the gradient norm without ZeRO -------------------------------------------------------------

class FP16BlockGradScaler(torch.amp.GradScaler):
    """fp16 at ZeRO-0 (torch autocast) with the loss scaling that the DeepSpeed config's `fp16` block asks for.

    There DeepSpeed makes a default GradScaler (scale 2^16, doubled after 2,000 clean steps, halved at every
    overflow) whatever the block says, and its checkpoints leave the scale out. This one keeps torch's
    mechanics (scale the loss, unscale, skip a step whose gradients hold inf/nan) and takes each new scale from
    DeepSpeed's own loss scaler built from the block: `initial_scale_power`, `loss_scale_window`,
    `hysteresis`, `consecutive_hysteresis`, `min_loss_scale`, or a static `loss_scale`. Its state_dict
    includes that scaler's state, which train.py's checkpoints save and restore."""

    POLICY_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

    def __init__(self, block: DeepSpeedFP16Config, device: str):
        self.policy = CreateLossScaler(torch.float16, block.loss_scale, block.loss_scale == 0,
                                       block.dynamic_loss_scale_args())
        super().__init__(device, init_scale=float(self.policy.cur_scale))
        self.overflow = False

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        result = super().step(optimizer, *args, **kwargs)
        self.overflow = found_inf(self, optimizer)
        return result

    def update(self, new_scale: float | None = None) -> None:
        self.policy.update_scale(self.overflow)
        super().update(new_scale=float(self.policy.cur_scale))

    def state_dict(self) -> dict:
        policy = {key: getattr(self.policy, key) for key in self.POLICY_STATE if hasattr(self.policy, key)}
        return {**super().state_dict(), "deepspeed_loss_scaler": policy}

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        for key, value in state.pop("deepspeed_loss_scaler").items():
            setattr(self.policy, key, value)
        super().load_state_dict(state)


def z0_grad_scaler(engine: DeepSpeedEngine) -> torch.amp.GradScaler | None:
    """fp16's grad scaler at ZeRO-0 (torch autocast); None otherwise."""
    return engine.torch_autocast_z0_gradscaler


def use_fp16_block_loss_scaling(engine: DeepSpeedEngine, block: DeepSpeedFP16Config, device: str) -> None:
    """At ZeRO-0 with fp16, replace DeepSpeed's default GradScaler with one that follows the config's fp16 block."""
    if engine.torch_autocast_z0_gradscaler is not None:
        engine.torch_autocast_z0_gradscaler = FP16BlockGradScaler(block, device)


def loss_scale(engine: DeepSpeedEngine) -> float | None:
    """fp16's current loss scale (logged: a scale that keeps falling means overflowing gradients); None otherwise."""
    if engine.torch_autocast_z0_gradscaler is not None:
        return engine.torch_autocast_z0_gradscaler.get_scale()
    return float(engine.optimizer.loss_scale) if engine.fp16_enabled() else None


def zero0_grad_norm(engine: DeepSpeedEngine, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The gradient norm that DeepSpeed does not report without ZeRO: over this rank's gradients (a pipeline's tied
    copies once), summed in squares over the ranks of `group` (a pipeline's stages), and unscaled by fp16's
    ZeRO-0 loss scale, since the gradients are still scaled when the engine steps."""
    grads = [p.grad.float() for p in engine.module.parameters()  # float(): a no-op for fp32 gradients
             if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=engine.device)
    if group is not None:
        squares = norm.square()
        dist.all_reduce(squares, group=group)
        norm = squares.sqrt()
    scaler = engine.torch_autocast_z0_gradscaler
    return norm / scaler.get_scale() if scaler else norm


@contextmanager
def withheld_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """DeepSpeed's engine leaves the learning-rate schedule alone and counts a skipped step when its optimizer
    reports `overflow`; a torch optimizer has no such flag and steps on whatever gradients it holds. For one
    step its `step` does nothing and it reports an overflow; the engine then clears the gradients as usual."""
    optimizer.step, optimizer.overflow = (lambda *args, **kwargs: None), True
    try:
        yield
    finally:
        del optimizer.step, optimizer.overflow


def measure_before_model_step(engine: PipelineEngine, grad_norm: Callable[[], torch.Tensor],
                              withhold_nonfinite: bool) -> None:
    """Have the pipeline engine take `grad_norm()` as its gradient norm where it steps (after the data-parallel
    reduction, before clipping), and withhold a step whose norm is not finite when asked."""
    take_model_step = engine._take_model_step

    def norm_then_step(lr_kwargs=None):
        engine._global_grad_norm = grad_norm()
        nonfinite = withhold_nonfinite and not torch.isfinite(engine._global_grad_norm).item()
        with withheld_step(engine.optimizer) if nonfinite else nullcontext():
            take_model_step(lr_kwargs)

    engine._take_model_step = norm_then_step


# --- engine internals ----------------------------------------------------------------------------------------------

def local_fp32_shares(engine: DeepSpeedEngine,
                      parameters: list[torch.nn.Parameter]) -> list[tuple[int, int, torch.Tensor]]:
    """This rank's share of each parameter in the fp32 the optimizer updates, as (where the share starts in the
    flattened weight, the weight's size, the share): ZeRO-3's partitions, ZeRO-1/2's fragments of the fp32 master
    copy (also under the bf16 optimizer), or the whole weights without ZeRO (fp32 there: bf16/fp16 are autocast)."""
    if engine.zero_optimization_partition_weights():
        return [(dist.get_rank(group=p.ds_process_group) * p.ds_tensor.ds_numel, p.ds_numel,
                 safe_get_local_fp32_param(p)) for p in parameters]
    if engine.zero_optimization() or engine.bfloat16_enabled():
        return [(p._hp_mapping.lp_fragment_address.start, p.numel(), p._hp_mapping.get_hp_fragment())
                for p in parameters if p._hp_mapping is not None]
    return [(0, p.numel(), p) for p in parameters]


def zero_cuts(groups: list[list[int]], stage: int, ranks: int, rank: int) -> list[tuple[int, int, int]]:
    """How DeepSpeed cuts the trained weights (their sizes, per parameter group in order) between `ranks`: the parts
    `rank` holds, as (the weight's index over the groups, where the part starts in the flattened weight, its
    length). ZeRO-1/2 and the bf16 optimizer flatten each group, pad it to a multiple of 2 x ranks
    (nccl_start_alignment_factor) and give each rank an equal range; ZeRO-3 cuts every weight into ceil(size /
    ranks) pieces (the last rank's padded); ZeRO-0 keeps them whole."""
    if stage == 0 or ranks == 1:
        return [(index, 0, size) for index, size in enumerate(size for group in groups for size in group)]
    cuts, index = [], 0
    for group in groups:
        padded = math.ceil(sum(group) / (2 * ranks)) * 2 * ranks
        first, last, offset = rank * padded // ranks, (rank + 1) * padded // ranks, 0
        for size in group:
            if stage == 3:
                piece = math.ceil(size / ranks)
                begin, end = min(size, rank * piece), min(size, (rank + 1) * piece)
            else:
                begin, end = max(first, offset) - offset, min(last, offset + size) - offset
            if begin < end:
                cuts.append((index, begin, end - begin))
            offset += size
            index += 1
    return cuts


def weight_shape(parameter: torch.nn.Parameter) -> tuple[int, ...]:
    """A weight's whole shape, also under ZeRO-3 (where the parameter itself is empty; its ds_shape)."""
    return tuple(getattr(parameter, "ds_shape", parameter.shape))


@contextmanager
def autoep_output_recorders() -> Iterator[None]:
    """transformers' output-capture registry, for the duration, also takes the class-name keys that AutoEP reads and
    writes (what it stores under them is what transformers reads for a model of that class)."""
    from transformers.utils import output_capturing
    registry = type(output_capturing._CAN_RECORD_REGISTRY)
    get, set_item = registry.get, registry.__setitem__
    registry.get = lambda self, key, *default: dict.get(self, key, *default) if isinstance(key, str) else get(self, key)
    registry.__setitem__ = lambda self, key, value: dict.__setitem__(self, key, value) if isinstance(key, str) \
        else set_item(self, key, value)
    try:
        yield
    finally:
        registry.get, registry.__setitem__ = get, set_item


def autoep_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, layer) of each layer AutoEP put in place of an MoE block, in the model's order (none without it)."""
    return [(name, module) for name, module in model.named_modules() if getattr(module, "_is_autoep_layer", False)]


@contextmanager
def zero3_whole_weights(engine: DeepSpeedEngine) -> Iterator[None]:
    """Under ZeRO-3, every weight whole on every rank for the duration (a full copy per rank, gathered once), the
    per-module fetch and release hooks off; both back as they were after."""
    offload = engine.optimizer.parameter_offload
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for parameter in engine.module.parameters():
            parameter.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            coordinator = offload.get_param_coordinator()
            if not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()
            offload._register_deepspeed_module(offload.module)


def gathered_16bit_state_dict(engine: DeepSpeedEngine, exclude_frozen_parameters: bool = False) -> dict:
    """The whole 16-bit weights on rank 0 under ZeRO-3 or AutoTP (every rank calls it)."""
    return engine._consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)


def release_shared_memory_buffer(rank: int) -> None:
    """Unlink this rank's shared-memory all-reduce buffer (66 MB, left in /dev/shm until reboot otherwise). Every
    rank calls it once every rank has mapped every buffer (after init and a barrier); the memory stays mapped for
    the run and is freed when its processes exit, however they exit."""
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_{rank}"
    Path("/dev/shm", name).unlink(missing_ok=True)


def without_train_batch_size(ds_config: dict) -> dict:
    """The config without train_batch_size, which DeepSpeed then derives from the micro-batch and accumulation."""
    return {key: value for key, value in ds_config.items() if key != "train_batch_size"}


def muon_flags(model: torch.nn.Module) -> dict[str, bool]:
    """Which parameters DeepSpeed's Muon takes (by its name rule), by parameter name."""
    set_optimizer_flags(_MuonConfig(), model)
    return {name: p.use_muon for name, p in model.named_parameters()}


class _MuonConfig:
    """What set_optimizer_flags reads of DeepSpeed's config."""
    optimizer_name, optimizer_params = "muon", {}


# --- checkpoint files ----------------------------------------------------------------------------------------------

def pipeline_layer_file(index: int) -> str:
    return f"layer_{index:02d}-model_states.pt"


def model_parallel_ranks(tag_dir: Path, at_least: int) -> list[str]:
    """The checkpoint's model-parallel ranks by their file names' `mp_rank_NN`: `at_least` of them, or more where
    DeepSpeed named more."""
    found = {int(match.group(1)) for path in tag_dir.iterdir()
             if (match := re.search(r"mp_rank_(\d+)_(?:model|optim)_states\.pt$", path.name))}
    return [f"mp_rank_{rank:02d}" for rank in range(max([at_least, *(rank + 1 for rank in found)]))]


EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt")


def expert_files(tag_dir: Path) -> list[Path]:
    """An expert-parallel checkpoint's files of each expert's module weights (one per MoE layer and expert, which
    DeepSpeed names by the layer's MoE index and the expert's global index), in order."""
    found = [(path, EXPERT_FILE.fullmatch(path.name)) for path in tag_dir.iterdir()]
    return [path for path, match in sorted((f for f in found if f[1]), key=lambda f: tuple(map(int, f[1].groups())))]


def in_order(paths) -> list[Path]:
    return sorted(paths, key=lambda path: zero_to_fp32.natural_keys(path.name))


def has_zero_partitions(tag_dir: Path) -> bool:
    """Whether the optimizer files are ZeRO partitions: a bf16 run's are named bf16_zero_pp_rank_* at ZeRO-0/1 too,
    where they are BF16_Optimizer's, hold no ZeRO stage, and zero_to_fp32 refuses them."""
    optimizer_files = in_order(tag_dir.glob("*zero_pp_rank_*_optim_states.pt"))
    return bool(optimizer_files) and zero_to_fp32.ZERO_STAGE in torch.load(
        optimizer_files[0], map_location="cpu", mmap=True, weights_only=False)[zero_to_fp32.OPTIMIZER_STATE_DICT]


def zero_rank_files(tag_dir: Path, rank: str) -> dict[str, list[Path]]:
    """One model-parallel rank's files, by kind: ZeRO-1/2's mp_rank_NN_model_states.pt or ZeRO-3's
    zero_pp_rank_M_mp_rank_NN_model_states.pt (one per ZeRO rank), and its optimizer partitions."""
    return {kind: in_order(tag_dir.glob(f"{prefix}{rank}_{kind}_states.pt"))
            for kind, prefix in (("model", "*"), ("optim", "*zero_pp_rank_*_"))}


def zero_fp32_weights(tag_dir: Path, files: dict[str, list[Path]]) -> dict[str, torch.Tensor]:
    """zero_to_fp32's steps on one model-parallel rank's files (zero_rank_files): its fp32 master weights."""
    model_states = zero_to_fp32.parse_model_states([str(path) for path in files["model"]])
    stage, size, groups, paddings = zero_to_fp32.parse_optim_states([str(p) for p in files["optim"]], tag_dir)
    state_dict = (zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(size, groups, model_states, False,
                                                                          paddings) if stage <= 2 else
                  zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(size, groups, model_states, False))
    return zero_to_fp32.to_torch_tensor(state_dict)


# --- universal checkpoints -----------------------------------------------------------------------------------------

def provide_universal_info(model: torch.nn.Module) -> None:
    """The entry ds_to_universal needs in the checkpoint (with plain data parallelism its version is all there is)."""
    setattr(model, UNIVERSAL_CHECKPOINT_INFO, {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE})


def make_stage_neutral(folder: Path) -> None:
    """DeepSpeed's converter writes the folder's two common files as the ZeRO stage that wrote the checkpoint
    reads them, and stage 3 reads them otherwise than stages 1 and 2 (and the bf16 optimizer of stage 1):
    - the engine's state (step counters, learning-rate schedule) is `mp_rank_00_model_states.pt` to stages
      1/2 and `zero_pp_rank_0_mp_rank_00_model_states.pt` to stage 3: both names are given the one file;
    - each parameter's states are files of {"param": tensor} in the parameter's shape to stages 1/2, which
      stage 3 also reads (it writes bare flat tensors): stage 3's are wrapped and shaped;
    - the optimizer's step is a `step.pt` per parameter to stages 1/2, and a torch optimizer state dict in
      `zero/optimizer_state.pt` (`optimizer_state_dict`) to stage 3, which stages 1/2 check for DeepSpeed's
      version and the clipping value: each is added where missing, with the values the folder holds."""
    engine_states = sorted(folder.glob("*mp_rank_00_model_states.pt"))
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if not (folder / name).exists():
            shutil.copyfile(engine_states[0], folder / name)
    path = folder / "zero" / "optimizer_state.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)
    engine_state = torch.load(engine_states[0], map_location="cpu", weights_only=False)
    parameters = [item for item in path.parent.iterdir() if item.is_dir()]
    if "optimizer_state_dict" in state:  # converted from stage 3: flat bare tensors, and the step in the states
        step = state["optimizer_state_dict"]["state"][0]["step"]
        shapes = {name: shape for group in engine_state["param_shapes"] for name, shape in group.items()}
        for parameter in parameters:
            for file in parameter.glob("*.pt"):
                tensor = torch.load(file, map_location="cpu", weights_only=False)
                if torch.is_tensor(tensor):
                    torch.save({PARAM: tensor.view(shapes[parameter.name])}, file)
            torch.save(step.clone(), parameter / "step.pt")
    else:
        step = torch.load(parameters[0] / "step.pt", map_location="cpu", weights_only=False)
        state["optimizer_state_dict"] = {"state": {i: {"step": step} for i in range(len(state["param_groups"]))},
                                         "param_groups": state["param_groups"]}
    state.setdefault("ds_version", engine_state["ds_version"])
    state.setdefault("clip_grad", engine_state["ds_config"].get("gradient_clipping", 0.0))
    torch.save(state, path)


@contextmanager
def universal_load_repaired(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Undo two things ZeRO-3's universal loader does to a torch optimizer with several parameter groups (found by
    comparing resumed runs with uninterrupted ones):
    - every group gets the first group's settings, so the group without weight decay would decay: each
      group's own settings, which come from this run's recipe, are put back (the learning rate stays as
      loaded: it is the schedule's, at the step);
    - every state gets the same `step` tensor, which AdamW then advances once per group and step, skewing
      the bias correction: each state gets its own copy."""
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's optimizers wrap a torch one
    settings = [{key: value for key, value in group.items() if key not in ("params", "lr")}
                for group in inner.param_groups]
    yield
    for group, kept in zip(inner.param_groups, settings):
        group.update(kept)
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


@contextmanager
def loading_universal(engine: DeepSpeedEngine, universal: bool) -> Iterator[None]:
    """DeepSpeed reads `checkpoint.load_universal` from the engine's config object at every load_checkpoint
    (engine.load_universal_checkpoint()), and only there. It is set for each load: a resume in another layout loads
    the universal conversion, and a rewind later in that run loads either that conversion again or a checkpoint the
    run saved since, in its own layout."""
    config, before = engine._config, engine._config.load_universal_checkpoint
    config.load_universal_checkpoint = universal
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


def convert_with_tensor_parallel(tensor_parallel: int, arguments: list[str]) -> None:
    """DeepSpeed's converter (ds_to_universal.main) on a checkpoint whose model-state files record the right tensor-
    parallel degree. DeepSpeed records `parallel_dims.tp_degree` as the `mpu`'s model-parallel size, and for
    sequence parallelism the mpu is Ulysses', whose model-parallel size is the sequence-parallel size: the converter
    then looks for that many tensor-parallel slices of weights that sequence parallelism never splits (its files are
    plain data-parallel ZeRO partitions). The degree the converter reads is set to the run's own tensor parallelism."""
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.checkpoint.constants import CHECKPOINT_TP_DEGREE
    from deepspeed.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint
    recorded = DeepSpeedCheckpoint._lightweight_parallel_dimensions

    def run_dimensions(model_state: dict):
        dimensions = recorded(model_state)
        return {**dimensions, CHECKPOINT_TP_DEGREE: tensor_parallel} if isinstance(dimensions, dict) else dimensions

    DeepSpeedCheckpoint._lightweight_parallel_dimensions = staticmethod(run_dimensions)
    sys.argv = ["ds_to_universal", *arguments]
    ds_to_universal.main(ds_to_universal.parse_arguments())
