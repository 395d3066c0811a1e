"""Command-line overrides, `key.path=value` with a YAML value, applied to a recipe's tree before it is validated."""
from typing import Any

import yaml

from training.base.errors import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, value = text.partition("=")
    if not sep or not key or "" in key.split("."):
        raise ConfigError(f"override '{text}' is not of the form key.path=value (e.g. training.max_steps=20)")
    try:
        return key.split("."), yaml.safe_load(value)
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"override '{text}': the value is not valid YAML ({problem}); write it as YAML, e.g. "
                          f"training.betas=[0.9,0.95], and quote the whole override in the shell") from None


def apply_override(tree: dict, path: list[str], value: Any, text: str) -> None:
    """Set `value` at `path`, creating missing mappings; list items are addressed by their index."""
    node = tree
    for depth, part in enumerate(path[:-1]):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            raise ConfigError(f"override '{text}': {'.'.join(path[:depth + 1])} is a {type(node).__name__}, "
                              f"not a mapping")
    last = path[-1]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"override '{text}': {'.'.join(path[:-1])} is a {type(node).__name__}, not a mapping")
