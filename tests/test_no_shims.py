"""No re-export shims (issue 54). A module that imported a name only so that others could import
it from there hid where a class lived: ``SimEngineConfig`` could be imported from three places,
``ServeConfig`` from a module that was nothing but an ``__all__``, and a reader had to follow the
chain to find the one that counts. The rules, for the source, the scripts and the tests:

* every ``from batchpilot.X import Y`` names the module where ``Y`` is defined or assigned at
  top level (or ``Y`` is a submodule of ``X``), and ``X`` exists;
* no ``__all__`` lists a name its module does not define;
* no ``from ... import`` in the source carries ``noqa: F401`` (kept unused: only to be
  re-exported) or a comment calling it a re-export. A bare ``import x  # noqa: F401 (why)`` kept
  for its side effect (storing the config schemas, registering the env id) is fine when it says
  why.

A name imported and used by the importing module itself is fine: it turns into a shim only when
another module imports it from there, which the first rule catches. Pure AST: nothing of
batchpilot is imported, so the test is fast and an import error cannot hide a shim."""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

#: Folder -> the dotted prefix its modules are imported under (pyproject.toml's ``package-dir``;
#: tests/test_imports.py keeps the same map).
PREFIXES = {"batchpilot": "batchpilot", "envs": "batchpilot.envs", "policies": "batchpilot.policies",
            "serving": "batchpilot.serving", "evaluation": "batchpilot.evaluation"}
#: The source folders, and every folder whose imports are checked (the tests too).
SOURCE = ("batchpilot", "envs", "policies", "serving", "evaluation", "scripts")
IMPORTERS = (*SOURCE, "tests")
#: Package modules allowed to re-export a deliberate public API (module -> reason). None: the
#: package ``__init__`` files define their own names or none (``batchpilot.schemas`` imports the
#: schemas to register them and says "no re-exports here"; ``batchpilot.envs`` defines ``ENV_ID``).
PUBLIC_API: dict[str, str] = {}

_NOQA_F401 = re.compile(r"#\s*noqa:[^#\n]*\bF401\b([^\n]*)")
_DEFINES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _target_names(target: ast.expr | None) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            yield from _target_names(elt)
    elif isinstance(target, ast.Starred):
        yield from _target_names(target.value)


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements run on import: the body and its if/try/with/for blocks' bodies (not those
    of functions or classes)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, _DEFINES):
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from _top_level(getattr(stmt, field, []))
        for handler in getattr(stmt, "handlers", []):
            yield from _top_level(handler.body)


def _defines(stmt: ast.stmt) -> Iterator[str]:
    """The names one top-level statement binds, imports aside."""
    if isinstance(stmt, _DEFINES):
        yield stmt.name
    elif isinstance(stmt, ast.Assign):
        for t in stmt.targets:
            yield from _target_names(t)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
        yield from _target_names(stmt.target)
    elif isinstance(stmt, (ast.With, ast.AsyncWith)):
        for item in stmt.items:
            yield from _target_names(item.optional_vars)
    elif type(stmt).__name__ == "TypeAlias":  # ``type X = ...`` (Python 3.12)
        yield from _target_names(getattr(stmt, "name", None))


