"""The registry of upstream workarounds (training/compat/__init__.py): each patch defined, with its canary, its proofs
and its line in docs/compat.md, and the start-up version check against the pins."""
import importlib
import re

import pytest

import training.compat as compat
from tests.conftest import REPO, train_in_process


def pins() -> dict[str, str]:
    text = (REPO / "requirements.txt").read_text()
    pinned = re.findall(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", text, re.M)
    return {name.replace("-", "_"): version for name, version in pinned}  # lm-eval: lm_eval, its module's name


@pytest.mark.parametrize("library", compat.LIBRARIES)
def test_each_library_is_verified_for_its_pin(library):
    """On a pin bump this fails: run tests/training/compat, then set the module's VERIFIED_FOR (docs/compat.md)."""
    assert {patch.verified_for for patch in compat.patches(library)} == {pins()[library]}


def test_matching_versions_print_nothing(monkeypatch, capsys):
    monkeypatch.setattr(compat, "installed_version", lambda library: pins()[library] + ("+cpu" * (library == "torch")))
    assert compat.check_versions(compat.LIBRARIES) == [] and capsys.readouterr().err == ""


def test_another_version_names_its_patches_in_one_warning(monkeypatch, capsys):
    monkeypatch.setattr(compat, "installed_version",
                        lambda library: "0.20.0" if library == "deepspeed" else pins()[library])
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


def names_a_test(reference: str) -> bool:
    """Whether `tests/path.py::test_name` names a test function that exists."""
    path, name = reference.split("::")
    return f"\ndef {name}(" in (REPO / path).read_text()


@pytest.mark.parametrize("library", compat.LIBRARIES)
def test_each_patch_is_defined_and_has_its_canary_and_its_proof(library):
    for patch in compat.patches(library):
        module = importlib.import_module(patch.defined_in)
        assert callable(getattr(module, patch.name, None)), f"{library}.{patch.name} is declared but not defined"
        assert patch.canary.startswith("tests/training/compat/") and names_a_test(patch.canary), patch
        assert all(names_a_test(proof) for proof in patch.proofs) and patch.proofs, patch


def test_docs_list_every_patch():
    listed = (REPO / "docs/compat.md").read_text()
    missing = [f"{patch.library}.{patch.name}" for library in compat.LIBRARIES for patch in compat.patches(library)
               if f"`{patch.name}`" not in listed]
    assert not missing, f"docs/compat.md does not list {missing}"


def test_train_py_warns_once_before_its_plan(monkeypatch):
    monkeypatch.setattr(compat, "installed_version",
                        lambda library: "0.20.0" if library == "deepspeed" else pins()[library])
    result = train_in_process(["--recipe", "tiny_llama", "--dry-run"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("warning: upstream workarounds unverified for the installed versions") == 1
