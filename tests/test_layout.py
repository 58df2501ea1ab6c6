"""The floors of docs/layout.md (and ../shared/DESIGN.md) hold: every import run when a
module is imported points to a lower floor, there is no import cycle (not even through
imports inside functions), and no function is over 60 lines. Read from the source
(tests/module_map.py), not from sys.modules."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Floors: a module may import (at import time) only modules of lower floors, or of its own
# subpackage. Subpackages have one floor each.
FLOORS = {
    "packio.errors": 0, "packio.geometry": 0, "packio.measure": 0,
    "packio.limits": 1,
    "packio.sample": 2, "packio.manifest": 2, "packio.decode": 2,
    "packio.sources": 3, "packio.census": 3, "packio.options": 3,
    "packio.formats": 4,
    "packio.remote": 5,
    "packio.read": 6, "packio.pack": 6, "packio.verifier": 6,
    "packio.api": 8, "packio.tuning": 8,
    "packio.preview": 9,
    "packio.doctor": 10, "packio.bench": 10, "packio.cuda": 10,
    "packio.cli": 11, "packio": 11, "packio.__main__": 12,
}
SUBPACKAGES = ("packio.formats", "packio.remote", "packio.doctor", "packio.bench", "packio.cuda", "packio.sources",
               "packio.pack", "packio.read")


def _map(top_level_only: bool) -> dict[str, set[str]]:
    spec = importlib.util.spec_from_file_location("module_map", ROOT / "tests" / "module_map.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["module_map"] = mod
    spec.loader.exec_module(mod)
    return {name: imports for name, (_, _, imports) in mod.module_map(ROOT, top_level_only=top_level_only).items()}


def _group(module: str) -> str:
    return next((p for p in SUBPACKAGES if module == p or module.startswith(p + ".")), module)


@pytest.fixture(scope="module")
def eager() -> dict[str, set[str]]:
    return _map(top_level_only=True)


def test_every_module_has_a_floor_and_imports_only_lower_floors(eager):
    unplaced = sorted(m for m in eager if _group(m) not in FLOORS)
    assert not unplaced, f"place these modules on a floor (docs/layout.md): {unplaced}"
    wrong = [f"{a} → {b}" for a, imports in eager.items() for b in imports
             if _group(a) != _group(b) and FLOORS[_group(b)] >= FLOORS[_group(a)]]
    assert not wrong, f"imports that point up or sideways: {wrong}"


def test_named_floors_of_the_design(eager):
    assert eager["packio.sample"] <= {"packio.errors", "packio.limits"}
    assert eager["packio.errors"] == eager["packio.geometry"] == set()
    read = {_group(b) for a, imports in eager.items() if _group(a) == "packio.read" for b in imports} - {"packio.read"}
    assert read <= {"packio.errors", "packio.decode", "packio.geometry", "packio.limits", "packio.sample",
                    "packio.options", "packio.formats"}, "read/ sits on formats/ (remote/ only inside open_dataset)"
    assert eager["packio"] == set()  # public names load lazily
    outside = {b for a, imports in eager.items() if _group(a) == "packio.cuda" for b in imports
               if _group(b) != "packio.cuda"}
    assert outside <= {"packio.errors", "packio.decode"}
    anywhere = _map(top_level_only=False)
    assert not any(_group(b) == "packio.cuda" for a, imports in anywhere.items() if _group(a) != "packio.doctor"
                   and _group(a) != "packio.cuda" for b in imports), "only cuda/ and the doctor's GPU probe use cuda/"


def test_urls_at_one_edge():
    """URLs are resolved in packio.api alone: no other module outside remote/ imports it,
    not even lazily; there is one is_url, and one pattern of a URL's scheme."""
    anywhere = _map(top_level_only=False)
    users = sorted({a for a, imports in anywhere.items() for b in imports if _group(b) == "packio.remote"
                    and _group(a) != "packio.remote"})
    assert users == ["packio.api"]
    sources = {p: p.read_text() for p in (ROOT / "packio").rglob("*.py")}
    assert [p.name for p, text in sources.items() if "def is_url" in text] == ["errors.py"]
    assert [p.name for p, text in sources.items() if "A-Za-z0-9+" in text] == ["errors.py"]


