"""Workarounds of Hugging Face datasets behaviour (verified for datasets 5.2.0, requirements.txt)."""
import json
import os
import shutil
from pathlib import Path

import datasets
import xxhash

from training.compat import NO_ISSUE, Patch

VERIFIED_FOR = "5.2.0"
PATCHES = (
    Patch("save_with_linked_split", "datasets", VERIFIED_FOR,
          "DatasetDict.save_to_disk writes dataset_dict.json (the splits' names) and a folder per split whose "
          "state.json lists its Arrow files (`_data_files`) beside dataset_info.json (the features); load_from_disk "
          "memory-maps those files and concatenates them. datasets has no public way to make a split of Arrow files "
          "already written without copying every row, so the split's folder is written here: the files hard-linked, "
          "state.json and dataset_info.json as save_to_disk writes them", NO_ISSUE,
          "tests/training/compat/test_datasets.py::test_a_linked_split_loads_as_the_saved_parts_concatenated",
          proofs=("tests/data_pipeline/test_scale.py::test_one_task_writes_the_in_process_rows_row_for_row",
                  "tests/data_pipeline/test_scale.py::test_the_jobs_rows_train_tiny_llama_to_the_in_process_first_loss")),
    Patch("fingerprint", "datasets", VERIFIED_FOR,
          "a data set's fingerprint (the hash of its source files and of every transform that made it, what its cache "
          "files are named by) is the private Dataset._fingerprint; datasets has no public accessor. An objective that "
          "stores values computed from the data (a reference pass's log-probabilities) stores it beside them, so "
          "that a resume on other data is refused", NO_ISSUE,
          "tests/training/compat/test_datasets.py::test_the_fingerprint_follows_the_rows_and_their_transforms",
          proofs=("tests/test_dpo.py::test_a_killed_dpo_run_resumes_in_another_layout_with_its_stored_reference",)),
)


def fingerprint(dataset: datasets.Dataset) -> str:
    return dataset._fingerprint


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link (no bytes copied), or a copy where the file system refuses one (another device)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def link_saved_datasets(parts: list[Path], split: Path) -> None:
    """Write `split` as Dataset.save_to_disk writes the concatenation of the data sets saved (by save_to_disk) in
    `parts`, which must have the same features, with each part's Arrow files linked, not copied."""
    states = [json.loads((part / "state.json").read_text()) for part in parts]
    infos = [json.loads((part / "dataset_info.json").read_text()) for part in parts]
    if any(info["features"] != infos[0]["features"] for info in infos):
        raise ValueError(f"the saved data sets {', '.join(map(str, parts))} have different features")
    files = [part / entry["filename"] for part, state in zip(parts, states) for entry in state["_data_files"]]
    split.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{len(files):05d}.arrow" for i in range(len(files))]
    for file, name in zip(files, names):
        link_or_copy(file, split / name)
    fingerprint = xxhash.xxh3_64_hexdigest("".join(state["_fingerprint"] for state in states).encode())
    state = {**states[0], "_data_files": [{"filename": name} for name in names], "_fingerprint": fingerprint}
    (split / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    (split / "dataset_info.json").write_text(json.dumps(infos[0], indent=2, sort_keys=True))


def save_with_linked_split(splits: datasets.DatasetDict, folder: Path, name: str, parts: list[Path]) -> None:
    """`splits` (a DatasetDict) saved to `folder` by save_to_disk, with one more split first, `name`, made of the data
    sets saved in `parts` (link_saved_datasets)."""
    splits.save_to_disk(str(folder))
    link_saved_datasets(parts, folder / name)
    listing = folder / "dataset_dict.json"
    saved = json.loads(listing.read_text())
    listing.write_text(json.dumps({**saved, "splits": [name, *saved["splits"]]}))
