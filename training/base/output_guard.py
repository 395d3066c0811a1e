"""The rules every command that writes a file or folder follows (train.py, export, convert, prepare, dedup,
compare), checked before any work starts:

- the output never contains, and never lies inside, an input the command reads (on resolved paths, so a symlink
  or `..` does not slip past);
- the output's nearest existing folder is a folder this user can write to;
- a symbolic link is never written through nor followed: an output that is one is refused, a link inside an
  output is a file of its own (listed, kept or removed as a link, its target never read or touched), and a link of
  another's where the command writes is refused before anything is removed;
- an existing output is replaced only with --overwrite, and only when an earlier run of the same command wrote
  it. Every output carries a marker naming the command that wrote it: a folder `.written-by.json` inside it, a
  file `.NAME.written-by.json` beside it. An unmarked folder or file is never replaced, whatever it holds.
- a folder's marker lists the files the command wrote there: replacing it removes those and the folders they leave
  empty, keeps every other file (named in one line), and refuses, before removing anything, a new output that would
  write where a kept file lies. A command that writes its output whole (export, evaluate) stages it and lists what
  it staged (staged_folder); one that writes as it goes (train.py, compare) marks the folder as being written, with
  the files that were there before it began, and lists what it wrote when it ends (begin_in_place, finish_in_place).
  An output whose command was killed is still marked as being written: its files are every file but those.
"""
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from training.base.errors import ConfigError
from training.base.strict_json import dumps

MARKER = ".written-by.json"


def marker_path(output: Path, folder: bool) -> Path:
    return output / MARKER if folder else output.with_name(f".{output.name}{MARKER}")


