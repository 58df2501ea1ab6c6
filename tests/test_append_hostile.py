"""Hostile or damaged top manifests of grown (multi-part) datasets: refused with a packio error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

import packio
from packio.errors import FormatError
from packio.manifest import Manifest

from test_append import contents, make


def resign(path: Path, raw: dict[str, Any]) -> None:
    """Write an edited manifest with a matching digest (a hostile peer can recompute it)."""
    path.write_text(Manifest(**{k: v for k, v in raw.items() if k != "digest"}).to_json())


def edited(tmp_path: Path, edit: Callable[[Path, dict[str, Any]], None]) -> Path:
    a, b = make(tmp_path / "a", ["cat", "dog"], 2, "a"), make(tmp_path / "b", ["dog", "emu"], 2, "b")
    ds = tmp_path / "ds.wds"
    packio.convert(a, ds, progress=False, workers=0)
    packio.convert(b, ds, append=True, progress=False, workers=0)
    raw = json.loads((ds / "packio.json").read_text())
    edit(ds, raw)
    resign(ds / "packio.json", raw)
    return ds


def _count_lies(ds: Path, m: dict[str, Any]) -> None:
    m["extra"]["parts"][1]["count"] += 1
    m["count"] += 1


def _listed_twice(ds: Path, m: dict[str, Any]) -> None:
    parts = m["extra"]["parts"]
    parts.append({"path": "./" + parts[1]["path"], "count": parts[1]["count"]})
    m["count"] += parts[1]["count"]


def _base_twice(ds: Path, m: dict[str, Any]) -> None:
    parts = m["extra"]["parts"]
    parts.append(dict(parts[0]))
    m["count"] += parts[0]["count"]


def _nested(ds: Path, m: dict[str, Any]) -> None:
    sub = ds / m["extra"]["parts"][1]["path"]
    raw = json.loads((sub / "packio.json").read_text())
    raw["extra"] = {"parts": [{"path": ".", "manifest": "x.json", "count": raw["count"]}]}
    resign(sub / "packio.json", raw)


@pytest.mark.parametrize("edit, words", [(_count_lies, "holds 4 samples, .* says 5"), (_listed_twice, "listed twice"),
                                         (_base_twice, "listed twice"), (_nested, "not a tar part")])
def test_hostile_parts_refused(tmp_path: Path, edit: Callable[[Path, dict[str, Any]], None], words: str) -> None:
    ds = edited(tmp_path, edit)
    with pytest.raises(FormatError, match=words):
        packio.open_reader(ds)
    with pytest.raises(FormatError, match=words):
        packio.verify(ds)


def test_append_never_removes_a_listed_part_spelled_otherwise(tmp_path: Path) -> None:
    srcs = [make(tmp_path / t, ["x", "y"], 1, t) for t in "abcd"]
    ds = tmp_path / "ds.wds"
    packio.convert(srcs[0], ds, progress=False, workers=0)
    for src in srcs[1:3]:
        packio.convert(src, ds, append=True, progress=False, workers=0)
    raw = json.loads((ds / "packio.json").read_text())  # a hand edit: part 1 dropped, part 2 spelled "./..."
    parts = raw["extra"]["parts"]
    raw["count"] -= parts.pop(1)["count"]
    parts[1]["path"] = "./part-00002.wds"
    resign(ds / "packio.json", raw)
    before = [k for k, _ in contents(ds)]
    packio.convert(srcs[3], ds, append=True, progress=False, workers=0)
    assert [k for k, _ in contents(ds)] == [*before, "x/d0.png", "y/d0.png"]
    assert packio.verify(ds).ok
