"""DeepSpeed checkpoints in DeepSpeed's own layout, and the Hugging Face export."""
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from transformers import PreTrainedTokenizerBase

from training.errors import ConfigError

TAG = re.compile(r"global_step(\d+)")


def checkpoint_tags(checkpoint_dir: Path) -> list[str]:
    """Tag folders in step order."""
    tags = [p.name for p in checkpoint_dir.glob("global_step*") if p.is_dir() and TAG.fullmatch(p.name)]
    return sorted(tags, key=lambda tag: int(TAG.fullmatch(tag).group(1)))


def data_state_file(checkpoint_dir: Path, tag: str) -> Path:
    return checkpoint_dir / tag / f"data_state_rank{dist.get_rank()}.pt"


def save_checkpoint(engine: DeepSpeedEngine, checkpoint_dir: Path, step: int, data_state: dict,
                    keep_last: int | None) -> None:
    """`checkpoints/global_step{N}/` plus DeepSpeed's `latest` file and zero_to_fp32.py script. Each rank's
    data position goes in a file of its own (a streaming rank reads its own shard), written before
    DeepSpeed writes `latest`."""
    tag = f"global_step{step}"
    data_state_file(checkpoint_dir, tag).parent.mkdir(parents=True, exist_ok=True)
    torch.save(data_state, data_state_file(checkpoint_dir, tag))
    engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state={"step": step})
    if keep_last and dist.get_rank() == 0:
        for tag in checkpoint_tags(checkpoint_dir)[:-keep_last]:
            shutil.rmtree(checkpoint_dir / tag)
    dist.barrier()


def load_latest_checkpoint(engine: DeepSpeedEngine, checkpoint_dir: Path) -> tuple[int, dict]:
    """Restore weights, optimizer and scheduler from the tag named in `latest`; returns its step and this
    rank's data position."""
    path, client_state = engine.load_checkpoint(str(checkpoint_dir))
    if path is None:
        raise ConfigError(f"--resume: no checkpoint could be loaded from {checkpoint_dir}")
    tag = (checkpoint_dir / "latest").read_text().strip()
    return client_state["step"], torch.load(data_state_file(checkpoint_dir, tag), weights_only=False)


def export_hf(engine: DeepSpeedEngine, tokenizer: PreTrainedTokenizerBase, out_dir: Path, dtype: torch.dtype) -> None:
    """A folder that `AutoModelForCausalLM.from_pretrained` loads: config, safetensors weights in `dtype`, tokenizer.

    Every rank must call it: under ZeRO-3 the weights are gathered layer by layer onto rank 0."""
    if engine.zero_optimization_partition_weights():
        state_dict = engine._zero3_consolidated_16bit_state_dict()  # the gather accelerate's get_state_dict uses
    else:
        state_dict = engine.module.state_dict()
    if dist.get_rank() == 0:
        model = engine.module
        state_dict = {name: tensor.detach().to("cpu", dtype) for name, tensor in state_dict.items()}
        model.config.use_cache = True  # training turned the KV cache off; inference wants it
        model.save_pretrained(out_dir, state_dict=state_dict)
        model.config.use_cache = False
        tokenizer.save_pretrained(out_dir)
    dist.barrier()
