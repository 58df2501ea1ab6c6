"""The module map of packio: every module under packio/, its line count, and the packio
modules it imports (anywhere in the file, lazy imports inside functions included).

    python tests/module_map.py [ROOT]     # ROOT: a checkout (default: this one)
    python tests/module_map.py --cycles   # also list import cycles among top-level imports

One line per module: ``path lines: imported modules``. ``from packio import x`` counts
as importing ``packio.x`` when ``x`` is a module, else ``packio``.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

__all__ = ["module_map", "cycles"]


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    """The absolute module name of a ``from ... import`` (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def module_map(root: Path, *, top_level_only: bool = False) -> dict[str, tuple[str, int, set[str]]]:
    """``{module: (path, lines, packio modules it imports)}`` for every ``packio/**/*.py``
    under ``root``. ``top_level_only``: only imports run when the module is imported
    (module body, not inside functions or ``if TYPE_CHECKING``)."""
    files = sorted((root / "packio").rglob("*.py"))
    names = {_module_name(root, p) for p in files}
    out: dict[str, tuple[str, int, set[str]]] = {}
    for path in files:
        here = _module_name(root, path)
        text = path.read_text()
        tree = ast.parse(text, str(path))
        nodes = _top_level(tree) if top_level_only else ast.walk(tree)
        found: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == "packio")
            elif isinstance(node, ast.ImportFrom):
                mod = _resolve(node, here, path.name == "__init__.py")
                if mod.split(".")[0] != "packio":
                    continue
                subs = {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in names}
                found.update(subs or {mod})
                if len(subs) < len(node.names):  # names that are not modules come from mod itself
                    found.add(mod)
        found.discard(here)
        out[here] = (str(path.relative_to(root)), len(text.splitlines()), found)
    return out


def _top_level(tree: ast.Module) -> list[ast.AST]:
    """Import statements executed on import: the module body, also inside try/if/with,
    not in functions or classes, and not under ``if TYPE_CHECKING``."""
    found: list[ast.AST] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []))
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--cycles", action="store_true", help="also list cycles among import-time imports")
    a = ap.parse_args()
    root = Path(a.root)
    table = module_map(root)
    for _, (path, lines, imports) in sorted(table.items(), key=lambda kv: kv[1][0]):
        print(f"{path} {lines}: {' '.join(sorted(imports))} ")
    print(f"total: {len(table)} modules, {sum(v[1] for v in table.values())} lines")
    if a.cycles:
        eager = {m: v[2] for m, v in module_map(root, top_level_only=True).items()}
        found = cycles(eager)
        print("import-time cycles: " + ("; ".join(" ↔ ".join(c) for c in found) if found else "none"))


if __name__ == "__main__":
    main()
