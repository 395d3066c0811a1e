"""The folders are the map, and its two written forms stay true to them.

Each package's docstring (its __init__.py) names every module of the package as `name.py` and every sub-package by
its name, and every `name.py` or `folder/` it names is there: in the package, in one of its sub-packages (a docstring
may say what each of its folders holds) or as a path from the repository root (train.py, docs/..., tests/...).
README.md's Layout lists every sub-package of training/ and data_pipeline/ as `name/` under its folder, names each
package below those on its parent's line, and lists nothing there that is gone."""
import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
ROOTS = ("training", "data_pipeline")
MODULE = re.compile(r"(?<![\w/.])((?:\w+/)*\w+\.py)\b")  # errors.py, training/planning/layout.py
FOLDER = re.compile(r"(?<![\w/.])((?:\w+/)+)(?![\w<])")  # tests/training/compat/, not docs/compat.md
ENTRY = re.compile(r"  (\w+(?:/|\.py))\s")  # a Layout line listing a folder or module under a top-level folder


def sub_packages(package: Path) -> list[Path]:
    return sorted(path.parent for path in package.glob("*/__init__.py"))


def packages() -> list[Path]:
    return sorted(init.parent for root in ROOTS for init in (REPO / root).rglob("__init__.py"))


def modules(package: Path) -> list[str]:
    """The package's modules, but for the package file itself and its `python -m` entry."""
    return sorted(path.name for path in package.glob("*.py") if not path.name.startswith("__"))


def mentions(text: str) -> set[str]:
    return set(MODULE.findall(text)) | set(FOLDER.findall(text))


def is_there(package: Path, mention: str) -> bool:
    """Whether a `name.py` or `folder/` a docstring names exists where a reader of that docstring would look."""
    places = [package, *sub_packages(package), REPO]
    return any((place / mention).exists() for place in places)


def named_modules(package: Path, text: str) -> set[str]:
    """The package's modules the text names, bare (errors.py) or as a path (training/base/errors.py)."""
    return {Path(mention).name for mention in MODULE.findall(text)
            if "/" not in mention or (REPO / mention).parent == package} & set(modules(package))


@pytest.mark.parametrize("package", packages(), ids=lambda package: str(package.relative_to(REPO)))
def test_a_package_docstring_names_what_the_package_holds(package):
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    gone = sorted(mention for mention in mentions(docstring) if not is_there(package, mention))
    unnamed = sorted(set(modules(package)) - named_modules(package, docstring))
    unnamed += [f"{sub.name}/" for sub in sub_packages(package) if not re.search(rf"\b{sub.name}\b", docstring)]
    assert not gone and not unnamed, (f"{package.relative_to(REPO)}/__init__.py's docstring names {gone}, which are "
                                      f"not there, and leaves out {unnamed}")


def layout_entries() -> dict[str, dict[str, str]]:
    """{top-level folder: {entry (`name/` or `name.py`): its line}} from README.md's Layout block."""
    section = README.read_text().split("## Layout", 1)[1]
    block = section.split("```", 2)[1]
    entries, top = {}, None
    for line in block.splitlines():
        if line and not line[0].isspace():
            top = line.split()[0]
            entries.setdefault(top, {})
        elif top and (entry := ENTRY.match(line)):
            entries[top][entry.group(1)] = line
    return entries


@pytest.mark.parametrize("root", ROOTS)
def test_readme_layout_lists_every_sub_package(root):
    listed = layout_entries().get(f"{root}/", {})
    missing = [f"{sub.name}/" for sub in sub_packages(REPO / root) if f"{sub.name}/" not in listed]
    gone = [entry for entry in listed if not (REPO / root / entry).exists()]
    unnamed = [f"{sub.relative_to(REPO / root)}/" for entry in listed if entry.endswith("/")
               for sub in sub_packages(REPO / root / entry) if not re.search(rf"\b{sub.name}\b", listed[entry])]
    assert not missing and not gone and not unnamed, (
        f"README.md's Layout under {root}/ leaves out {missing}, lists {gone}, which are not there, and does not "
        f"name {unnamed} on their parent's line")
