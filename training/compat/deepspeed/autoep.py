"""AutoEP, DeepSpeed's expert parallelism for a model's MoE blocks: the output-capture registry it treats as a dict,
and the private mark of the layers it puts in their place (PATCHES, __init__.py)."""
from collections.abc import Iterator
from contextlib import contextmanager

import torch


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
