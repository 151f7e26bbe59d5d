"""The import order of the packages: the core at the bottom, training and serving on top of it,
never on each other. A cycle among them (envs imported serving, serving imported envs, even
``batchpilot/metrics.py`` imported both) meant the loop that trained and the loop that served
could drift apart unnoticed; this test fails on any import (module level or inside a function)
that breaks the order."""

from __future__ import annotations

import ast
from pathlib import Path

from batchpilot.config import REPO_ROOT

#: Folder -> the package name it is imported as.
FOLDERS = {"batchpilot/core": "core", "envs": "envs", "policies": "policies", "serving": "serving",
           "batchpilot": "top"}
#: What each package may import (besides itself). ``top`` is batchpilot/*.py (config, metrics).
ALLOWED = {
    "core": {"top"},
    "top": {"core"},
    "envs": {"core", "top"},
    "policies": {"envs", "core", "top"},
    "serving": {"policies", "core", "top"},
}


def _package_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "batchpilot":
        return None
    if len(parts) == 1:
        return "top"
    return {"core": "core", "envs": "envs", "policies": "policies", "serving": "serving"}.get(parts[1], "top")


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def _files() -> list[tuple[str, Path]]:
    files = []
    for folder, pkg in FOLDERS.items():
        root = REPO_ROOT / folder
        pattern = "*.py" if pkg == "top" else "**/*.py"
        files += [(pkg, p) for p in root.glob(pattern) if pkg != "top" or p.parent == root]
    return files


def test_packages_import_in_one_direction() -> None:
    wrong = []
    for pkg, path in _files():
        for line, module in _imports(path):
            target = _package_of_module(module)
            if target is not None and target != pkg and target not in ALLOWED[pkg]:
                wrong.append(f"{path.relative_to(REPO_ROOT)}:{line} ({pkg}) imports {module} ({target})")
    assert not wrong, "imports against the package order:\n" + "\n".join(wrong)


def test_the_allowed_order_has_no_cycle() -> None:
    """The rules themselves form no cycle among the four packages."""
    graph = {p: ALLOWED[p] - {"top"} for p in ("core", "envs", "policies", "serving")}
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
