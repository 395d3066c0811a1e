"""Code named by a "module:name" string (an objective spec's run-time class and memory term), imported where it is
first used: the record that names it, loaded with the recipe's schema, never imports it."""
import importlib
from typing import Any


def load(qualified: str) -> Any:
    """What `qualified` ("package.module:name") names, its module imported; an ImportError naming the string where
    it does not resolve."""
    module, colon, name = qualified.partition(":")
    if not (module and colon and name):
        raise ImportError(f"{qualified!r} is not 'module:name'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(f"{qualified!r} does not resolve: {error}") from error
