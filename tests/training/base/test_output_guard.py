"""An output folder's marker lists the files its command wrote; replacing it (--overwrite) removes those alone and
keeps, and names, every file the command did not write: for outputs staged whole (export, evaluate) and for outputs
written as the command goes (train.py, compare: begin_in_place / finish_in_place), finished or killed."""
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from training.base.errors import ConfigError
from training.base.output_guard import (
    MARKER,
    begin_in_place,
    files_under,
    finish_in_place,
    listed_files,
    owned_files,
    remove_owned,
    staged_folder,
)

COMMAND = "python -m training export"


def write(folder, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def snapshot(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def export(out, files: dict[str, str]) -> None:
    with staged_folder(out, COMMAND) as staging:
        write(staging, files)


def test_a_new_output_lists_what_it_wrote(tmp_path):
    export(tmp_path / "out", {"config.json": "{}", "sub/weights.bin": "w"})
    marker = json.loads((tmp_path / "out" / MARKER).read_text())
    assert marker == {"command": COMMAND, "files": ["config.json", "sub/weights.bin"]}
    assert listed_files(tmp_path / "out") == files_under(tmp_path / "out") == {"config.json", "sub/weights.bin"}


def test_a_replaced_output_keeps_and_names_the_files_it_did_not_write(tmp_path, capsys):
    out = tmp_path / "out"
    export(out, {"config.json": "old", "old_only.bin": "o", "sub/a.bin": "a"})
    write(out, {"MY_MODEL_CARD.md": "mine", "sub/notes.txt": "mine too"})
    export(out, {"config.json": "new", "model.safetensors": "m"})
    assert snapshot(out) == {"config.json": b"new", "model.safetensors": b"m", "MY_MODEL_CARD.md": b"mine",
                             "sub/notes.txt": b"mine too", MARKER: (out / MARKER).read_bytes()}
    assert listed_files(out) == {"config.json", "model.safetensors"}
    assert capsys.readouterr().out.splitlines()[-1] == (f"kept 2 files that {COMMAND} did not write: "
                                                        "MY_MODEL_CARD.md, sub/notes.txt")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or set-aside folder left


def test_a_new_file_where_a_kept_one_lies_is_refused_before_anything_is_removed(tmp_path):
    out = tmp_path / "out"
    export(out, {"config.json": "old"})
    write(out, {"model.safetensors": "the user's"})
    before = snapshot(out)
    with pytest.raises(ConfigError, match=f"holds model.safetensors, which {COMMAND} did not write .*nothing was "
                                          "replaced"):
        export(out, {"config.json": "new", "model.safetensors": "m"})
    assert snapshot(out) == before and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_folder_the_earlier_output_emptied_goes_and_one_holding_a_kept_file_stays(tmp_path):
    out = tmp_path / "out"
    export(out, {"a/b/c.bin": "1", "d/e.bin": "2"})
    write(out, {"d/mine.txt": "x"})
    export(out, {"f.bin": "3"})
    assert not (out / "a").exists() and sorted(files_under(out)) == ["d/mine.txt", "f.bin"]


NAMES = st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=4).map("/".join)


@settings(max_examples=60, deadline=None)
@given(earlier=st.sets(NAMES, min_size=1, max_size=6), new=st.sets(NAMES, min_size=1, max_size=6), foreign=NAMES)
def test_a_foreign_file_at_any_depth_survives_every_replacement(tmp_path_factory, earlier, new, foreign):
    """Any earlier output, a file of the user's dropped at any depth beside it, any new output: the user's file is
    never removed or changed; it is refused (nothing replaced) where the new output writes it, kept otherwise."""
    out = tmp_path_factory.mktemp("prop") / "out"
    files = {name for name in earlier if not any(other.startswith(name + "/") for other in earlier)}  # files, not dirs
    export(out, {name: "earlier" for name in files})
    taken = files_under(out)
    if foreign in taken or any(foreign.startswith(t + "/") or t.startswith(foreign + "/") for t in taken):
        return  # the user's file cannot be placed there
    write(out, {foreign: "mine"})
    new_files = {n for n in new if not any(o.startswith(n + "/") for o in new)}
    blocked = any(n == foreign or n.startswith(foreign + "/") or foreign.startswith(n + "/") for n in new_files)
    before = snapshot(out)
    try:
        export(out, {name: "new" for name in new_files})
    except ConfigError:
        assert blocked and snapshot(out) == before
        return
    assert (out / foreign).read_text() == "mine"
    assert files_under(out) == new_files | {foreign} and listed_files(out) == new_files


IN_PLACE = "train.py"


def test_an_output_written_in_place_lists_what_appeared_while_it_wrote(tmp_path):
    out = tmp_path / "out"
    write(out, {"notes.md": "mine", "benchmarks/my_eval.py": "mine"})
    begin_in_place(out, IN_PLACE, set())
    write(out, {"metrics.jsonl": "1", "checkpoints/global_step1/x.pt": "x", "benchmarks/results.json": "r"})
    assert owned_files(out) == {"metrics.jsonl", "checkpoints/global_step1/x.pt", "benchmarks/results.json"}
    finish_in_place(out, IN_PLACE)
    assert json.loads((out / MARKER).read_text()) == {"command": IN_PLACE, "files": [
        "benchmarks/results.json", "checkpoints/global_step1/x.pt", "metrics.jsonl"]}
    write(out, {"checkpoints/global_step1/mine.txt": "added after the run"})
    assert remove_owned(out, owned_files(out)) == {"notes.md", "benchmarks/my_eval.py",
                                                   "checkpoints/global_step1/mine.txt"}
    assert files_under(out) == {"notes.md", "benchmarks/my_eval.py", "checkpoints/global_step1/mine.txt"}


def test_a_killed_output_is_still_being_written_and_a_continued_one_keeps_its_earlier_files(tmp_path):
    out = tmp_path / "out"
    write(out, {"notes.md": "mine"})
    begin_in_place(out, IN_PLACE, set())
    write(out, {"metrics.jsonl": "1", "checkpoints/global_step2/partial.pt": "cut short"})  # then killed
    assert owned_files(out) == {"metrics.jsonl", "checkpoints/global_step2/partial.pt"}
    begin_in_place(out, IN_PLACE, owned_files(out))  # --resume: the earlier files stay the run's
    write(out, {"checkpoints/global_step3/x.pt": "x"})
    assert remove_owned(out, owned_files(out), "checkpoints/global_step2") == set()
    assert not (out / "checkpoints/global_step2").exists()
    finish_in_place(out, IN_PLACE)
    assert owned_files(out) == {"metrics.jsonl", "checkpoints/global_step3/x.pt"}


@settings(max_examples=60, deadline=None)
@given(written=st.sets(NAMES, min_size=1, max_size=6), before=st.sets(NAMES, max_size=2), foreign=NAMES,
       killed=st.booleans())
def test_a_foreign_file_at_any_depth_survives_the_replacement_of_an_output_written_in_place(
        tmp_path_factory, written, before, foreign, killed):
    """Files of the user's there before the command began, and one dropped at any depth after it ended: the
    replacement, of a finished or a killed output, removes exactly the command's files and the folders they leave
    empty; every file of the user's stays, unchanged. (A killed output is still being written: a file added to it
    before its replacement counts as the command's, docs/outputs.md.)"""
    out = tmp_path_factory.mktemp("prop") / "out"

    def leaves(names: set[str], taken: set[str]) -> set[str]:
        return {n for n in names if not any(o.startswith(n + "/") for o in names | taken)
                and not any(n == t or n.startswith(t + "/") for t in taken)}

    mine = leaves(before, set())
    write(out, {name: "mine" for name in mine})
    begin_in_place(out, IN_PLACE, set())
    ours = leaves(written, mine)
    write(out, {name: "written" for name in ours})
    if not killed:
        finish_in_place(out, IN_PLACE)
    dropped = leaves({foreign}, mine | ours)
    if not killed:
        write(out, {name: "mine" for name in dropped})
        mine |= dropped
    kept = remove_owned(out, owned_files(out))
    assert kept == mine == files_under(out)
    assert all((out / name).read_text() == "mine" for name in mine)
    assert not [path for path in out.rglob("*") if path.is_dir() and not any(path.iterdir())]


KINDS = ["file", "link to a file outside", "link to a folder outside", "link to a file inside",
         "link to a folder inside", "dangling link"]


def outside_area(root) -> dict[str, bytes]:
    """A folder beside the output that links may point into: a file, and a folder holding one."""
    write(root / "outside", {"theirs.txt": "theirs", "folder/inner.txt": "theirs too"})
    return snapshot(root / "outside")


def place(out, name: str, kind: str, root) -> None:
    """A file of the user's at `name`, or a symbolic link of the given kind there."""
    path = out / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "file":
        path.write_text("mine")
        return
    path.symlink_to({"link to a file outside": root / "outside/theirs.txt",
                     "link to a folder outside": root / "outside/folder",
                     "link to a file inside": out / "a", "link to a folder inside": out / "b",
                     "dangling link": root / "missing"}[kind])


def untouched(out, name: str, kind: str, root, outside: dict[str, bytes]) -> None:
    """Nothing outside the output changed or appeared; the user's file, or the link itself, is as it was placed."""
    assert snapshot(root / "outside") == outside and not (root / "missing").exists()
    path = out / name
    if kind == "file":
        assert not path.is_symlink() and path.read_text() == "mine"
    else:
        assert path.is_symlink() and os.readlink(path) != ""


@settings(max_examples=80, deadline=None)
@given(earlier=st.sets(NAMES, min_size=1, max_size=6), new=st.sets(NAMES, min_size=1, max_size=6), foreign=NAMES,
       kind=st.sampled_from(KINDS))
def test_a_link_at_any_depth_is_never_followed_by_a_replacement(tmp_path_factory, earlier, new, foreign, kind):
    """The property above with the user's entry any kind of symbolic link (to a file or a folder, inside the output
    or outside it, dangling): never followed, never removed or changed, nothing written through it; refused where the
    new output writes at it or below it, kept otherwise (export, evaluate)."""
    root = tmp_path_factory.mktemp("links")
    out, outside = root / "out", outside_area(root)
    files = {name for name in earlier if not any(other.startswith(name + "/") for other in earlier)}
    export(out, {name: "earlier" for name in files})
    taken = files_under(out)
    if foreign in taken or any(foreign.startswith(t + "/") or t.startswith(foreign + "/") for t in taken):
        return
    place(out, foreign, kind, root)
    new_files = {n for n in new if not any(o.startswith(n + "/") for o in new)}
    blocked = any(n == foreign or n.startswith(foreign + "/") or foreign.startswith(n + "/") for n in new_files)
    try:
        export(out, {name: "new" for name in new_files})
    except ConfigError as error:
        assert blocked and foreign in str(error)
        assert kind == "file" or "a symbolic link to" in str(error) and "what it points to stays" in str(error)
    else:
        assert not blocked
        assert files_under(out) == new_files | {foreign} and listed_files(out) == new_files
    untouched(out, foreign, kind, root, outside)


@settings(max_examples=80, deadline=None)
@given(written=st.sets(NAMES, min_size=1, max_size=6), foreign=NAMES, kind=st.sampled_from(KINDS),
       before=st.booleans(), killed=st.booleans())
def test_a_link_in_an_output_written_in_place_is_never_followed(tmp_path_factory, written, foreign, kind, before,
                                                                  killed):
    """train.py's and compare's outputs: a link of the user's there before the command began, or dropped after it
    ended, is kept whatever it points to, and its target is never read into the command's files nor removed; the
    command's own files beyond it are not there to remove."""
    root = tmp_path_factory.mktemp("links")
    out, outside = root / "out", outside_area(root)
    out.mkdir()
    if before:
        place(out, foreign, kind, root)
    begin_in_place(out, IN_PLACE, set())
    ours = {n for n in written if not any(o.startswith(n + "/") for o in written)
            and not (before and (n == foreign or n.startswith(foreign + "/") or foreign.startswith(n + "/")))}
    write(out, {name: "written" for name in ours})
    if not killed:
        finish_in_place(out, IN_PLACE)
    dropped = not before and not killed and not any(
        n == foreign or n.startswith(foreign + "/") or foreign.startswith(n + "/") for n in ours)
    if dropped:
        place(out, foreign, kind, root)
    kept = remove_owned(out, owned_files(out))
    assert kept == ({foreign} if before or dropped else set()) == files_under(out)
    if before or dropped:
        untouched(out, foreign, kind, root, outside)
    assert snapshot(root / "outside") == outside


@pytest.mark.parametrize("kind", ["link to a folder outside", "dangling link"])
def test_a_part_of_an_output_that_is_a_link_holds_no_files_of_the_command(tmp_path, kind):
    """Pruning a checkpoint (remove_owned under a part) whose folder a link replaced: the link alone is there; what
    it points to is not the command's to remove, even in an output still being written."""
    outside = outside_area(tmp_path)
    out = tmp_path / "out"
    begin_in_place(out, IN_PLACE, set())
    write(out, {"checkpoints/global_step1/x.pt": "x"})
    place(out, "checkpoints/global_step2", kind, tmp_path)
    assert files_under(out, "checkpoints/global_step2") == {"checkpoints/global_step2"}
    assert files_under(out, "checkpoints/global_step2/inner.txt") == set()
    remove_owned(out, owned_files(out, "checkpoints/global_step2"), "checkpoints/global_step2")
    assert not (out / "checkpoints/global_step2").exists() or kind == "dangling link"
    assert snapshot(tmp_path / "outside") == outside


def test_a_listed_folder_the_user_replaced_by_a_link_keeps_what_the_link_points_to(tmp_path):
    """The earlier export wrote folder/inner.txt; the user put a link to a folder of theirs (holding an inner.txt)
    where that folder was. Replacing the export must not reach through the link for the listed name."""
    outside = outside_area(tmp_path)
    out = tmp_path / "out"
    export(out, {"folder/inner.txt": "earlier", "config.json": "old"})
    for path in (out / "folder").iterdir():
        path.unlink()
    (out / "folder").rmdir()
    place(out, "folder", "link to a folder outside", tmp_path)
    export(out, {"config.json": "new"})
    assert snapshot(tmp_path / "outside") == outside
    assert files_under(out) == {"config.json", "folder"} and (out / "folder").is_symlink()


def test_a_read_only_file_system_is_named_as_such(tmp_path, monkeypatch):
    """As root, os.access says every folder is writable; a read-only mount is told by its flag (statvfs)."""
    from training.base import output_guard
    real = os.statvfs

    def read_only(path):
        result = real(path)
        return os.statvfs_result((*result[:8], result.f_flag | os.ST_RDONLY, result.f_namemax))
    monkeypatch.setattr(output_guard.os, "statvfs", read_only)
    with pytest.raises(ConfigError, match=f"--output-dir {tmp_path / 'out'}: {tmp_path} is on a read-only file system; "
                                          "choose another --output-dir"):
        output_guard.check_writable_place(tmp_path / "out", "--output-dir")
