"""The start-up version check (training/compat/__init__.py check_versions) and the pins it is verified against."""
import re

import pytest

import training.compat as compat
from tests.conftest import REPO


def pins() -> dict[str, str]:
    text = (REPO / "requirements.txt").read_text() + (REPO / "requirements-scale.txt").read_text()
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", text, re.M))


@pytest.mark.parametrize("library", compat.LIBRARIES)
def test_each_library_is_verified_for_its_pin(library):
    """On a pin bump this fails: run tests/training/compat, then set the module's VERIFIED_FOR (docs/compat.md)."""
    assert {patch.verified_for for patch in compat.patches(library)} == {pins()[library]}


def test_matching_versions_print_nothing(monkeypatch, capsys):
    monkeypatch.setattr(compat, "installed_version", lambda library: pins()[library] + ("+cpu" * (library == "torch")))
    assert compat.check_versions(compat.LIBRARIES) == [] and capsys.readouterr().err == ""


def test_another_version_names_its_patches_in_one_warning(monkeypatch, capsys):
    monkeypatch.setattr(compat, "installed_version", lambda library: "0.20.0" if library == "deepspeed" else pins()[library])
    found = compat.check_versions()
    assert {patch.library for patch, _ in found} == {"deepspeed"} and len(found) == len(compat.patches("deepspeed"))
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and warning.startswith("warning: ")
    assert "deepspeed.sum_sequence_slices (verified for 0.19.8, installed 0.20.0)" in warning
    assert compat.check_versions(show=False) and capsys.readouterr().err == ""  # ranks other than local rank 0


def test_a_missing_optional_library_has_no_active_patches(monkeypatch, capsys):
    monkeypatch.setattr(compat, "installed_version", lambda library: None if library in ("peft", "datatrove")
                        else pins()[library])
    assert compat.check_versions(compat.LIBRARIES) == [] and capsys.readouterr().err == ""
