"""Canaries of training/compat/datasets.py (docs/compat.md)."""
import json

import datasets

from training.compat.datasets import fingerprint, save_with_linked_split


def test_a_linked_split_loads_as_the_saved_parts_concatenated(tmp_path):
    """Two saved data sets (one in two shards) become the `train` split of a saved DatasetDict without a copy: it loads
    as their concatenation, before the split saved with it, and its state.json has the keys save_to_disk writes."""
    first = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], "length": [2, 1]})
    second = datasets.Dataset.from_dict({"input_ids": [[4], [5, 6, 7], [8]], "length": [1, 3, 1]})
    first.save_to_disk(str(tmp_path / "part-0"))
    second.save_to_disk(str(tmp_path / "part-1"), num_shards=2)
    evaluation = datasets.Dataset.from_dict({"input_ids": [[9]], "length": [1]})
    folder = tmp_path / "prepared"
    save_with_linked_split(datasets.DatasetDict({"eval": evaluation}), folder, "train",
                           [tmp_path / "part-0", tmp_path / "part-1"])
    loaded = datasets.load_from_disk(str(folder))
    assert list(loaded) == ["train", "eval"]
    assert loaded["train"].to_dict() == datasets.concatenate_datasets([first, second]).to_dict()
    assert loaded["eval"].to_dict() == evaluation.to_dict()
    linked = sorted((folder / "train").glob("*.arrow"))
    assert len(linked) == 3 and all(file.stat().st_nlink == 2 for file in linked)
    saved = json.loads((tmp_path / "part-1" / "state.json").read_text())
    assert json.loads((folder / "train" / "state.json").read_text()).keys() == saved.keys()


def test_the_fingerprint_follows_the_rows_and_their_transforms(tmp_path):
    """The same rows loaded again keep their fingerprint; other rows, or a transform of them, change it."""
    rows = datasets.Dataset.from_dict({"text": ["a", "b"]})
    rows.save_to_disk(str(tmp_path / "rows"))
    loaded = [datasets.load_from_disk(str(tmp_path / "rows")) for _ in range(2)]
    assert isinstance(fingerprint(loaded[0]), str) and fingerprint(loaded[0]) == fingerprint(loaded[1])
    other = datasets.Dataset.from_dict({"text": ["a", "c"]})
    mapped = loaded[0].map(lambda row: {"text": row["text"] + "!"})
    assert len({fingerprint(loaded[0]), fingerprint(other), fingerprint(mapped)}) == 3
