"""DeepSpeed's checkpoint files: their names (per pipeline layer, model-parallel rank and expert) and zero_to_fp32's
steps on one model-parallel rank's files (PATCHES, __init__.py)."""
import re
from pathlib import Path

import torch
from deepspeed.utils import zero_to_fp32


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
