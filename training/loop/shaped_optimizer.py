"""The memory-lean optimizers under ZeRO: a library optimizer (torchao's AdamW8bit, torch's Adafactor) stepping
each parameter's share in the parameter's own shape instead of ZeRO's flat partitions.

Under ZeRO 1-3 DeepSpeed hands a client optimizer one flat fp32 tensor per parameter group and rank. Adafactor
would see a 1-D tensor and keep a whole second moment (4 bytes per parameter instead of a row and a column of
each matrix), and AdamW8bit would quantize blocks that span parameters, or keep fp32 states (8 bytes) for a
partition whose length is not a multiple of its 256-value blocks. ShapedOptimizer is what DeepSpeed gets as the
client optimizer: it builds the library optimizer over views of the flat partitions, one per parameter share on
this rank in the parameter's shape (`share_parts`: a share that is not the whole weight is stepped as its whole
rows, with the pieces of a row before and after them flat); at each step it lends the views their slices of the
flat gradient and steps the library optimizer. A parameter a rank holds whole is stepped exactly as without ZeRO;
one that ZeRO-1/2 splits between two ranks (at most two per rank and group), or ZeRO-3 splits into row blocks, is
stepped as its parts (training/planning/optimizer_states.py counts them, docs/optimizers.md says what that
changes).

Embedding weights are marked, so AdamW8bit keeps fp32 moments for them (bitsandbytes' advice for 8-bit Adam): a
token's row gets a gradient only when the batch holds the token, and in a quantized block beside rows with large
gradients its second moment rounds to zero while its first does not, which moves it by up to lr / eps.
"""
from collections.abc import Callable, Iterable

import torch
from deepspeed import DeepSpeedEngine
from torch.optim import Optimizer

from training.compat.deepspeed.zero import local_fp32_shares, weight_shape
from training.compat.torch import plain_optimizer_states, rebuilt_optimizer_states
from training.planning.optimizer_states import share_parts

HYPERPARAMETERS = ("lr", "weight_decay")  # what the schedule and the groups set per step, copied to the library's


class ShapedOptimizer(Optimizer):
    """Library optimizers over per-parameter views of what DeepSpeed hands the client optimizer (module
    docstring). `build` makes them from parameter groups, each marked `embedding` (its views are embedding
    weights) and `outer` (the index of the group it comes from); `defaults` are the groups' settings DeepSpeed and
    the schedule read and write (lr, weight_decay). `attach` must run after deepspeed.initialize."""

    def __init__(self, params: Iterable, build: Callable[[list[dict]], list[Optimizer]], **defaults):
        super().__init__(params, defaults)
        self.build, self.libraries = build, []
        self.parameters = [[p for p in group["params"]] for group in self.param_groups]  # before ZeRO replaces them

    def attach(self, engine: DeepSpeedEngine) -> None:
        """Build the library optimizers over this rank's share of each parameter, in its shape."""
        embeddings = {id(m.weight) for m in engine.module.modules() if isinstance(m, torch.nn.Embedding)}
        groups = []
        for index, (group, parameters) in enumerate(zip(self.param_groups, self.parameters)):
            views = [(id(p) in embeddings, view) for p in parameters
                     for start, size, share in local_fp32_shares(engine, [p])
                     for view in ([share] if share is p else views_of(weight_shape(p), start, size, share))]
            for embedding in (False, True):
                chosen = [view for is_embedding, view in views if is_embedding == embedding and view.numel()]
                if chosen:
                    groups.append({"params": chosen, "embedding": embedding, "outer": index,
                                   **{key: group[key] for key in HYPERPARAMETERS}})
        self.libraries = self.build(groups)
        self.shared = {id(p) for group in self.parameters for p in group}
        # DeepSpeed steps a group at a time, showing param_groups as a list of that group's (same) dict
        self.outer = {id(group): index for index, group in enumerate(self.param_groups)}

    def library_groups(self, group: dict) -> list[dict]:
        """The library optimizers' groups made from `group` (looked up each time: loading their state replaces
        them)."""
        return [library_group for library in self.libraries for library_group in library.param_groups
                if library_group["outer"] == self.outer[id(group)]]

    def step(self, closure: Callable | None = None) -> None:
        assert closure is None, "DeepSpeed steps without a closure"
        lent = []
        for group in self.param_groups:
            for library_group in self.library_groups(group):
                for key in HYPERPARAMETERS:
                    if torch.is_tensor(library_group[key]):  # torchao keeps lr as a tensor: compiled once
                        library_group[key].fill_(group[key])
                    else:
                        library_group[key] = group[key]
                for flat in group["params"]:
                    if flat.grad is not None and id(flat) not in self.shared:  # a ZeRO partition, not the parameter
                        lent += self.lend_gradients(flat, library_group["params"])
        for library in self.libraries:
            library.step()
        for view in lent:
            view.grad = None

    def lend_gradients(self, flat: torch.Tensor, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """Give each view that lies in `flat` its slice of flat.grad, found by address (ZeRO-3 hands the
        partitions over one at a time, ZeRO-1/2 all at once)."""
        begin, end, size = flat.data_ptr(), flat.data_ptr() + flat.nbytes, flat.element_size()
        inside = [v for v in views if begin <= v.data_ptr() < end]
        for view in inside:
            view.grad = flat.grad.narrow(0, (view.data_ptr() - begin) // size, view.numel()).view(view.shape)
        return inside

    def state_dict(self) -> dict:
        """The library optimizers' states, and the groups' settings: the schedule's last learning rate lives only
        here (a torch scheduler's own state does not set it again when loaded)."""
        return {"libraries": [plain_optimizer_states(library.state_dict()) for library in self.libraries],
                "groups": [{key: group[key] for key in HYPERPARAMETERS} for group in self.param_groups]}

    def load_state_dict(self, state_dict: dict) -> None:
        for library, library_state in zip(self.libraries, state_dict["libraries"], strict=True):
            library.load_state_dict(rebuilt_optimizer_states(library_state))
        for group, settings in zip(self.param_groups, state_dict["groups"], strict=True):
            group.update(settings)


def attach_shaped_optimizer(engine: DeepSpeedEngine) -> None:
    """Build the run's ShapedOptimizer's library optimizer, where it has one (the client optimizer, inside ZeRO's
    or the bf16 optimizer's wrapper or on its own)."""
    client = getattr(engine.optimizer, "optimizer", engine.optimizer)
    if isinstance(client, ShapedOptimizer):
        client.attach(engine)


def views_of(shape: tuple[int, ...], start: int, size: int, share: torch.Tensor) -> list[torch.Tensor]:
    """The valid part of a share from `start` of a weight of `shape` and `size` values (ZeRO-3 pads the last
    rank's), as views of the share's storage in share_parts' shapes."""
    numel = max(0, min(share.numel(), size - start))
    return [share.detach().narrow(0, offset, length).view(part) for offset, length, part in
            share_parts(shape, start, numel)] if numel else []


def state_bytes(optimizer: Optimizer) -> int:
    """The bytes an optimizer's states take (the model-state census): each tensor's storage, torchao's quantized
    states as their codes, block scales and code table; step counters left out."""
    optimizers = getattr(optimizer, "libraries", [optimizer])
    return sum(tensor_bytes(value) for optimizer in optimizers for state in optimizer.state.values()
               for key, value in state.items() if torch.is_tensor(value) and key != "step")


def tensor_bytes(tensor: torch.Tensor) -> int:
    if hasattr(tensor, "__tensor_flatten__"):  # a tensor subclass: the tensors it is made of
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.nbytes