# The read modules packio/read/ replaces (branch r1-read): they still import each other's
# private classes. At that merge this set goes (and must stay empty).
OLD_READ = {"packio/loading.py", "packio/mixing.py"}


def test_no_private_name_imported_across_modules():
    """``from packio.x import _name`` nowhere: a module's ``_private`` names are its own."""
    found = []
    for path in sorted((ROOT / "packio").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("packio"):
                found += [f"{path.relative_to(ROOT).as_posix()}: {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert [f for f in found if f.split(":")[0] not in OLD_READ] == []


def test_no_import_cycles(eager):
    """No cycle among modules, nor among floors' rooms (a subpackage counts as one), through
    any import anywhere in a file: module body, functions, ``if TYPE_CHECKING``, ``__getattr__``."""
    from module_map import cycles

    anywhere = _map(top_level_only=False)
    assert cycles(eager) == []
    assert cycles(anywhere) == [], "import cycles (lazy imports included): break them, do not hide them"
    rooms: dict[str, set[str]] = {}
    for a, imports in anywhere.items():
        rooms.setdefault(_group(a), set()).update(_group(b) for b in imports if _group(b) != _group(a))
    assert cycles(rooms) == [], "import cycles between subpackages and modules (lazy imports included)"
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the checker finds one


def test_docs_layout_names_every_module():
    page = (ROOT / "docs" / "layout.md").read_text()
    pkg = ROOT / "packio"
    names = [p.name for p in pkg.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    names += [f"{p.name}/" for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    missing = [n for n in names if f"`{n}" not in page]
    assert not missing, f"docs/layout.md does not name {missing}: say where each module sits"


def test_module_map_sees_lazy_imports():
    """The map the cycle check reads counts imports inside functions and ``__getattr__``."""
    anywhere = _map(top_level_only=False)
    assert "packio.read.loader" in anywhere["packio.tuning"]  # imported inside tuning._rate only
    assert "packio.read.datasets" in anywhere["packio.api"]  # inside open_dataset only
    assert "packio.read.datasets" not in _map(top_level_only=True)["packio.api"]
    assert "packio.read.loader" not in _map(top_level_only=True)["packio.tuning"]


MAX_LINES = 60


def function_lengths(root: Path) -> dict[str, int]:
    """``{"path::Qual.name": lines}`` for every function and method under ``root/packio``
    (nested ones too), counted from the ``def`` line to the last line of the body."""
    out: dict[str, int] = {}
    for path in sorted((root / "packio").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        todo: list[tuple[ast.AST, str]] = [(ast.parse(path.read_text(), str(path)), "")]
        while todo:
            node, prefix = todo.pop()
            for child in ast.iter_child_nodes(node):
                name = prefix
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        out[f"{rel}::{name}"] = child.end_lineno - child.lineno + 1
                    name += "."
                todo.append((child, name))
    return out


def test_no_function_over_60_lines():
    """No function or method anywhere in packio/ is over 60 lines (docstring included)."""
    long = {f: n for f, n in function_lengths(ROOT).items() if n > MAX_LINES}
    assert not long, f"functions over {MAX_LINES} lines: split them (one job each): {long}"


def test_function_lengths_sees_nested_functions_and_methods(tmp_path):
    def body(indent: int) -> str:
        return "".join(f"{' ' * indent}x{i} = {i}\n" for i in range(MAX_LINES))

    (tmp_path / "packio").mkdir()
    (tmp_path / "packio" / "m.py").write_text(
        f"class C:\n    def long(self):\n{body(8)}\ndef outer():\n    def inner():\n{body(8)}    return inner\n")
    found = function_lengths(tmp_path)
    assert found == {"packio/m.py::C.long": MAX_LINES + 1, "packio/m.py::outer": MAX_LINES + 3,
                     "packio/m.py::outer.inner": MAX_LINES + 1}
