"""Run through the deepspeed launcher: a few optimizer steps of a tiny Llama under the resolved DeepSpeed config
of tiny_llama with the given optimizer and each given ZeRO config in turn (fp32, constant learning rate), each rank
on its own batch; rank 0 then repeats them without DeepSpeed on the mean gradient and prints, per config, one JSON
line: both runs' weights' largest difference (relative to each weight's largest value), the smallest relative
update, and each rank's optimizer-state bytes (the census) beside the plan's.

The reference for AdamW, Lion and Muon is a plain-PyTorch implementation of the update, written from the papers.
For AdamW8bit and Adafactor it is the library optimizer itself (torchao's, torch's) on the model's weights, and,
since ZeRO steps a weight split between ranks as its pieces (training/loop/shaped_optimizer.py), the same library
optimizer on the pieces as training/planning/optimizer_states.py says DeepSpeed cuts them: `whole_weights` is the
difference over the weights no rank splits against the first, `all_weights` over every weight against the second.

    deepspeed --num_gpus N tests/helpers/optimizer_steps.py OPTIMIZER DS_CONFIG [DS_CONFIG ...]
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
from torchao.optim import AdamW8bit
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import end_process, ranks_main  # noqa: E402
from training.config.optimizers import OPTIMIZERS  # noqa: E402
from training.config.recipe import load_recipe  # noqa: E402
from training.loop.optimizer import client_optimizer, lr_schedule  # noqa: E402
from training.loop.shaped_optimizer import (
    attach_shaped_optimizer,  # noqa: E402
    state_bytes,  # noqa: E402
)
from training.planning.ds_config import load_ds_config, resolve_ds_config  # noqa: E402
from training.planning.optimizer_states import rank_shares, rank_state_bytes  # noqa: E402
from training.planning.shape import (  # noqa: E402
    decoder_layers,  # noqa: E402
    model_shape,
    weight_decay_groups,
)

STEPS, ROWS, SEQ_LEN, VOCAB = 3, 2, 32, 256
LR = {"adamw": 1e-3, "adamw8bit": 1e-3, "adafactor": 1e-3, "lion": 3e-4, "muon": 1e-3}


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


def library_optimizers(name: str, groups: list[dict], settings: dict) -> list[torch.optim.Optimizer]:
    """torch's Adafactor; torchao's AdamW8bit, with torch's AdamW on the embeddings (as bitsandbytes advises)."""
    if name == "adafactor":
        return [torch.optim.Adafactor(groups, lr=settings["lr"])]
    adam = {"lr": settings["lr"], "betas": settings["betas"], "eps": settings["eps"]}
    chosen = [(library, [g for g in groups if g["embedding"] == embedding])
              for library, embedding in ((AdamW8bit, False), (torch.optim.AdamW, True))]
    return [library(library_groups, **adam) for library, library_groups in chosen if library_groups]


class Pieces:
    """The library optimizers on each weight cut as `cuts` (weight index, start, numel, shape) over all ranks, each
    piece a tensor of its own; `step` copies the stepped pieces back into the weights."""

    def __init__(self, name: str, model: torch.nn.Module, cuts: list, settings: dict, weight_decay: float):
        groups = weight_decay_groups(model, weight_decay)
        self.weights = [p for group in groups for p in group["params"]]
        decays = [group["weight_decay"] for group in groups for _ in group["params"]]
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        self.cuts = cuts
        self.pieces = [self.weights[i].detach().reshape(-1)[start:start + numel].clone().view(shape)
                       for i, start, numel, shape in cuts]
        kinds = [(decays[i], id(self.weights[i]) in embeddings) for i, *_ in cuts]
        self.optimizers = library_optimizers(name, [
            {"params": [piece for piece, k in zip(self.pieces, kinds) if k == kind], "weight_decay": kind[0],
             "embedding": kind[1]} for kind in sorted(set(kinds))], settings)

    def step(self) -> None:
        for piece, (i, start, numel, _) in zip(self.pieces, self.cuts):
            piece.grad = self.weights[i].grad.reshape(-1)[start:start + numel].clone().view(piece.shape)
        for optimizer in self.optimizers:
            optimizer.step()
        for piece, (i, start, numel, _) in zip(self.pieces, self.cuts):
            self.weights[i].data.view(-1)[start:start + numel] = piece.reshape(-1)


