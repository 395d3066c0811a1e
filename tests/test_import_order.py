"""The packages' declared order, bottom to top (README.md, Layout): every import of our code goes downward, to a
package below or to another module of its own package, and no modules import each other, even through others.
Entry points (train.py, `python -m training`, `python -m data_pipeline`) and training/checks.py, which calls every
feature's check, sit on top. Function-level imports count."""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ORDER = ["training.base", "training.compat", "data_pipeline", "training.config", "training.planning", "training.models",
         "training.parallel", "training.state", "training.loop", "training.objectives", "training.trainer"]
ENTRIES = {"train", "training.__main__", "data_pipeline.__main__",
           "training.checks"}  # the checks of every feature together, before anything is built: train.py's first step
PACKAGE_INITS = {"training": "training.compat"}  # training/__init__.py sets up logging and compat's import finder
# what an objective is before anything is built (its spec: the recipe section, traits and checks) loads with the
# recipe's schema, which takes the sections from the registry; the objectives' package files import nothing
PLAN_TIME = re.compile(r"training\.objectives(\.\w+)?\.spec|training\.objectives\.registry")
# what an objective holds beside the trained model, estimated before a run (its memory.py, and the reference's they
# share): plan-time code, which the plan loads through the spec's `memory`
MEMORY_TERMS = re.compile(r"training\.objectives\.\w+\.memory|training\.objectives\.reference_memory")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    """The module's place in ORDER (entries above all)."""
    if module in ENTRIES:
        return len(ORDER)
    module = PACKAGE_INITS.get(module, module)
    is_package = (REPO / module.replace(".", "/") / "__init__.py").is_file()
    if PLAN_TIME.fullmatch(module) or is_package and module.startswith("training.objectives"):
        return ORDER.index("training.config")
    if MEMORY_TERMS.fullmatch(module):
        return ORDER.index("training.planning")
    return max(i for i, package in enumerate(ORDER) if module == package or module.startswith(package + "."))


def imports() -> dict[str, dict[str, int]]:
    """{module: {imported module of ours: line}} for every module of ours and every import in it."""
    ours = {module_name(path): path for path in [REPO / "train.py", *(REPO / "training").rglob("*.py"),
                                                  *(REPO / "data_pipeline").rglob("*.py")]}
    found = {}
    for module, path in ours.items():
        found[module] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names += [f"{node.module}.{alias.name}" for alias in node.names]  # `from package import module`
            for name in names:
                if name in ours and name != module:
                    found[module].setdefault(name, node.lineno)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles among modules (Tarjan's strongly connected components of more than one module)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_import_goes_down_the_declared_order():
    upward = [f"{module} (line {line}) imports {other}" for module, targets in sorted(imports().items())
              for other, line in sorted(targets.items()) if layer(other) > layer(module)]
    assert not upward, f"{len(upward)} upward imports (the order: {' < '.join(ORDER)} < entries):\n" + "\n".join(upward)


def test_no_modules_import_each_other():
    graph = {module: set(targets) for module, targets in imports().items()}
    assert not cycles(graph), f"import cycles: {cycles(graph)}"


def test_every_spec_names_a_module_at_its_layer():
    """A spec names its run-time class (`runtime`, loaded by the run: the objectives layer) and its memory term
    (`memory`, loaded by the plan: the planning layer) as "module:name": it resolves as the run loads it
    (training/base/loader.py), and the module sits at that layer."""
    from training.base.loader import load
    from training.objectives.registry import SPECS
    wrong = []
    for spec in SPECS.values():
        for field, package in ("runtime", "training.objectives"), ("memory", "training.planning"):
            if (named := getattr(spec, field)) is None:
                continue
            try:
                load(named)
            except ImportError as error:
                wrong.append(f"{spec.name}: {field}: {error}")
                continue
            if layer(named.partition(":")[0]) != ORDER.index(package):
                wrong.append(f"{spec.name}: {field}={named!r} (at {package}'s layer)")
    assert not wrong, "specs naming no module at their layer:\n" + "\n".join(wrong)