class Source:
    """The modules under ``root`` (the repository, or a small tree a test builds) and what each
    defines, parsed once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[Path, ast.Module] = {}

    def tree(self, path: Path) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(path.read_text(), str(path))
        return self._trees[path]

    def files(self, folders: tuple[str, ...]) -> list[Path]:
        return sorted(p for f in folders for p in (self.root / f).rglob("*.py")
                      if not {"__pycache__", ".venv"} & set(p.parts))

    @cached_property
    def modules(self) -> dict[str, Path]:
        """Dotted module name -> file, for every module of the installed packages."""
        mods = {}
        for folder, prefix in PREFIXES.items():
            for p in self.files((folder,)):
                parts = [x for x in p.relative_to(self.root / folder).with_suffix("").parts if x != "__init__"]
                mods[".".join([prefix, *parts])] = p
        return mods

    def defined(self, module: str) -> set[str]:
        """The names ``module`` defines itself at top level; imported names do not count."""
        return {n for s in _top_level(self.tree(self.modules[module]).body) for n in _defines(s)}

    def provides(self, module: str, name: str) -> bool:
        return name in self.defined(module) or f"{module}.{name}" in self.modules

    def home(self, module: str, name: str) -> str:
        """Where ``module.name`` really lives: its import chain followed to the end."""
        seen: set[tuple[str, str]] = set()
        while module in self.modules and not self.provides(module, name) and (module, name) not in seen:
            seen.add((module, name))
            origin = self._imported_from(module, name)
            if origin is None:
                return f"nowhere in {module}"
            module, _, name = origin.rpartition(".")
            if not module:
                return origin
        return f"{module}.{name}"

    def _imported_from(self, module: str, name: str) -> str | None:
        """``pkg.mod.name`` that ``module`` imports as ``name`` at top level, or None."""
        for stmt in _top_level(self.tree(self.modules[module]).body):
            if isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
                for a in stmt.names:
                    if (a.asname or a.name) == name:
                        return f"{stmt.module}.{a.name}"
            elif isinstance(stmt, ast.Import):
                for a in stmt.names:
                    if (a.asname or a.name.partition(".")[0]) == name:
                        return a.name
        return None

    def where(self, path: Path, node: ast.stmt) -> str:
        return f"{path.relative_to(self.root)}:{node.lineno}"


def _check_import(src: Source, path: Path, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    where = src.where(path, node)
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name.startswith("batchpilot.") and a.name not in src.modules:
                yield f"{where} imports {a.name}, which is no module of batchpilot"
        return
    module = node.module or ""
    if node.level or not (module == "batchpilot" or module.startswith("batchpilot.")) or module in PUBLIC_API:
        return
    if module not in src.modules:
        yield f"{where} imports from {module}, which is no module of batchpilot"
        return
    for a in node.names:
        if a.name == "*":
            yield f"{where}: from {module} import * (name each name, from the module defining it)"
        elif not src.provides(module, a.name):
            yield (f"{where} imports {a.name} from {module}, which does not define it "
                   f"(it is {src.home(module, a.name)}: import it from there)")


def shim_imports(src: Source, folders: tuple[str, ...] = IMPORTERS) -> list[str]:
    """Every import of a batchpilot name through a module that does not define it (or of a
    module that does not exist), as ``file:line imports Y from X, which does not define it (it
    is Z...)``; function-local imports count."""
    return [msg for path in src.files(folders) for node in ast.walk(src.tree(path))
            if isinstance(node, (ast.Import, ast.ImportFrom)) for msg in _check_import(src, path, node)]


def all_lists_foreign_names(src: Source) -> list[str]:
    """Every ``__all__`` entry naming something its module does not define."""
    found = []
    for module, path in src.modules.items():
        for stmt in _top_level(src.tree(path).body):
            if "__all__" not in _defines(stmt) or module in PUBLIC_API:
                continue
            value = getattr(stmt, "value", None)
            if not isinstance(value, (ast.List, ast.Tuple)):
                found.append(f"{src.where(path, stmt)}: __all__ is not a literal list (cannot check it)")
                continue
            for elt in value.elts:
                name = elt.value if isinstance(elt, ast.Constant) else ast.unparse(elt)
                if not isinstance(name, str) or not src.provides(module, name):
                    found.append(f"{src.where(path, stmt)}: __all__ lists {name}, which {module} does not "
                                 f"define (it is {src.home(module, str(name))})")
    return found


def import_markers(src: Source, folders: tuple[str, ...] = SOURCE) -> list[str]:
    """Imports marked as kept for others: ``noqa: F401`` on a ``from`` import, a comment calling
    it a re-export, or a bare ``import  # noqa: F401`` that does not say what it is kept for."""
    found = []
    for path in src.files(folders):
        lines = path.read_text().splitlines()
        for node in ast.walk(src.tree(path)):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            text = "\n".join(lines[node.lineno - 1:node.end_lineno])
            comments = " ".join(re.findall(r"#[^\n]*", text))
            noqa = _NOQA_F401.search(text)
            if re.search(r"re-?export", comments, re.IGNORECASE):
                found.append(f"{src.where(path, node)}: an import commented as a re-export")
            elif noqa and isinstance(node, ast.ImportFrom):
                found.append(f"{src.where(path, node)}: 'from {node.module} import ...' kept unused (noqa: F401)")
            elif noqa and not re.search(r"\w", noqa.group(1)):
                found.append(f"{src.where(path, node)}: 'import ...  # noqa: F401' without the side effect "
                             "it is kept for")
    return found


