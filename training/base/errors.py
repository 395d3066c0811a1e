"""User-facing errors, and the one place that turns them into exit code 2 with a message instead of a traceback.

Our own checks raise ConfigError (recipes, options, checkpoints) or DataError (data files) with a message
that names the input and the fix. What the user's input can still raise where no check of ours came first
(a pydantic model built from an option, YAML or JSON that does not parse, a path that cannot be opened or
read as text, a layout that runs out of GPU memory) is a user error too: its message names the value, the file
or the way to fit. Anything else is a bug and keeps its traceback.
"""
import argparse
import json
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import yaml
from pydantic import ValidationError


class DataError(ValueError):
    """Bad input data: the message names the file (and line or field) and how to fix it."""


class ConfigError(ValueError):
    """A recipe, override, option or checkpoint that cannot run: the message names the file, the key and the fix."""


class EngineError(RuntimeError):
    """A service the run depends on (an objective's generation server) died or stopped answering: the message names
    it, its log and how to continue."""


def read_text(path: Path) -> str:
    """A text file's contents; a ConfigError naming the file and the line where it is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text ({error.reason} at byte {error.start}); save the file as "
                          f"UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def user_message(error: BaseException) -> str | None:
    """What to tell the user about an error their input caused; None for a bug."""
    if isinstance(error, (ConfigError, DataError, EngineError, ValidationError)):
        return str(error)
    if isinstance(error, yaml.YAMLError):
        return f"not valid YAML: {error}"
    if isinstance(error, json.JSONDecodeError):
        return f"not valid JSON: {error}"
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 text ({error.reason} at byte {error.start}); convert the file to UTF-8"
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror or error}"
    torch = sys.modules.get("torch")  # not imported here: the data commands run without torch
    if torch and isinstance(error, torch.OutOfMemoryError):
        return out_of_memory(error)
    return None


def out_of_memory(error: RuntimeError) -> str:
    """A run whose layout does not fit its GPUs: torch's account of the memory, where it ran out, the ways to fit."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" in {frames[-1].name} ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return (f"out of GPU memory{where}: {str(error).strip()} To fit: lower training.micro_batch_size (auto picks the "
            f"largest that fits), turn on activation_checkpointing, or shard more (deepspeed.config=zero3, or an "
            f"_offload config); train.py --dry-run shows the memory per rank under each ZeRO setting")


def failure(error: BaseException) -> tuple[int, str]:
    """The exit code and message of a command that `error` ends: 2 and `error: ...` for the user's, 130 for
    Ctrl-C, 1 and the traceback for a bug."""
    if isinstance(error, KeyboardInterrupt):
        return 130, "interrupted"
    message = user_message(error)
    if message is None:
        return 1, "".join(traceback.format_exception(error)).rstrip()
    return 2, f"error: {message}"


def report(error: BaseException, printing: bool = True) -> int:
    """Exit code 2 for a user error, printed as `error: ...` when `printing`; a bug is raised again."""
    message = user_message(error)
    if message is None:
        raise error
    if printing:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


def exit_code(main: Callable[[], int], printing: bool = True) -> int:
    """Run a command's body: its own exit code, or 2 with the message for any user error."""
    try:
        return main()
    except Exception as error:  # noqa: BLE001 (report re-raises what is not the user's)
        return report(error, printing)


def positive_int(text: str) -> int:
    """An argparse type: a whole number above 0."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number above 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text!r}")
    return value