def marker(output: Path, folder: bool = True) -> dict:
    """The output's marker; empty when there is none, or one that cannot be read."""
    try:
        record = json.loads(marker_path(output, folder).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def written_by(output: Path, folder: bool = True) -> str | None:
    """The command named in the output's marker, or None (no marker, or one that cannot be read)."""
    return marker(output, folder).get("command")


def mark(output: Path, command: str, folder: bool = True, files: Iterable[str] | None = None) -> None:
    """Record that `command` wrote `output` (a folder, or a file: the marker goes beside it), and for a folder the
    files it wrote there (relative paths), when known."""
    record = {"command": command} if files is None else {"command": command, "files": sorted(files)}
    marker_path(output, folder).write_text(dumps(record) + "\n", encoding="utf-8")


def listed_files(folder: Path) -> set[str]:
    """The files the folder's marker lists as its command's; none for a marker from before the list."""
    return set(marker(folder).get("files", []))


def lists_files(folder: Path) -> bool:
    """Whether the folder's marker says which files are its command's (markers from before the list do not)."""
    record = marker(folder)
    return "files" in record or "writing" in record


def owned_files(folder: Path, under: str = "") -> set[str]:
    """The files of the folder's command (those under `under` alone, when given: a scan of that part only): those its
    marker lists or, while it writes or after it was killed, every file but those that were there when it began."""
    record = marker(folder)
    if record.get("writing"):
        return files_under(folder, under) - set(record.get("others", []))
    return {name for name in record.get("files", []) if not under or name.startswith(f"{under}/")}


def begin_in_place(folder: Path, command: str, owned: set[str]) -> None:
    """Mark the folder as being written by `command` as it goes: every file there now but `owned` (an earlier output
    of the command it continues) is another's, whatever appears from now on is the command's."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {"command": command, "writing": True, "others": sorted(files_under(folder) - owned)}
    write_atomically(marker_path(folder, True), dumps(record) + "\n")


def finish_in_place(folder: Path, command: str) -> None:
    """The command has ended: its marker lists the files it wrote (begin_in_place)."""
    record = {"command": command, "files": sorted(owned_files(folder))}
    write_atomically(marker_path(folder, True), dumps(record) + "\n")


def remove_owned(folder: Path, owned: set[str], under: str = "") -> set[str]:
    """Remove the `owned` files (relative to `folder`) that lie under `under` (all, when empty) and the folders they
    leave empty; returns the other files there, which stay."""
    present = files_under(folder, under)
    removing = owned & present
    for name in removing:
        (folder / name).unlink()
    remove_empty_folders(folder, [Path(name).parent for name in removing] + ([Path(under)] if under else []))
    return present - removing


def files_under(folder: Path, under: str = "") -> set[str]:
    """Every file under `folder`, or under its part `under` alone, as POSIX paths relative to `folder`, its marker
    aside. A symbolic link is a file, never followed: `under` that is one is itself the only file, one that lies
    beyond a link has none."""
    if under and (link := link_on_the_way(folder, under)):
        return {link} if link == Path(under).as_posix() else set()
    found = {path.relative_to(folder).as_posix() for path in (folder / under).rglob("*")
             if path.is_file() or path.is_symlink()}
    return found - {MARKER}


def link_on_the_way(folder: Path, name: str) -> str | None:
    """The first symbolic link on the way from `folder` to `name` (relative to it), `name` included, as a path
    relative to `folder`; None where the way holds none."""
    parts = Path(name).parts
    return next((Path(*parts[:depth]).as_posix() for depth in range(1, len(parts) + 1)
                 if (folder / Path(*parts[:depth])).is_symlink()), None)


def shown(folder: Path, name: str) -> str:
    """`name` (relative to `folder`), with what it points to where it is a symbolic link."""
    path = folder / name
    return f"{name} (a symbolic link to {os.readlink(path)})" if path.is_symlink() else name


def shown_list(folder: Path, names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(shown(folder, name) for name in names[:5]) + (f", ... ({len(names)} in all)"
                                                                  if len(names) > 5 else "")


def way_out(folder: Path, names: Iterable[str], option: str) -> str:
    """How to clear files of another's from where a command writes: a link is removed alone (its target stays)."""
    links = sorted(name for name in names if (folder / name).is_symlink())
    move = ("move it away" if not links
            else f"remove the link ({' '.join(f'rm {folder / name}' for name in links[:3])}: "
                 f"what it points to stays)")
    return f"{move}, or choose another {option}"


def kept_line(kept: set[str], command: str) -> str:
    names = ", ".join(sorted(kept)[:5]) + (f", ... ({len(kept)} in all)" if len(kept) > 5 else "")
    return f"kept {len(kept)} file{'s' if len(kept) != 1 else ''} that {command} did not write: {names}"


def overlap(output: Path, inputs: Iterable[Path | str | None]) -> tuple[str, Path] | None:
    """("contains" or "lies inside", the input) for the first input the output overlaps, or None. Inputs that do not
    exist (a hub id, say) are passed over."""
    out = output.expanduser().resolve()
    for given in inputs:
        if given is None or not Path(given).expanduser().exists():
            continue
        source = Path(given).expanduser().resolve()
        if source == out or out in source.parents:
            return "contains", Path(given)
        if source in out.parents:
            return "lies inside", Path(given)
    return None


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists: where an output that is not there yet will be made."""
    return next(folder for folder in (path, *path.parents) if folder.exists())


def check_writable_place(output: Path, option: str, folder: bool = True) -> None:
    """The output's nearest existing folder is a folder this user can write to (not a file, not read-only), and an
    existing output is of the kind the command writes."""
    output = output.expanduser().absolute()
    if output.exists() and output.is_dir() != folder:
        raise ConfigError(f"{option} {output} is a {'file' if folder else 'folder'}; the command writes a "
                          f"{'folder' if folder else 'file'} there: choose another {option}")
    existing = nearest_existing(output if folder else output.parent)
    if not existing.is_dir():
        raise ConfigError(f"{option} {output}: {existing} is a file, not a folder; choose another {option}")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise ConfigError(f"{option} {output}: {existing} is on a read-only file system; choose another {option}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {output}: {existing} is not writable by this user; choose another {option}")


def link_refusal(output: Path, option: str, folder: bool = True) -> str:
    return (f"{option} {output} is a symbolic link (to {os.readlink(output)}), which the command would write through; "
            f"name the real {'folder' if folder else 'file'}, or choose another {option} (nothing was written)")


def check_output(output: Path, command: str, inputs: Iterable[Path | str | None], overwrite: bool = False,
                 folder: bool = True, option: str = "the output") -> bool:
    """Every rule above for `output` of `command`, before any work; returns whether an earlier output of the same
    command is there (to be replaced, with `overwrite`)."""
    found = overlap(output, inputs)
    if found:
        how, source = found
        raise ConfigError(f"{option} {output} {how} {source}, which this command reads: an output never "
                          f"{'holds' if how == 'contains' else 'goes inside'} an input; choose {option} elsewhere "
                          f"(nothing was written)")
    if output.is_symlink():
        raise ConfigError(link_refusal(output, option, folder))
    check_writable_place(output, option, folder)
    if not output.exists():
        return False
    if not overwrite:
        raise ConfigError(f"{option} {output} already exists; choose another {option}, or pass --overwrite to replace "
                          f"an earlier output of {command}")
    if written_by(output, folder) != command:
        raise ConfigError(f"--overwrite replaces only an earlier output of {command}, and {output} is not one (no "
                          f"{marker_path(output, folder).name} naming it): nothing was deleted; choose another "
                          f"{option}, or remove it yourself if it is yours to remove")
    return True


def write_atomically(path: Path, content: str | bytes) -> None:
    """Readers see the old file or the new one, never a partial one: a new file beside it (created by this process:
    an earlier leftover is never overwritten), synced, then renamed over it, and the folder synced."""
    data = content.encode() if isinstance(content, str) else content
    temporary = path.with_name(f".{path.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with temporary.open("xb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)  # gone already once renamed
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


@contextmanager
def staged_folder(output: Path, command: str) -> Iterator[Path]:
    """A fresh folder beside `output`, created by this process, to write the output into, put in place only when the
    block finishes (removed if it fails): renamed there, or over an earlier output of `command` (checked by
    check_output) by replace_listed_files."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    try:
        yield staging
        written = files_under(staging)
        if output.exists():
            replace_listed_files(output, staging, written, command)
        else:
            mark(staging, command, files=written)
            staging.rename(output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when renamed


def replace_listed_files(output: Path, staging: Path, written: set[str], command: str) -> None:
    """The earlier output's listed files (and the folders they leave empty) replaced by the staged ones; every other
    file stays, named in one line. A staged file where a kept one lies is refused before anything is removed."""
    present = files_under(output)
    listed = listed_files(output) & present  # a listed name beyond a link (or gone) is not there to replace
    kept = present - listed
    clashing = [k for k in kept if any(w == k or w.startswith(f"{k}/") or k.startswith(f"{w}/") for w in written)]
    if clashing:
        raise ConfigError(f"{output} holds {shown_list(output, clashing)}, which {command} did not write (its "
                          f"{MARKER} does not list it), where the new output writes: nothing was replaced; "
                          f"{way_out(output, clashing, 'output')}")
    earlier = staging.with_name(f"{staging.name}-earlier")
    for name in sorted(listed):  # aside first: a failure below leaves the earlier files, not a mix
        (earlier / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(output / name, earlier / name)
    remove_empty_folders(output, [Path(name).parent for name in listed])
    for name in sorted(written):
        (output / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / name, output / name)
    mark(output, command, files=written)
    shutil.rmtree(earlier, ignore_errors=True)
    if kept:
        print(kept_line(kept, command), flush=True)


def remove_empty_folders(root: Path, folders: Iterable[Path]) -> None:
    """Each of the folders (relative to root) and its parents below root, where emptied."""
    for folder in sorted({root / f for f in folders if f != Path(".")}, key=lambda f: len(f.parts), reverse=True):
        while folder != root and folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent
