"""Health metrics of the weights, logged beside the loss: the parameter norm and the update-to-weight ratio (an
update far above ~1e-3 of the weights is a learning rate too high for them; far below, one too low). Read, never
acted on: the stability guard (training/loop/stability.py) decides on the loss and gradient norm."""
import numpy as np
import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine

from training.compat.deepspeed.zero import local_fp32_shares

SAMPLE = 4096  # weights per parameter tensor (and rank) that the update-to-weight ratio is measured on


def fp32_shares(engine: DeepSpeedEngine) -> list[tuple[int, int, torch.Tensor]]:
    """This rank's fp32 share of each trained weight (training/compat/deepspeed/zero.py local_fp32_shares)."""
    return local_fp32_shares(engine, [p for p in engine.module.parameters() if p.requires_grad])


class WeightWatch:
    """The parameter norm and the update-to-weight ratio (|update| / |weights|) at logging steps. The norm is over
    every weight; the ratio over the first SAMPLE elements of each weight tensor, copied to the host before the
    step (no second copy of the model; as NumPy arrays, which are not model state and stay out of the measured
    model-state census): the same elements whatever the ranks and ZeRO stage. Under ZeRO each rank holds a
    disjoint share and the sums are reduced over the ranks; without ZeRO every rank holds all of it."""

    def __init__(self, engine: DeepSpeedEngine):
        self.engine, self.before = engine, None

    def sample(self) -> list[np.ndarray]:
        return [np.array(share.detach().reshape(-1)[:max(0, min(SAMPLE, size) - start)].float().cpu(), copy=True)
                for start, size, share in fp32_shares(self.engine)]  # a copy: on a CPU .numpy() would share memory

    def remember(self) -> None:
        self.before = self.sample()

    def measure(self) -> dict:
        """After the step: `param_norm` and `update_ratio` (the step's update over the sampled weights)."""
        device = self.engine.device  # the weights may be offloaded to the CPU
        squares = sum((share.float().square().sum().to(device) for _, _, share in fp32_shares(self.engine)),
                      torch.zeros((), device=device))
        after = self.sample()
        update = sum(float(np.square(a - b, dtype=np.float64).sum()) for a, b in zip(after, self.before))
        sampled = sum(float(np.square(a, dtype=np.float64).sum()) for a in after)
        sums = torch.stack([squares.double(), torch.tensor(update, device=device, dtype=torch.float64),
                            torch.tensor(sampled, device=device, dtype=torch.float64)])
        if self.engine.zero_optimization():
            dist.all_reduce(sums)
        norm, update, sampled = sums.sqrt().tolist()
        return {"param_norm": norm, "update_ratio": update / sampled if sampled else 0.0}
