"""Workarounds of DeepSpeed behaviour (verified for deepspeed 0.19.8, requirements.txt): process-wide replacements,
reads and writes of its private attributes, and its checkpoint files' names and formats. A module per part of DeepSpeed
that they work around (PARTS): sequence_parallel.py (ZeRO-3's reduce-scatter, Ulysses' attention), engine_step.py (the
optimizer step at ZeRO-0 and in the pipeline: fp16's loss scale, the gradient norm, a withheld step), zero.py (how ZeRO
holds the weights: each rank's share, the whole weights gathered), autoep.py (AutoEP's MoE layers), initialize.py
(what deepspeed.initialize checks and sets up: the batch size, Muon's flags, the CPU all-reduce's shared memory),
checkpoint_files.py (the files' names and zero_to_fp32), background_save.py (saves written while training goes on)
and universal.py (the universal conversion and its loading).
Each is declared here in PATCHES with the canary test (tests/training/compat/test_deepspeed.py) that fails when it is
no longer right."""
from training.compat import NO_ISSUE, Patch

VERIFIED_FOR = "0.19.8"
CANARIES = "tests/training/compat/test_deepspeed.py::"
PARTS = {  # this package's modules, each with the workarounds it holds
    "sequence_parallel": ("sum_sequence_slices", "use_attention_under_ulysses"),
    "engine_step": ("use_fp16_block_loss_scaling", "zero0_grad_norm", "measure_before_model_step", "withheld_step"),
    "zero": ("local_fp32_shares", "zero_cuts", "zero3_whole_weights", "gathered_16bit_state_dict"),
    "autoep": ("autoep_output_recorders", "autoep_layers"),
    "initialize": ("release_shared_memory_buffer", "without_train_batch_size", "muon_flags"),
    "checkpoint_files": ("expert_files", "pipeline_layer_file", "zero_fp32_weights"),
    "background_save": ("write_in_background",),
    "universal": ("provide_universal_info", "make_stage_neutral", "universal_load_repaired", "loading_universal",
                  "convert_with_tensor_parallel", "universal_weights"),
}


def module_of(name: str) -> str:
    """The module that defines the workaround `name`: its part's, or training.compat for the autotuner's, which runs
    before DeepSpeed is imported."""
    return next((f"{__name__}.{part}" for part, names in PARTS.items() if name in names), "training.compat")


def deepspeed_patch(name: str, why: str, canary: str, issue: str = NO_ISSUE, *, proofs: tuple[str, ...]) -> Patch:
    return Patch(name, "deepspeed", VERIFIED_FOR, why, issue, CANARIES + canary, proofs, module_of(name))


PATCHES = (
    deepspeed_patch("no_mlflow_for_autotuner", "`import deepspeed` imports its autotuner, which imports mlflow when it "
                    "is installed (logging.report_to: mlflow needs it) to log autotuning experiments, which no run "
                    "here makes: 1.1 s of every rank's start. training/__init__.py puts an import finder first that "
                    "refuses mlflow to that module alone, once (the autotuner catches the ImportError)",
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
    deepspeed_patch("universal_weights", "a universal checkpoint is a file format of ds_to_universal's, with no "
                    "reader but the engine's load: each parameter's fp32 master weights are zero/<name>/fp32.pt, a "
                    "dict whose PARAM entry is the whole tensor (load_hp_checkpoint_state reads them so); python -m "
                    "training average reads them", "test_universal_fp32_files_hold_the_param_entry",
                    proofs=("tests/test_resume_anywhere.py::test_a_universal_conversion_averages_as_its_checkpoint",)),
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
    deepspeed_patch("write_in_background", "engine.save_checkpoint writes each file through engine.checkpoint_engine"
                    " (save per file, commit at the end), an attribute set at initialize from the config's built-in "
                    "engines; a BackgroundWriter set there copies each state dict to host memory and writes the "
                    "copies in a thread once commit is called",
                    "test_every_file_of_a_save_goes_through_the_checkpoint_engine",
                    proofs=("tests/training/state/test_saving.py::"
                            "test_asynchronous_saves_train_the_synchronous_curve_at_every_zero_stage",
                            "tests/training/state/test_saving.py::"
                            "test_a_kill_while_a_save_is_written_leaves_the_previous_checkpoint_latest")),
    deepspeed_patch("convert_with_tensor_parallel", "the engine records parallel_dims.tp_degree as the mpu's "
                    "model-parallel size (Ulysses' sequence-parallel size); the converter reads it through the "
                    "private DeepSpeedCheckpoint._lightweight_parallel_dimensions, replaced here",
                    "test_the_converter_reads_the_tensor_parallel_degree_where_it_is_replaced",
                    proofs=("tests/test_resume_anywhere.py::"
                            "test_resumed_run_continues_the_uninterrupted_curve",
                            "tests/test_train.py::"
                            "test_a_sequence_parallel_checkpoint_resumes_in_another_layout_through_a_universal_one")),
)
