"""Every workaround of upstream behaviour, in one guarded place: a module per library (torch.py, transformers.py,
peft.py, datasets.py, datatrove.py, wandb.py, lm_eval.py, trl.py; DeepSpeed's are a package, deepspeed/, a module per
part of DeepSpeed: sequence_parallel.py, engine_step.py, zero.py, autoep.py, initialize.py, checkpoint_files.py,
universal.py), and the only place that reads upstream's private names (tests/training/compat/test_private_names.py).
Each library's module declares its PATCHES: what upstream does, in which version the workaround was verified, the
upstream issue, the canary test (tests/training/compat/) that fails when the patched name disappears, when upstream
stops calling it, or when upstream fixes the behaviour, and the tests that prove the workaround (they fail without
it).

check_versions, called once at start-up, warns in one line when an installed library is another version than
the one its patches were verified for (docs/compat.md: what to do on a pin bump)."""
import importlib
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from importlib.machinery import ModuleSpec

NO_ISSUE = "no upstream issue found"
# each a module (or package) here, named as on PyPI (lm-eval as lm_eval, the name it is imported by)
LIBRARIES = ("torch", "deepspeed", "transformers", "peft", "datasets", "datatrove", "wandb", "lm_eval", "trl")


@dataclass(frozen=True)
class Patch:
    """One workaround: `name` is the function here that holds it, `why` what upstream does (in `verified_for`)."""
    name: str
    library: str
    verified_for: str
    why: str
    issue: str
    canary: str  # the test in tests/training/compat/ that fails when the workaround is no longer right
    proofs: tuple[str, ...]  # the tests that fail without it: what it is for, measured
    module: str | None = None  # the module that defines `name`, where not the library's own (deepspeed's parts)

    @property
    def defined_in(self) -> str:
        """The module that defines `name`: `module`, or training.compat.<library>."""
        return self.module or f"training.compat.{self.library}"


def release(version: str) -> str:
    """The release part of a version: '2.13.0+cpu' -> '2.13.0' (a local build of the same release)."""
    return version.split("+", 1)[0]


def installed_version(library: str) -> str | None:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return None


def patches(library: str) -> tuple[Patch, ...]:
    """The library's declared patches (importing its module here)."""
    return importlib.import_module(f"training.compat.{library}").PATCHES


def unverified(libraries: tuple[str, ...] = LIBRARIES) -> list[tuple[Patch, str]]:
    """(patch, installed version) for each patch whose library is installed in another release than the one it
    was verified for. A library that is not installed has no active patches."""
    found = []
    for library in libraries:
        version = installed_version(library)
        if version is None or importlib.util.find_spec(library) is None:
            continue
        found += [(patch, version) for patch in patches(library) if release(version) != patch.verified_for]
    return found


def check_versions(libraries: tuple[str, ...] = LIBRARIES, show: bool = True) -> list[tuple[Patch, str]]:
    """One warning line on stderr naming the patches whose upstream assumptions are unverified for the installed
    versions; nothing when every version matches. A warning only: the run goes on. `show`: whether this process
    prints it (local rank 0: each node once, since nodes may differ in what they have installed)."""
    found = unverified(libraries)
    if found and show:
        named = ", ".join(f"{patch.library}.{patch.name} (verified for {patch.verified_for}, installed {version})"
                          for patch, version in found)
        print(f"warning: upstream workarounds unverified for the installed versions: {named}; run "
              f"pytest tests/training/compat and see docs/compat.md", file=sys.stderr, flush=True)
    return found


AUTOTUNER = "deepspeed.autotuning.autotuner"


class MlflowRefusedToAutotuner:
    """An import finder that refuses mlflow to DeepSpeed's autotuner, once, and then leaves sys.meta_path."""

    def find_spec(self, name: str, path=None, target=None) -> ModuleSpec | None:
        if name != "mlflow":
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__") != AUTOTUNER:
            frame = frame.f_back
        if frame is None:  # another importer: mlflow as usual
            return None
        sys.meta_path.remove(self)
        raise ModuleNotFoundError(f"mlflow is not given to {AUTOTUNER} (training/compat/deepspeed/)", name=name)


def no_mlflow_for_autotuner() -> None:
    """Before DeepSpeed is imported: its autotuner then runs without mlflow (training/compat/deepspeed/, PATCHES)."""
    if AUTOTUNER not in sys.modules and not any(isinstance(finder, MlflowRefusedToAutotuner)
                                                for finder in sys.meta_path):
        sys.meta_path.insert(0, MlflowRefusedToAutotuner())
