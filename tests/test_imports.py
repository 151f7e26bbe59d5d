"""The import order of the packages: the core at the bottom, training and serving on top of it,
never on each other, evaluation above them all. A cycle among them (envs imported serving,
serving imported envs, even ``batchpilot/metrics.py`` imported both) meant the loop that trained
and the loop that served could drift apart unnoticed; this test fails on any import (module level
or inside a function) that breaks the order, and on any new cycle between modules."""

from __future__ import annotations

import ast
from pathlib import Path

from batchpilot.config import REPO_ROOT

#: Folder -> the package name it is imported as (``batchpilot`` alone: its own *.py files).
FOLDERS = {"batchpilot/core": "core", "batchpilot/platform": "platform", "envs": "envs",
           "policies": "policies", "serving": "serving", "evaluation": "evaluation",
           "batchpilot/schemas": "top", "batchpilot": "top"}
#: Single modules that form a level of their own (their folder's level otherwise).
#: ``batchpilot/nodes.py`` (config node -> dataclass) imports nothing of batchpilot: the core's
#: ``from_cfg`` constructors use it without importing ``config`` (which registers the schemas,
#: which import the core).
MODULES = {"batchpilot/nodes.py": "nodes"}
#: Folder -> the dotted prefix its modules are imported under.
PREFIXES = {"batchpilot/core": "batchpilot.core", "batchpilot/platform": "batchpilot.platform",
            "envs": "batchpilot.envs", "policies": "batchpilot.policies",
            "serving": "batchpilot.serving", "evaluation": "batchpilot.evaluation",
            "batchpilot/schemas": "batchpilot.schemas", "batchpilot": "batchpilot"}
#: What each package may import (besides itself). ``top`` is batchpilot/*.py (config, metrics,
#: workload_config) but ``nodes``, and the batchpilot/schemas/ package; ``platform`` is the CPU
#: vLLM build and the tiny local model. One way: nodes <- core <- top <- the rest.
ALLOWED = {
    "nodes": set(),
    "core": {"nodes"},
    "top": {"core", "nodes"},
    "platform": {"core", "top", "nodes"},
    "envs": {"platform", "core", "top", "nodes"},
    "policies": {"envs", "core", "top", "nodes"},
    "serving": {"policies", "platform", "core", "top", "nodes"},
    "evaluation": {"policies", "envs", "serving", "platform", "core", "top", "nodes"},
}
#: Cycles between modules that pass through a function-local import, left for issue 54's later
#: items (one control loop, one source per default). The test fails on any cycle not listed here
#: and on a listed one that is gone (then delete its line), so the list only shrinks.
KNOWN_CYCLES: set[frozenset[str]] = set()  # none left (an empty {} would be a dict)
_SUBPACKAGES = {"core": "core", "platform": "platform", "envs": "envs", "policies": "policies",
                "serving": "serving", "evaluation": "evaluation"}


def _package_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "batchpilot":
        return None
    if len(parts) == 1:
        return "top"
    if f"batchpilot/{parts[1]}.py" in MODULES:  # the module or a name from it
        return MODULES[f"batchpilot/{parts[1]}.py"]
    return _SUBPACKAGES.get(parts[1], "top")


def _import_nodes(tree: ast.AST, module_level: bool) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement; with ``module_level`` only those run on import (not inside a
    function body)."""
    if not module_level:
        return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    out: list[ast.Import | ast.ImportFrom] = []
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return out


def _imports(path: Path, module_level: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) per import; ``from a import b`` gives ``a`` and ``a.b`` (b may be a
    submodule)."""
    out = []
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), module_level):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _files() -> list[tuple[str, Path]]:
    files = []
    for folder, pkg in FOLDERS.items():
        root = REPO_ROOT / folder
        pattern = "*.py" if pkg == "top" else "**/*.py"
        files += [(MODULES.get(str(p.relative_to(REPO_ROOT)), pkg), p) for p in root.glob(pattern)
                  if pkg != "top" or p.parent == root]
    return files


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of every package."""
    mods = {}
    for folder, prefix in PREFIXES.items():
        root = REPO_ROOT / folder
        for p in root.glob("*.py" if folder == "batchpilot" else "**/*.py"):
            parts = [x for x in p.relative_to(root).with_suffix("").parts if x != "__init__"]
            mods[".".join([prefix, *parts])] = p
    return mods


def _cycles(module_level: bool) -> set[frozenset[str]]:
    """The strongly connected components (more than one module) of the module import graph."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for _, target in _imports(path, module_level):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.add(frozenset(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_packages_import_in_one_direction() -> None:
    wrong = []
    for pkg, path in _files():
        for line, module in _imports(path):
            target = _package_of_module(module)
            if target is not None and target != pkg and target not in ALLOWED[pkg]:
                wrong.append(f"{path.relative_to(REPO_ROOT)}:{line} ({pkg}) imports {module} ({target})")
    assert not wrong, "imports against the package order:\n" + "\n".join(sorted(set(wrong)))


def test_top_imports_only_the_core() -> None:
    """batchpilot/*.py (config, schemas, metrics) is what every package reads: it may not reach
    up into training, serving or evaluation."""
    assert ALLOWED["top"] == {"core", "nodes"}


def test_core_imports_nothing_above_it() -> None:
    """The control code builds its configs with ``batchpilot.nodes`` alone: it never imports
    config, schemas or metrics (which import the core), so core and top do not import each
    other, not even inside a function."""
    assert ALLOWED["core"] == {"nodes"} and ALLOWED["nodes"] == set()


def test_the_allowed_order_has_no_cycle() -> None:
    """The rules themselves form no cycle among the packages."""
    graph = ALLOWED
    seen: dict[str, int] = {}

    def visit(p: str) -> None:
        assert seen.get(p) != 1, f"cycle through {p}"
        if seen.get(p) == 2:
            return
        seen[p] = 1
        for q in graph[p]:
            visit(q)
        seen[p] = 2

    for p in graph:
        visit(p)


def test_no_module_imports_itself_back_at_module_level() -> None:
    cycles = _cycles(module_level=True)
    assert not cycles, "module-level import cycles:\n" + "\n".join(sorted(map(str, map(sorted, cycles))))


def test_no_new_cycle_through_function_local_imports() -> None:
    cycles = _cycles(module_level=False)
    new = cycles - KNOWN_CYCLES
    gone = KNOWN_CYCLES - cycles
    assert not new, "new import cycles (function-local imports count):\n" + "\n".join(
        str(sorted(c)) for c in new)
    assert not gone, "cycles fixed: delete them from KNOWN_CYCLES:\n" + "\n".join(
        str(sorted(c)) for c in gone)
