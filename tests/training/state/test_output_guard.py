"""An output folder's marker lists the files its command wrote; replacing it (--overwrite) removes those alone and
keeps, and names, every file the command did not write."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from training.config.errors import ConfigError
from training.state.output_guard import MARKER, files_under, listed_files, staged_folder

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
