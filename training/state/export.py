"""Weights out, as Hugging Face folders: a finished run's engine (export_run: hf/, or a LoRA run's adapter/ and merged
hf/), and a saved checkpoint (`python -m training export`) read with DeepSpeed's own readers; a LoRA checkpoint to
peft's adapter folder.

ZeRO checkpoints (stages 1-3, each rank's partition in its own file) go through DeepSpeed's
`zero_to_fp32` steps, which join the fp32 master weights. Checkpoints without ZeRO partitions hold the
module's weights whole in `mp_rank_00_model_states.pt`: ZeRO-0, and bf16 at ZeRO-0/1, whose
BF16_Optimizer files `zero_to_fp32` refuses ("not a zero checkpoint"); there the module's bf16 weights
are exactly what was trained (the optimizer copies its fp32 master into them after every step).
Tensor-parallel checkpoints hold each model-parallel rank's slices in files of their own (mp_rank_NN): each
rank is read the same way, and the slices are joined along the dimension AutoTP split. Sequence-parallel ranks
hold whole weights (DeepSpeed 0.19.8 saves them as data-parallel ranks of mp_rank_00). Pipeline checkpoints hold
each layer's module weights in a file of its own; expert-parallel ones each expert's (training/parallel/
expert_parallel.py puts them back under the original model's names). A missing or unreadable file is named, as a
damaged checkpoint.
"""
import json
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from training.base.errors import ConfigError
from training.base.output_guard import check_output, owned_files, remove_owned, staged_folder
from training.compat.deepspeed.autoep import autoep_layers
from training.compat.deepspeed.checkpoint_files import (
    expert_files,
    has_zero_partitions,
    model_parallel_ranks,
    zero_fp32_weights,
    zero_rank_files,
)
from training.compat.deepspeed.zero import gathered_16bit_state_dict
from training.models.lora import ADAPTER_CONFIG, ADAPTER_DIR
from training.parallel.distributed import patient_barrier
from training.parallel.expert_parallel import hf_weights, original_weights
from training.parallel.pipeline import hf_name, layer_files
from training.planning.plan import RunPlan
from training.planning.precision import DTYPES
from training.state.checkpoint import READ_ERRORS, RUN_STATE, latest_tag, unreadable_files
from training.state.disk_room import check_room, check_room_to_export


def find_tag(path: Path) -> tuple[Path, str]:
    """(checkpoints folder, tag) for a `checkpoints/` folder (its `latest`) or one `global_stepN/` folder."""
    if tag := latest_tag(path):
        if not (path / tag).is_dir():
            raise ConfigError(f"{path / 'latest'} names {tag!r}, which is no checkpoint folder in {path}; export "
                              f"one checkpoint folder instead: python -m training export {path}/global_stepN OUT_DIR")
        return path, tag
    if (path / RUN_STATE).is_file():
        return path.parent, path.name
    raise ConfigError(f"{path} is neither a checkpoints folder with a `latest` file nor a checkpoint folder "
                      f"with {RUN_STATE} (e.g. outputs/<run>/checkpoints or outputs/<run>/checkpoints/global_step100)")


def cannot_read(path: Path, reason: object) -> ConfigError:
    return ConfigError(f"{path} cannot be read ({reason}): the checkpoint {path.parent} is damaged or partial; export "
                       f"another checkpoint")


def read_file(path: Path) -> dict:
    """One of the checkpoint's files, loaded; a missing or unreadable one is named."""
    if not path.is_file():
        raise ConfigError(f"{path} is missing: the checkpoint {path.parent} is damaged or partial; export another "
                          f"checkpoint")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except READ_ERRORS as error:
        raise cannot_read(path, error) from None


