import pytest

from training.errors import ConfigError
from training.precision import device_type, resolve_precision

cpu_only = pytest.mark.skipif(device_type() != "cpu", reason="checks DeepSpeed's CPU accelerator")


@cpu_only
def test_auto_is_fp32_on_a_cpu():
    assert resolve_precision("auto", {"bf16": {"enabled": "auto"}}) == "fp32"


def test_auto_follows_a_config_that_enables_a_half_precision():
    assert resolve_precision("auto", {"bf16": {"enabled": True}}) == "bf16"


@cpu_only
def test_fp16_on_a_cpu_is_refused_with_the_alternatives():
    with pytest.raises(ConfigError, match="precision=fp16 needs an NVIDIA GPU.*Use precision=bf16 or precision=fp32"):
        resolve_precision("fp16", {})


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_explicit_precisions_are_kept(precision):
    assert resolve_precision(precision, {}) == precision