def reference_run(name: str, model: torch.nn.Module, ranks: int, settings: dict, weight_decay: float,
                  cuts: list | None = None) -> None:
    """STEPS steps of the reference update on the mean gradient of the ranks' batches."""
    groups = weight_decay_groups(model, weight_decay)
    matrices = {id(p) for p in decoder_layers(model).parameters() if p.ndim >= 2}
    if OPTIMIZERS[name].shaped:
        stepper = Pieces(name, model, cuts, settings, weight_decay)
    state = {}
    for step in range(STEPS):
        model.zero_grad()
        loss = sum(model(input_ids=ids, labels=ids).loss for ids in (batches(r, step) for r in range(ranks)))
        (loss / ranks).backward()
        with torch.no_grad():
            if OPTIMIZERS[name].shaped:
                stepper.step()
            else:
                reference_step(name, groups, matrices, state, settings)


def relative_differences(model: torch.nn.Module, trained: dict) -> dict:
    return {n: ((p - trained[n]).abs().max() / p.abs().max()).item() for n, p in model.named_parameters()}


def run(name: str, ds_config_name: str, config: AutoConfig) -> None:
    ranks, rank = dist.get_world_size(), dist.get_rank()
    recipe = load_recipe("tiny_llama", [f"optimizer.name={name}", f"deepspeed.config={ds_config_name}",
                                        f"training.lr={LR[name]}", "training.schedule=constant",
                                        "training.warmup_steps=0", "training.grad_clip=0", "precision=fp32",
                                        f"training.micro_batch_size={ROWS}",
                                        f"training.global_batch_size={ROWS * ranks}"])
    raw, path = load_ds_config(recipe)
    ds_config = resolve_ds_config(raw, path, recipe, 64, ranks, "fp32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reference = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = start_engine(model, ds_config, recipe)
    for step in range(STEPS):
        input_ids = batches(rank, step)
        engine.backward(engine(input_ids=input_ids, labels=input_ids).loss)
        engine.step()
    census = torch.tensor([0] * ranks)
    census[rank] = state_bytes(getattr(engine.optimizer, "optimizer", engine.optimizer))  # inside ZeRO's, or alone
    dist.all_reduce(census)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        trained = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    if rank != 0:
        return
    stage, shape = int(ds_config["zero_optimization"]["stage"]), model_shape(config)
    settings = {"lr": LR[name], "betas": recipe.training.betas, "eps": recipe.training.eps,
                "muon_lr": recipe.optimizer.muon_lr, "momentum": recipe.optimizer.muon_momentum}
    report = {"config": ds_config_name, "state_bytes": census.tolist()}
    if OPTIMIZERS[name].shaped:
        cuts = [cut for r in range(ranks) for cut in rank_shares(shape.trained_shapes, stage, ranks, r)]
        name_of = {id(p): n for n, p in reference.named_parameters()}
        weights = [p for group in weight_decay_groups(reference, 0.0) for p in group["params"]]
        split = {name_of[id(weights[i])] for i, _, numel, _ in cuts if numel < weights[i].numel()}
        pieces = copy.deepcopy(reference)
        reference_run(name, reference, ranks, settings, recipe.training.weight_decay,
                      rank_shares(shape.trained_shapes, 0, 1, 0))
        reference_run(name, pieces, ranks, settings, recipe.training.weight_decay, cuts)
        whole, differences = relative_differences(reference, trained), relative_differences(pieces, trained)
        report |= {"planned_state_bytes": rank_state_bytes(name, shape, stage, ranks), "split": sorted(split),
                   "whole_weights": max((v for n, v in whole.items() if n not in split), default=None),
                   "unsplit_reference": max(whole.values()), "all_weights": max(differences.values())}
    else:
        reference_run(name, reference, ranks, settings, recipe.training.weight_decay)
        differences = relative_differences(reference, trained)
    updates = {n: ((p - initial[n]).abs().max() / initial[n].abs().max()).item()
               for n, p in reference.named_parameters()}
    print(json.dumps(report | {"max_relative_difference": max(differences.values()),
                               "worst": max(differences, key=differences.get),
                               "smallest_relative_update": min(updates.values())}), flush=True)


def start_engine(model: torch.nn.Module, ds_config: dict, recipe) -> deepspeed.DeepSpeedEngine:
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, optimizer=client_optimizer(ds_config),
                                      model_parameters=weight_decay_groups(model, recipe.training.weight_decay),
                                      lr_scheduler=lr_schedule(recipe.training, STEPS))
    attach_shaped_optimizer(engine)
    return engine


def compare(name: str, *ds_configs: str) -> None:
    # DeepSpeed's Muon runs Newton-Schulz in fp16 or bf16 by design (2e-3 to 4e-2 of the update off the fp32
    # iteration, measured): the comparison runs it in fp32, where its Gram-matrix form and the quintic
    # iteration below agree to 4e-6 of the update
    original_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32
    config = AutoConfig.for_model("llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)
    for ds_config_name in ds_configs:
        run(name, ds_config_name, config)


main = ranks_main(compare)

if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
