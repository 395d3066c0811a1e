"""Run through the deepspeed launcher: LoRA on a saved tiny Llama checkpoint, as train.py builds it (the checkpoint
loaded by training/models/model.py, inside zero.Init under ZeRO-3; adapters from training/models/lora.py), a few AdamW
steps under the given ZeRO config (fp32, constant learning rate), each rank on its own batch, then the export. Rank 0
then repeats the steps with plain transformers + peft + torch.optim.AdamW on the mean loss, and loads the export
with plain peft and transformers. Prints as JSON: both runs' losses, the largest difference of the trained
adapters, the engine's logits against the exported adapter's (PeftModel.from_pretrained) and the merged model's,
and the adapter file's size.

    deepspeed --num_gpus N tests/helpers/lora_steps.py BASE_CHECKPOINT OUT_DIR DS_CONFIG
"""
import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import end_process, ranks_main  # noqa: E402
from training.config.recipe import load_recipe  # noqa: E402
from training.loop.optimizer import lr_schedule  # noqa: E402
from training.models.lora import with_lora  # noqa: E402
from training.models.model import build_model, load_model_config  # noqa: E402
from training.parallel import distributed  # noqa: E402
from training.planning.ds_config import load_ds_config, resolve_ds_config  # noqa: E402
from training.planning.shape import (
    lora_config,  # noqa: E402
    weight_decay_groups,  # noqa: E402
)
from training.state.export import export_lora  # noqa: E402

STEPS, ROWS, SEQ_LEN, VOCAB = 3, 2, 32, 256


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ_LEN), generator=torch.Generator().manual_seed(1000 * step + rank))


def compare(base: str, out: str, ds_config_name: str) -> None:
    ranks, rank = dist.get_world_size(), dist.get_rank()
    recipe = load_recipe("tiny_llama_sft", [f"model.name_or_path={base}", f"deepspeed.config={ds_config_name}",
                                            "lora.enabled=true", "lora.rank=4", "lora.dropout=0.0",
                                            "training.lr=1e-2", "training.schedule=constant", "training.warmup_steps=0",
                                            "training.grad_clip=0", "precision=fp32", "export.merge=true",
                                            f"training.micro_batch_size={ROWS}",
                                            f"training.global_batch_size={ROWS * ranks}"])
    config = load_model_config(recipe.model)
    raw, path = load_ds_config(recipe)
    ds_config = resolve_ds_config(raw, path, recipe, config.hidden_size, ranks, "fp32")
    model = with_lora(build_model(recipe, config, ds_config, "fp32"), recipe.lora, recipe.training.seed)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                      model_parameters=weight_decay_groups(model, recipe.training.weight_decay),
                                      lr_scheduler=lr_schedule(recipe.training, STEPS))
    losses = []
    for step in range(STEPS):
        loss = engine(input_ids=batch(rank, step), labels=batch(rank, step)).loss
        engine.backward(loss)
        engine.step()
        losses.append(distributed.all_reduce(loss.detach()).item() / ranks)
    probe = batch(ranks, STEPS)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=probe).logits
    tokenizer = AutoTokenizer.from_pretrained(base)
    export_lora(engine, tokenizer, Path(out), torch.float32, merge=True)
    with deepspeed.zero.GatheredParameters([p for p in engine.module.parameters() if p.requires_grad]):
        trained = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    if rank != 0:
        return

    torch.manual_seed(recipe.training.seed)
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                               lora_config(recipe.lora))
    optimizer = torch.optim.AdamW(weight_decay_groups(reference, recipe.training.weight_decay), lr=recipe.training.lr,
                                  betas=recipe.training.betas, eps=recipe.training.eps)
    reference_losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = sum(reference(input_ids=ids, labels=ids).loss for ids in (batch(r, step) for r in range(ranks))) / ranks
        loss.backward()
        optimizer.step()
        reference_losses.append(loss.item())
    differences = {n: ((p - trained[n]).abs().max() / p.abs().max()).item() for n, p in reference.named_parameters()
                   if p.requires_grad}
    with torch.no_grad():
        untrained = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()(input_ids=probe).logits
        adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                            Path(out) / "adapter").eval()(input_ids=probe).logits
        merged = AutoModelForCausalLM.from_pretrained(Path(out) / "hf",
                                                      dtype=torch.float32).eval()(input_ids=probe).logits
    print(json.dumps({"losses": losses, "reference_losses": reference_losses,
                      "adapter_difference": max(differences.values()), "adapters": len(differences),
                      "engine_vs_exported_adapter": (logits - adapter).abs().max().item(),
                      "adapter_vs_merged": (adapter - merged).abs().max().item(),
                      "logits_moved": (logits - untrained).abs().max().item(),
                      "adapter_bytes": (Path(out) / "adapter" / "adapter_model.safetensors").stat().st_size}))


main = ranks_main(compare)

if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