@pytest.fixture(scope="module")
def repo() -> Source:
    return Source(REPO_ROOT)


def test_every_import_names_the_defining_module(repo: Source) -> None:
    wrong = shim_imports(repo)
    assert not wrong, "imports through a re-export (import from the defining module):\n" + "\n".join(wrong)


def test_no_all_lists_a_name_defined_elsewhere(repo: Source) -> None:
    wrong = all_lists_foreign_names(repo)
    assert not wrong, "re-exports listed in __all__:\n" + "\n".join(wrong)


def test_no_import_is_kept_for_others(repo: Source) -> None:
    wrong = import_markers(repo)
    assert not wrong, "imports kept only to be re-exported:\n" + "\n".join(wrong)


def test_the_checks_see_the_source(repo: Source) -> None:
    """The checks would pass vacuously on a tree they cannot read: they find the modules, the
    importers and what the modules define."""
    assert {"batchpilot.core.pid", "batchpilot.envs.sim_engine", "batchpilot.serving.gateway"} <= set(repo.modules)
    assert {"PIDConfig", "PIDController"} <= repo.defined("batchpilot.core.pid")
    assert "SimEngineConfig" not in repo.defined("batchpilot.envs.sim_engine")  # imported there, to use it
    assert len(repo.files(SOURCE)) > 50 and len(repo.files(("tests",))) > 50


def test_the_folder_map_is_the_installed_one() -> None:
    """PREFIXES is how the package is installed (pyproject.toml's ``package-dir``): a folder
    mapped wrongly would make every import from it look like an import of a missing module."""
    setup = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {folder: name for name, folder in setup["package-dir"].items()} == PREFIXES


def _write(root: Path, files: dict[str, str]) -> Source:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return Source(root)


def test_a_reintroduced_shim_is_named(tmp_path: Path) -> None:
    """A tree with the shims removed in issue 54 written back: each check names the file, the
    name and where it is defined; the side-effect import and a used import pass."""
    src = _write(tmp_path, {
        "batchpilot/__init__.py": "",
        "batchpilot/core/__init__.py": "",
        "batchpilot/core/pid.py": "class PIDConfig:\n    pass\n\nLIMIT: int = 3\n",
        "envs/specs.py": ("from batchpilot.core.pid import LIMIT, PIDConfig  # noqa: F401 (re-exported)\n"
                          "__all__ = ['PIDConfig', 'LIMIT']\n"),
        "envs/user.py": ("import batchpilot.core  # noqa: F401  (registers the pid group)\n"
                         "from batchpilot.core.pid import PIDConfig\n\nDEFAULT = PIDConfig()\n"),
        "serving/gateway.py": "def serve():\n    from batchpilot.envs.specs import PIDConfig\n",
        "tests/test_x.py": "from batchpilot.envs.user import DEFAULT\nfrom batchpilot.serving.settings import X\n",
    })
    assert shim_imports(src) == [
        "serving/gateway.py:2 imports PIDConfig from batchpilot.envs.specs, which does not define it "
        "(it is batchpilot.core.pid.PIDConfig: import it from there)",
        "tests/test_x.py:2 imports from batchpilot.serving.settings, which is no module of batchpilot",
    ]
    assert all_lists_foreign_names(src) == [
        f"envs/specs.py:2: __all__ lists {n}, which batchpilot.envs.specs does not define "
        f"(it is batchpilot.core.pid.{n})" for n in ("PIDConfig", "LIMIT")]
    assert import_markers(src) == ["envs/specs.py:1: an import commented as a re-export"]
    (tmp_path / "envs/specs.py").write_text("from batchpilot.core.pid import PIDConfig  # noqa: F401\n")
    assert import_markers(Source(tmp_path)) == [
        "envs/specs.py:1: 'from batchpilot.core.pid import ...' kept unused (noqa: F401)"]
