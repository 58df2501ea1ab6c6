"""The floors of docs/layout.md (and ../shared/DESIGN.md) hold: every
import run when a module is imported points to a lower floor, and there are no
import-time cycles. Read from the source (tests/module_map.py), not from sys.modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Floors: a module may import (at import time) only modules of lower floors, or of its own
# subpackage. Subpackages have one floor each.
FLOORS = {
    "packio.errors": 0, "packio.geometry": 0, "packio.collation": 0,
    "packio.order": 1, "packio.limits": 1,
    "packio.sample": 2, "packio.manifest": 2, "packio.decode": 2,
    "packio.sources": 3, "packio.census": 3, "packio.options": 3,
    "packio.formats": 4,
    "packio.remote": 5, "packio.items": 5,
    "packio.datasets": 6, "packio.converter": 6, "packio.verifier": 6,
    "packio.loading": 7, "packio.preview": 7, "packio.urls": 7, "packio.mixing": 7, "packio.tuning": 8,
    "packio.doctor": 9, "packio.bench": 9, "packio.cuda": 9,
    "packio.cli": 10, "packio": 10, "packio.__main__": 11,
}
SUBPACKAGES = ("packio.formats", "packio.remote", "packio.doctor", "packio.bench", "packio.cuda", "packio.sources")


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
    assert eager["packio.errors"] == eager["packio.geometry"] == eager["packio.collation"] == set()
    assert eager["packio"] == set()  # public names load lazily
    outside = {b for a, imports in eager.items() if _group(a) == "packio.cuda" for b in imports
               if _group(b) != "packio.cuda"}
    assert outside <= {"packio.errors", "packio.decode"}
    anywhere = _map(top_level_only=False)
    assert not any(_group(b) == "packio.cuda" for a, imports in anywhere.items() if _group(a) != "packio.doctor"
                   and _group(a) != "packio.cuda" for b in imports), "only cuda/ and the doctor's GPU probe use cuda/"


def test_urls_at_one_edge():
    """formats, the converter and the verifier never import remote, not even lazily:
    URLs are resolved by packio.urls (and open_dataset), above all three."""
    anywhere = _map(top_level_only=False)
    users = sorted(a for a, imports in anywhere.items() for b in imports if _group(b) == "packio.remote"
                   and _group(a) in ("packio.formats", "packio.converter", "packio.verifier"))
    assert users == []
    from module_map import cycles

    assert cycles(anywhere) == [] or all("packio.remote" not in {_group(m) for m in c} for c in cycles(anywhere))


def test_no_import_time_cycles(eager):
    from module_map import cycles

    assert cycles(eager) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the checker finds one


def test_docs_layout_names_every_module():
    page = (ROOT / "docs" / "layout.md").read_text()
    pkg = ROOT / "packio"
    names = [p.name for p in pkg.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    names += [f"{p.name}/" for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    missing = [n for n in names if f"`{n}" not in page]
    assert not missing, f"docs/layout.md does not name {missing}: say where each module sits"
