"""training/base/loader.py: a "module:name" string resolves to what it names, or an error naming the string."""
import pytest

from training.base.loader import load
from training.base.strict_json import dumps


def test_a_module_and_name_resolve_to_the_object():
    assert load("training.base.strict_json:dumps") is dumps


@pytest.mark.parametrize("qualified, message", [
    ("training.base.strict_json", r"'training.base.strict_json' is not 'module:name'"),
    ("training.base.strict_json:", r"is not 'module:name'"),
    ("training.base.no_such_module:load", r"'training.base.no_such_module:load' does not resolve: No module named"),
    ("training.base.strict_json:no_such_name", r"'training.base.strict_json:no_such_name' does not resolve: .*"
                                               r"no attribute 'no_such_name'"),
])
def test_a_string_that_does_not_resolve_is_named(qualified, message):
    with pytest.raises(ImportError, match=message):
        load(qualified)