def pipeline_weights(tag_dir: Path, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """A pipeline checkpoint keeps each layer's module weights in `layer_NN-model_states.pt`: the embedding, the
    decoder layers, the final norm and, without tied embeddings, the LM head (a tied one is the embedding's)."""
    weights = {}
    for layer, file in enumerate(layer_files(config)):
        for name, tensor in read_file(tag_dir / file).items():
            weights[hf_name(layer, name, config)] = tensor
    return weights


def model_parallel_weights(tag_dir: Path, tensor_parallel: int) -> list[dict[str, torch.Tensor]]:
    """Each model-parallel rank's weights (a one-rank list for a checkpoint without model parallelism), in fp32
    where the checkpoint has ZeRO's fp32 master weights.

    DeepSpeed's zero_to_fp32 reads model-parallel rank 00 only (and takes the other ranks' files for missing
    data-parallel ones), so its steps run on one rank's files at a time (training/compat/deepspeed/checkpoint_files.py).
    The ranks are the run state's tensor_parallel, or more where DeepSpeed named other ranks so. A bf16 run's optimizer
    files are named bf16_zero_pp_rank_*: ZeRO partitions at ZeRO-2/3, and at ZeRO-0/1 BF16_Optimizer's, which hold no
    ZeRO stage and which zero_to_fp32 refuses; there, as at ZeRO-0, the module's weights are what was trained."""
    ranks, zero_partitions = model_parallel_ranks(tag_dir, tensor_parallel), has_zero_partitions(tag_dir)
    weights = []
    for rank in ranks:
        if not zero_partitions:
            weights.append(read_file(tag_dir / f"{rank}_model_states.pt")["module"])
            continue
        files = zero_rank_files(tag_dir, rank)
        for kind in (kind for kind, paths in files.items() if not paths):
            raise ConfigError(f"{tag_dir} has no {kind} states of {rank} (*{rank}_{kind}_states.pt, of "
                              f"{len(ranks)} model-parallel ranks): the checkpoint is damaged or partial; export "
                              f"another checkpoint")
        weights.append(zero_fp32_weights(tag_dir, files))
    return weights


def join_tensor_parallel(slices: list[dict[str, torch.Tensor]], config: PretrainedConfig,
                         tag_dir: Path) -> dict[str, torch.Tensor]:
    """The whole weights from each model-parallel rank's. AutoTP splits a weight along one dimension (the output
    rows of q/k/v, gate/up and the LM head, the input columns of o and down) and keeps the rest whole on every
    rank: the split dimension is the one where a rank's slice is smaller than the model's weight (built from the
    config), and a weight of the model's shape is a replicated one, taken once (sequence-parallel ranks, which
    DeepSpeed may name as model-parallel ones, hold only such)."""
    with torch.device("meta"):
        shapes = {name: tensor.shape for name, tensor in AutoModelForCausalLM.from_config(config).state_dict().items()}
    weights = {}
    for name, first in slices[0].items():
        parts = [rank[name] for rank in slices]
        full = shapes.get(name, first.shape)
        split = [dim for dim in range(first.dim()) if first.shape[dim] != full[dim]]
        weights[name] = torch.cat(parts, dim=split[0]) if len(split) == 1 else first
        if weights[name].shape != full:
            raise ConfigError(f"{tag_dir}: the {len(parts)} model-parallel slices of {name}, of shapes "
                              f"{', '.join(str(tuple(part.shape)) for part in parts)}, do not join into the model's "
                              f"{tuple(full)}: export with the model config the run trained (its hf/config.json)")
    return weights


def checkpoint_weights(checkpoint_dir: Path, tag: str, config: PretrainedConfig,
                       run_state: dict) -> dict[str, torch.Tensor]:
    tag_dir = checkpoint_dir / tag
    if run_state.get("pipeline_stages", 1) > 1 or any(tag_dir.glob("layer_*-model_states.pt")):
        return pipeline_weights(tag_dir, config)
    if run_state.get("expert_parallel", 1) > 1:  # the module's weights: what was trained (see above)
        return original_weights(read_file(tag_dir / "mp_rank_00_model_states.pt")["module"],
                                         [read_file(path) for path in expert_files(tag_dir)])
    slices = model_parallel_weights(tag_dir, run_state.get("tensor_parallel", 1))
    return slices[0] if len(slices) == 1 else join_tensor_parallel(slices, config, tag_dir)


def written_by_train_py(tag_dir: Path) -> dict:
    """The checkpoint's run state, once it is clear that train.py wrote the checkpoint: its run state names the
    precision, and its hf/ holds the model config and tokenizer that the export needs."""
    if not (tag_dir / RUN_STATE).is_file():
        raise ConfigError(f"{tag_dir} has no {RUN_STATE}: it was not written by train.py. For a DeepSpeed ZeRO "
                          f"checkpoint use DeepSpeed's converter, python {tag_dir.parent / 'zero_to_fp32.py'} "
                          f"{tag_dir.parent} OUT_DIR --safe_serialization, then copy the model's config.json and "
                          f"tokenizer files into OUT_DIR")
    try:
        run_state = json.loads((tag_dir / RUN_STATE).read_bytes())
        precision = run_state["precision"]
    except (ValueError, TypeError, KeyError):
        raise ConfigError(f"{tag_dir / RUN_STATE} is damaged (not JSON with a precision); export another "
                          f"checkpoint, or pass --dtype and repair the file") from None
    if not (tag_dir / "hf" / "config.json").is_file():
        raise ConfigError(f"{tag_dir / 'hf'} has no config.json: the export needs the model config and tokenizer "
                          f"that train.py saves there; copy the model's config.json and tokenizer files into it")
    return {**run_state, "precision": precision}


COMMAND = "python -m training export"


def export_checkpoint(path: Path, out_dir: Path, dtype: str | None = None, overwrite: bool = False) -> Path:
    """The export command: `out_dir` (config, safetensors, tokenizer) from a checkpoint; `dtype` defaults to the
    run's precision. `out_dir` may not hold the checkpoints or lie inside them; an existing one is replaced only with
    `overwrite`, only if an earlier export wrote it, and only once the new export is complete."""
    checkpoint_dir, tag = find_tag(path)
    check_output(out_dir, COMMAND, [checkpoint_dir], overwrite, option="OUT_DIR")
    written_by_train_py(checkpoint_dir / tag)
    with staged_folder(out_dir, COMMAND) as staging:
        export_tag(checkpoint_dir, tag, staging, dtype)
    return checkpoint_dir / tag


def export_tag(checkpoint_dir: Path, tag: str, out_dir: Path, dtype: str | None = None) -> None:
    """Write the checkpoint `tag`'s model (a LoRA checkpoint's adapters) into the folder `out_dir`."""
    tag_dir = checkpoint_dir / tag
    run_state = written_by_train_py(tag_dir)
    if dtype is None and run_state["precision"] not in DTYPES:
        raise ConfigError(f"{tag_dir / RUN_STATE} names precision {run_state['precision']!r}; pass --dtype")
    dtype = DTYPES[dtype or run_state["precision"]]
    config = AutoConfig.from_pretrained(tag_dir / "hf")
    try:
        weights = checkpoint_weights(checkpoint_dir, tag, config, run_state)
    except ConfigError:  # ours, which names the file already
        raise
    except READ_ERRORS as error:  # from DeepSpeed's reader, which names no file, or a file it finds missing
        unreadable = unreadable_files(tag_dir)
        name = next(iter(unreadable), None)
        raise (cannot_read(tag_dir / name, unreadable[name]) if name else
               ConfigError(f"{tag_dir} cannot be read ({error}): a damaged or partial checkpoint; export another "
                           f"one")) from None
    check_room(out_dir, sum(tensor.numel() for tensor in weights.values()) * dtype.itemsize, f"the export of {tag}",
               "free space, or export to another disk; nothing was written")
    if is_lora_checkpoint(tag_dir):
        export_adapters(tag_dir, weights, AutoTokenizer.from_pretrained(tag_dir / "hf"), out_dir, dtype)
    else:
        save_full_model(tag_dir, config, weights, out_dir, dtype)


def meta_model(config: PretrainedConfig) -> torch.nn.Module:
    """The model `config` builds, without weights: what save_pretrained needs besides the weights it is given."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def save_full_model(tag_dir: Path, config: PretrainedConfig, weights: dict[str, torch.Tensor], out_dir: Path,
                    dtype: torch.dtype) -> None:
    model = meta_model(config)
    expected = model.state_dict().keys()
    missing = [name for name in expected if name not in weights and name not in model.all_tied_weights_keys]
    if missing:
        raise ConfigError(f"{tag_dir} lacks weights for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    state_dict = {name: weights[name].to(dtype) for name in expected if name in weights}
    save_hf(model, AutoTokenizer.from_pretrained(tag_dir / "hf"), out_dir, state_dict, dtype)


def export_run(engine: DeepSpeedEngine, plan: RunPlan) -> None:
    """The finished run's weights, every rank calling: hf/ (from_pretrained loads it), or a LoRA run's adapter/ (and hf/
    with the adapters merged under export.merge). A pipeline's stages wrote theirs into the final checkpoint."""
    checkpoints, dtype = plan.output_dir / "checkpoints", DTYPES[plan.precision]
    check_room_to_export(plan, latest_tag(checkpoints))
    if plan.dims.pipeline_stages > 1:
        if dist.get_rank() == 0:
            export_tag(checkpoints, latest_tag(checkpoints), plan.output_dir / "hf")
        patient_barrier()
    elif plan.recipe.lora.enabled:
        export_lora(engine, plan.tokenizer, plan.output_dir, dtype, plan.recipe.export.merge)
    else:
        export_hf(engine, plan.tokenizer, plan.output_dir / "hf", dtype)


def export_hf(engine: DeepSpeedEngine, tokenizer: PreTrainedTokenizerBase, out_dir: Path, dtype: torch.dtype) -> None:
    """A folder that `AutoModelForCausalLM.from_pretrained` loads: config, safetensors weights in `dtype`, tokenizer.

    Every rank must call it: under ZeRO-3 and tensor parallelism the weights are gathered onto rank 0."""
    if engine.zero_optimization_partition_weights() or engine.autotp_size() > 1:
        state_dict = gathered_16bit_state_dict(engine)  # ZeRO-3's and AutoTP's gather onto rank 0
    else:
        state_dict = engine.module.state_dict()
    model = engine.module
    if autoep_layers(model):  # AutoEP's layers: every expert gathered, saved as the original model class
        state_dict, model = hf_weights(engine, state_dict), meta_model(model.config)
    if dist.get_rank() == 0:
        state_dict = {name: tensor.detach().to("cpu", dtype) for name, tensor in state_dict.items()}
        save_hf(model, tokenizer, out_dir, state_dict, dtype)
    patient_barrier()


def save_hf(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, out_dir: Path, state_dict: dict,
            dtype: torch.dtype) -> None:
    """`save_pretrained` with the given weights; the config names their dtype (not the module's). Training turns the
    KV cache off (training/models/model.py), in the config and the generation config the model derived from it;
    the export carries inference's default, the cache on: generate follows generation_config.json's use_cache."""
    config, generation = model.config, getattr(model, "generation_config", None)
    training_cache = config.use_cache, generation.use_cache if generation else None
    config.use_cache = True
    if generation:
        generation.use_cache = True
    model.save_pretrained(out_dir, state_dict=state_dict)
    module_dtype, config.dtype = config.dtype, dtype
    config.save_pretrained(out_dir)
    (config.use_cache, cache), config.dtype = training_cache, module_dtype
    if generation:
        generation.use_cache = cache
    tokenizer.save_pretrained(out_dir)


def adapter_state_dict(engine: DeepSpeedEngine) -> dict[str, torch.Tensor]:
    """The trainable weights, whole on rank 0 (gathered from the ranks under ZeRO-3)."""
    if engine.zero_optimization_partition_weights():
        return gathered_16bit_state_dict(engine, exclude_frozen_parameters=True)
    return {name: p for name, p in engine.module.named_parameters() if p.requires_grad}


def export_lora(engine: DeepSpeedEngine, tokenizer: PreTrainedTokenizerBase, out_dir: Path,
                dtype: torch.dtype, merge: bool) -> None:
    """Every rank calls it. Writes out_dir/adapter (peft's adapter_model.safetensors and adapter_config.json, for
    PeftModel.from_pretrained over the base model) and, with `merge`, out_dir/hf: the base weights with the
    adapters merged (peft's merge_and_unload on a copy built on rank 0's CPU from the gathered weights)."""
    model: PeftModel = engine.module
    adapters = adapter_state_dict(engine)
    if merge:
        full = gathered_16bit_state_dict(engine) if engine.zero_optimization_partition_weights() \
            else model.state_dict()
    if dist.get_rank() == 0:
        adapters = {name: tensor.detach().to("cpu", dtype) for name, tensor in adapters.items()}
        folder = out_dir / ADAPTER_DIR
        # a resumed run's earlier adapters; not a user's file
        remove_owned(out_dir, owned_files(out_dir, ADAPTER_DIR), ADAPTER_DIR)
        model.save_pretrained(folder, state_dict=adapters)
        tokenizer.save_pretrained(folder)
        if merge:
            save_merged(model, {name: t.detach().to("cpu", torch.float32) for name, t in full.items()}, tokenizer,
                        out_dir / "hf", dtype)
    patient_barrier()


def save_merged(model: PeftModel, state_dict: dict[str, torch.Tensor], tokenizer: PreTrainedTokenizerBase,
                out_dir: Path, dtype: torch.dtype) -> None:
    """The adapters merged into the base weights in fp32 (peft's merge_and_unload, on a copy of the model built on the
    meta device and given the gathered weights), saved in `dtype`."""
    with torch.device("meta"):
        copy = get_peft_model(AutoModelForCausalLM.from_config(model.get_base_model().config),
                              model.peft_config["default"])
    missing = copy.load_state_dict(state_dict, strict=False, assign=True).missing_keys
    merged = copy.merge_and_unload()
    merged.tie_weights()
    still_meta = [name for name, p in merged.named_parameters() if p.is_meta]
    if still_meta:
        raise RuntimeError(f"merging the adapters: no gathered weights for {still_meta[:3]} (missing {missing[:3]})")
    save_hf(merged, tokenizer, out_dir, {name: t.to(dtype) for name, t in merged.state_dict().items()}, dtype)


def is_lora_checkpoint(tag_dir: Path) -> bool:
    return (tag_dir / "hf" / ADAPTER_CONFIG).is_file()


def export_adapters(tag_dir: Path, weights: dict[str, torch.Tensor], tokenizer: PreTrainedTokenizerBase,
                    out_dir: Path, dtype: torch.dtype) -> None:
    """A LoRA checkpoint's trained weights as peft's adapter folder (its names and format, through a copy of the
    model built on the meta device)."""
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tag_dir / "hf")),
                               LoraConfig.from_pretrained(tag_dir / "hf"))
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name in trained if name not in weights]
    if missing:
        raise ConfigError(f"{tag_dir} lacks the adapter weights {', '.join(missing[:3])}: a damaged checkpoint, or "
                          f"one of other adapters than {tag_dir / 'hf' / ADAPTER_CONFIG}; export another one")
    model.save_pretrained(out_dir, state_dict={name: weights[name].to(dtype) for name in trained})
    tokenizer.save_pretrained(out_dir)
