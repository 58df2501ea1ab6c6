"""Which file each CSV row names, by hashes in numpy (no dict of file names is built).

A name with folders must name its file, relative to the source or to a folder above
it (``train/x.jpg`` for the source ``data/train``). A bare file name (or an id without
extension) names the one file of that name, only when that name is unique among the
files and no other CSV path has it: ``train/x.jpg`` and ``val/x.jpg`` never both land
on one ``x.jpg``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np

from packio.errors import SourceError
from packio.sources.csvrows import Rows
from packio.sources.strings import CHUNK, HashIndex, Strings

__all__ = ["join", "join_stems", "stem_hashes"]

Skip = Callable[[str, str, str], None]
SEVERAL_FILES = "CSV row names several files (give the path relative to the folder)"
MISSING = "CSV row for a missing file"
SEVERAL_PATHS = "CSV file name given with several paths in the CSV (give the path relative to the folder)"


def _hash(s: str) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(s.encode("utf-8", "surrogateescape"))


def _base(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def _stem(name: str) -> str:
    return _base(name).rsplit(".", 1)[0]


class _Index:
    """Strings found by the hash of some part of them (their base name, say)."""

    def __init__(self, strings: Strings, part: Callable[[str], str]) -> None:
        hashes = np.fromiter((_hash(part(s)) for s in strings), np.uint64, len(strings))
        self.order = np.argsort(hashes, kind="stable")
        self.sorted = hashes[self.order]
        self.strings, self.part = strings, part

    def find(self, value: str) -> list[int]:
        """Indices of the strings whose part equals ``value``."""
        h = np.uint64(_hash(value))
        a, b = np.searchsorted(self.sorted, h, "left"), np.searchsorted(self.sorted, h, "right")
        return [i for i in self.order[a:b].tolist() if self.part(self.strings[i]) == value]


def _candidates(top: tuple[str, ...], root: str, name: str) -> list[str]:
    """The keys a CSV path with folders may name: itself, and itself read relative to a
    folder above the source root (whose parts are ``top``)."""
    if name.startswith("/"):
        rel = os.path.relpath(name, root)
        return [] if rel.startswith("..") else [rel]
    parts = [p for p in name.split("/") if p not in ("", ".")]
    out = ["/".join(parts)]
    for k in range(1, min(len(parts), len(top))):
        if tuple(parts[:k]) == top[-k:]:
            out.append("/".join(parts[k:]))
    return out


def join_stems(root: Path, names: Strings) -> np.ndarray:
    """Per CSV name: the hash of the stem of the file names it may name (its bucket).

    Why :func:`join` run apart on each bucket's files and rows (those whose stem hashes
    match) gives the whole join's result: every step relates a row only to files or rows of
    the same stem. An exact name and each of its candidates (the name read relative to a
    folder above the root, an absolute path made relative) end in the same last part, so
    the keys it can match have that base name, hence that stem. A bare name matches keys
    whose base is the name or whose stem is it: their stem is the name's. ``_shared_bases``
    relates rows of one base name ``B``: for ``B`` a plain name (not '', '.', '..': the
    lexical clean-up keeps any other last part), every row with that base has candidates
    ending in ``B``, so the bucket of ``stem(B)``; a bare '', '.' or '..' names no file
    either way (keys have no such base, nor stem: names starting with '.' are not walked).
    Duplicate rows hold equal names; conflicting labels are rows naming one file."""
    top, abs_root = Path(os.path.abspath(root)).parts, os.path.abspath(root)
    out = np.empty(len(names), np.uint64)
    for i, name in enumerate(names):
        found = _candidates(top, abs_root, name) if "/" in name else [name]
        out[i] = _hash(_stem(found[0] if found else name))
    return out


def stem_hashes(keys: Strings) -> np.ndarray:
    """The hash of each key's stem (for keys, what :func:`join_stems` gives names)."""
    return np.fromiter((_hash(_stem(k)) for k in keys), np.uint64, len(keys))


def _shared_bases(rows: Rows) -> set[str]:
    """File names the CSV gives with two or more different paths (few; kept as a set)."""
    pairs = np.stack([np.fromiter((_hash(_base(n)) for n in rows.names), np.uint64, len(rows)),
                      rows.names.hashes()], axis=1) if len(rows) else np.zeros((0, 2), np.uint64)
    distinct = np.unique(pairs, axis=0)
    bases, counts = np.unique(distinct[:, 0], return_counts=True)
    shared = set(bases[counts > 1].tolist())
    return {_base(n) for k, n in enumerate(rows.names) if int(pairs[k, 0]) in shared} if shared else set()

def join(root: Path, keys: Strings, rows: Rows, skip: Skip, strict: bool) -> np.ndarray:
    """Per row: the index of the file it names, -1 when skipped (and counted)."""
    index = HashIndex(keys.hashes())
    found = np.empty(len(rows), np.int32 if len(keys) < 1 << 31 else np.int64)
    for a in range(0, len(rows), CHUNK):  # a chunk of rows at a time: few temporaries per row
        hit = index.lookup(rows.names.hashes(a, min(a + CHUNK, len(rows))))
        for k in np.flatnonzero(hit >= 0).tolist():
            if keys[hit[k]] != rows.names[a + k]:  # equal hashes of different names: look again below
                hit[k] = -1
        found[a:a + len(hit)] = hit
    del index
    todo = np.flatnonzero(found < 0).tolist()
    if not todo:
        return found
    exact = _Index(keys, lambda s: s)
    by_base, by_stem = _Index(keys, _base), _Index(keys, _stem)
    shared = _shared_bases(rows)
    top, abs_root = Path(os.path.abspath(root)).parts, os.path.abspath(root)
    for i in todo:
        name = rows.names[i]
        base, reason = _base(name), ""
        if "/" in name:
            hits = list(dict.fromkeys(j for c in _candidates(top, abs_root, name) for j in exact.find(c)))
        else:
            hits = by_base.find(base) or ([] if "." in base else by_stem.find(base))
            if len(hits) == 1 and base in shared:
                hits, reason = [], SEVERAL_PATHS  # which file is meant is unclear
        if len(hits) == 1:
            found[i] = hits[0]
            continue
        reason = SEVERAL_FILES if hits else reason or MISSING
        if strict:
            raise SourceError(f"{rows.where(i)}: names {name!r}: {reason} (--strict)")
        skip(reason, rows.where(i), name)
    return found
