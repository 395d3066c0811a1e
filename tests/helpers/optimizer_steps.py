"""Run through the deepspeed launcher: a few optimizer steps of a tiny Llama under the resolved DeepSpeed config
of tiny_llama with the given optimizer and ZeRO config (fp32, constant learning rate), each rank on its own
batch; rank 0 then repeats them with a plain-PyTorch implementation of the same update, written from the
papers, on the mean gradient, and prints as JSON both runs' weights' largest difference (relative to each
weight's largest value), the smallest relative update, and the bytes of rank 0's optimizer states.

    deepspeed --num_gpus N tests/helpers/optimizer_steps.py OPTIMIZER DS_CONFIG
"""
import copy
import json
import math
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.zero.muon import original_muon
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from training.parallel import distributed  # noqa: E402
from training.config.ds_config import load_ds_config, resolve_ds_config  # noqa: E402
from training.loop.optimizer import client_optimizer, lr_schedule, weight_decay_groups  # noqa: E402
from training.config.recipe import load_recipe  # noqa: E402
from training.planning.shape import decoder_layers  # noqa: E402
from tests.helpers import end_process  # noqa: E402

STEPS, ROWS, SEQ_LEN, VOCAB = 3, 2, 32, 256
LR = {"adamw": 1e-3, "lion": 3e-4, "muon": 1e-3}


def newton_schulz(update: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's orthogonalization (Jordan et al. 2024): the quintic Newton-Schulz iteration on the update scaled
    to spectral norm at most 1, on its wide orientation."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update / (update.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def reference_step(name: str, groups: list[dict], matrices: set[int], state: dict, settings: dict) -> None:
    """One step of AdamW (torch.optim.AdamW's rule), Lion (Chen et al. 2023) or Muon with AdamW on the rest."""
    lr, (beta1, beta2), eps = settings["lr"], settings["betas"], settings["eps"]
    for group in groups:
        for p in group["params"]:
            g, s, decay = p.grad, state.setdefault(p, {"step": 0}), group["weight_decay"]
            if name == "muon" and id(p) in matrices:
                buf = s.setdefault("momentum", torch.zeros_like(p))
                buf.lerp_(g, 1 - settings["momentum"])
                update = newton_schulz(g.lerp(buf, settings["momentum"])) * math.sqrt(max(1, p.shape[0] / p.shape[1]))
                p.mul_(1 - settings["muon_lr"] * decay).add_(update, alpha=-settings["muon_lr"])
            elif name == "lion":
                m = s.setdefault("momentum", torch.zeros_like(p))
                p.mul_(1 - lr * decay).add_((beta1 * m + (1 - beta1) * g).sign(), alpha=-lr)
                m.mul_(beta2).add_(g, alpha=1 - beta2)
            else:  # AdamW
                m, v = s.setdefault("m", torch.zeros_like(p)), s.setdefault("v", torch.zeros_like(p))
                s["step"] += 1
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denominator = (v / (1 - beta2 ** s["step"])).sqrt() + eps
                p.mul_(1 - lr * decay).addcdiv_(m, denominator, value=-lr / (1 - beta1 ** s["step"]))


def batches(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ_LEN), generator=torch.Generator().manual_seed(1000 * step + rank))


def main(name: str, ds_config_name: str) -> None:
    # DeepSpeed's Muon runs Newton-Schulz in fp16 or bf16 by design (2e-3 to 4e-2 of the update off the fp32
    # iteration, measured): the comparison runs it in fp32, where its Gram-matrix form and the quintic
    # iteration below agree to 4e-6 of the update
    original_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32
    distributed.init_distributed()
    ranks, rank = dist.get_world_size(), dist.get_rank()
    recipe = load_recipe("tiny_llama", [f"optimizer.name={name}", f"deepspeed.config={ds_config_name}",
                                        f"training.lr={LR[name]}", "training.schedule=constant",
                                        "training.warmup_steps=0", "training.grad_clip=0", "precision=fp32",
                                        f"training.micro_batch_size={ROWS}",
                                        f"training.global_batch_size={ROWS * ranks}"])
    raw, path = load_ds_config(recipe)
    ds_config = resolve_ds_config(raw, path, recipe, 64, ranks, "fp32")
    config = AutoConfig.for_model("llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reference = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, optimizer=client_optimizer(ds_config),
                                      model_parameters=weight_decay_groups(model, recipe.training.weight_decay),
                                      lr_scheduler=lr_schedule(recipe.training, STEPS))
    for step in range(STEPS):
        input_ids = batches(rank, step)
        engine.backward(engine(input_ids=input_ids, labels=input_ids).loss)
        engine.step()
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch optimizer inside ZeRO's
    state_bytes = sum(t.nbytes for state in inner.state.values() for t in state.values()
                      if torch.is_tensor(t) and t.numel() > 1)  # moments, momenta; not step counters
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        trained = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    if rank != 0:
        return
    groups = weight_decay_groups(reference, recipe.training.weight_decay)
    matrices = {id(p) for p in decoder_layers(reference).parameters() if p.ndim >= 2}
    settings = {"lr": LR[name], "betas": recipe.training.betas, "eps": recipe.training.eps,
                "muon_lr": recipe.optimizer.muon_lr, "momentum": recipe.optimizer.muon_momentum}
    state = {}
    for step in range(STEPS):
        reference.zero_grad()
        loss = sum(reference(input_ids=ids, labels=ids).loss for ids in (batches(r, step) for r in range(ranks)))
        (loss / ranks).backward()
        with torch.no_grad():
            reference_step(name, groups, matrices, state, settings)
    differences = {n: ((p - trained[n]).abs().max() / p.abs().max()).item() for n, p in reference.named_parameters()}
    updates = {n: ((p - initial[n]).abs().max() / initial[n].abs().max()).item() for n, p in reference.named_parameters()}
    print(json.dumps({"state_bytes": state_bytes, "max_relative_difference": max(differences.values()),
                      "worst": max(differences, key=differences.get), "smallest_relative_update": min(updates.values())}))


if __name__ == "__main__":
    main(*[arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")])
    end_process()
