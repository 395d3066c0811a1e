"""Upstream's private names are read only in training/compat/, where each has its canary (docs/compat.md): a private
attribute (`x._name`, getattr(x, "_name")) read anywhere else in the code that our own code does not define fails
here, named by file and line."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
OURS = [REPO / "train.py", *sorted((REPO / "training").rglob("*.py")), *sorted((REPO / "data_pipeline").rglob("*.py"))]
PUBLIC = {"_exit"}  # os._exit: documented, the way to end a process without its exit handlers


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC


def defined_here(trees: list[ast.Module]) -> set[str]:
    """Private names our code defines: attributes it assigns, and class-level names and methods."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    targets = item.targets if isinstance(item, ast.Assign) else \
                        [item.target] if isinstance(item, ast.AnnAssign) else []
                    names |= {target.id for target in targets if isinstance(target, ast.Name)}
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
    return {name for name in names if private(name)}


def private_reads(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and private(node.attr):
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and private(node.args[1].value)):
            found.append((node.lineno, node.args[1].value))
    return found


def test_upstream_private_names_are_read_only_in_compat():
    trees = {path: ast.parse(path.read_text(), str(path)) for path in OURS}
    ours = defined_here(list(trees.values()))
    outside = [f"{path.relative_to(REPO)}:{line} {name}" for path, tree in trees.items()
               if "compat" not in path.relative_to(REPO).parts
               for line, name in private_reads(tree) if name not in ours]
    assert not outside, ("private upstream names read outside training/compat/ (move each into a compat function "
                         f"with a canary, docs/compat.md): {outside}")
