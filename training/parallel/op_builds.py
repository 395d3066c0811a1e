"""DeepSpeed's C++ ops and the build lock a killed run leaves behind.

DeepSpeed builds its ops (the CPU all-reduce, CPU Adam, FusedAdam, async I/O) on first use with torch's
cpp_extension.load, which caches them under the torch extensions root. A build holds `<root>/<op>/lock` open while it
runs; every other process that loads the op waits while that file exists, with no time limit and no message. A
run killed while it built an op (kill -9, the OOM killer, a cancelled job) leaves the file behind, and every later
run on that cache waits for good (pytorch/pytorch#189245). So before the process group starts, each rank looks for
locks that no process on its node holds: it names them at once, waits while one could still be another node's build
(the cache may be a shared home), and past STALE_AFTER_S exits 2 with the fix. It deletes nothing: the lock is not
this run's, and only the user can know that no other machine is building."""
import sys
import time
from pathlib import Path

import psutil

from training.base.errors import ConfigError
from training.compat.torch import extension_build_root

STALE_AFTER_S = 300.0  # a lock no process on this node holds is stale this long after it was made (builds: ~1 min)


def held_files() -> set[str]:
    """The paths every process on this node that this user may inspect holds open."""
    held = set()
    for process in psutil.process_iter():
        try:
            held.update(file.path for file in process.open_files())
        except psutil.Error:  # another user's process, or one that just ended
            continue
    return held


def loaded_here() -> set[Path]:
    """The folders of the libraries this process has loaded: an op loaded already is not loaded again, so its lock
    does not matter to this process (the test harness's warm ranks inherit the ops their parent loaded)."""
    try:
        return {Path(mapped.path).parent for mapped in psutil.Process().memory_maps()}
    except (AttributeError, psutil.Error):  # where psutil cannot list a process's memory maps (macOS)
        return set()


def unheld_locks(root: Path) -> dict[Path, float]:
    """{lock: age in seconds} for each op's build lock under `root` that no process on this node holds open, of an op
    this process has not loaded."""
    locks = sorted(root.glob("*/lock"))
    if not locks:
        return {}
    held, loaded = held_files(), loaded_here()
    ages = {}
    for lock in locks:
        try:
            if str(lock.resolve()) not in held and lock.parent.resolve() not in loaded:
                ages[lock] = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # its build ended in between
            continue
    return ages


def stale_lock_error(lock: Path, age_s: float) -> ConfigError:
    return ConfigError(
        f"{lock} is the build lock of DeepSpeed's {lock.parent.name} op, made {age_s / 60:.0f} min ago, and no process "
        f"on this node holds it: a run killed while it built the op leaves this file, and every later run that loads "
        f"the op waits for it without end. If no run on another machine sharing this folder is building the op, "
        f"delete it (rm {lock}) and start again")


def wait_for_op_builds(show: bool, stale_after_s: float = STALE_AFTER_S, poll_s: float = 1.0) -> None:
    """Return once no op build lock under the extensions root lacks a holder on this node (a lock held here is a
    build under way, which torch waits for); raise the stale lock's error once one is older than `stale_after_s`.
    `show`: whether this process names the locks it waits for (local rank 0)."""
    root, named = extension_build_root(), set()
    while locks := unheld_locks(root):
        stale = [(lock, age) for lock, age in locks.items() if age >= stale_after_s]
        if stale:
            raise stale_lock_error(*stale[0])
        if show and (new := locks.keys() - named):
            for lock in sorted(new):
                print(f"waiting for {lock}: no process on this node holds this build lock of DeepSpeed's "
                      f"{lock.parent.name} op; a build on another machine sharing this folder may, and past "
                      f"{stale_after_s / 60:.0f} min it counts as left by a killed run", file=sys.stderr, flush=True)
            named |= new
        time.sleep(poll_s)
