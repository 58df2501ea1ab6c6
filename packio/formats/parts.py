"""Multi-part datasets (written by distributed conversion or ``convert --append``): a
folder whose manifest lists parts, each a complete dataset of the same format, by path,
count and manifest id. Global indexing runs across the parts in order; streaming uses
each part's units."""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import numpy as np

from packio import limits
from packio.errors import DatasetReplacedError, FormatError
from packio.formats.base import FormatSpec
from packio.formats.columns import LabelColumns
from packio.formats.reader import Reader, inside
from packio.manifest import MANIFEST_NAME, Manifest
from packio.sample import Sample

__all__ = ["MultiPartReader", "part_paths", "samples_text"]


class MultiPartReader(Reader):
    COUNT_FILE = None  # each part checks its own; their sum must equal the count

    def __init__(self, path: Path, manifest: Manifest, spec: FormatSpec) -> None:
        super().__init__(path, manifest)
        parts = manifest.extra.get("parts")
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and isinstance(p.get("path"), str) and isinstance(p.get("count"), int)
                and isinstance(p.get("id", ""), str) for p in parts):
            raise FormatError(f"{path}: manifest 'parts' is malformed; re-pack the dataset")
        self.parts: list[Reader] = []
        seen: set[Path] = set()
        for p in parts:
            reader = self._part(path, p, manifest, spec)
            if len(reader) != p["count"]:
                raise FormatError(f"{reader.path}: holds {len(reader)} samples, {path / MANIFEST_NAME} says "
                                  f"{p['count']}; the dataset is damaged, re-pack it")
            if reader.path.resolve() in seen:  # one folder's samples read twice: wrong data
                raise FormatError(f"{path}: part {p['path']!r} is listed twice; the dataset is damaged, re-pack it")
            seen.add(reader.path.resolve())
            self.parts.append(reader)
        self.starts = np.concatenate([[0], np.cumsum([len(r) for r in self.parts])]).astype(np.int64).tolist()
        if self.starts[-1] != manifest.count:
            raise FormatError(f"{path}: parts hold {self.starts[-1]} samples, the manifest says {manifest.count}")

    @staticmethod
    def _part(path: Path, p: dict[str, Any], manifest: Manifest, spec: FormatSpec) -> Reader:
        """The reader of one listed part: a sub-folder dataset, or (a dataset grown by
        ``convert --append``) the top folder's own files, described by the manifest file
        the part names. A part listed with its manifest id must still hold that id."""
        sub = inside(path, p["path"])
        if sub != path.resolve():
            m = spec.reader.read_manifest(sub)
            where, folder = sub, sub
        else:
            name = p.get("manifest")
            if not isinstance(name, str) or name == MANIFEST_NAME or "/" in name:
                raise FormatError(f"{path}: part {p['path']!r} is the dataset itself; re-pack the dataset")
            where, folder = inside(path, name), path
            m = Manifest.from_json(limits.read_regular(where, limits.MAX_MANIFEST_BYTES), str(where))
        if "id" in p and m.id != p["id"]:
            named = f"{p['path']!r}" + (f" (manifest {where.name})" if folder == path else "")
            raise DatasetReplacedError(
                f"{path}: its part {named} is not the one {MANIFEST_NAME} lists (id "
                f"{m.id or 'none'}, listed {p['id'] or 'none'}): the part was replaced or grown on its own, by a "
                f"conversion into it or by hand. Put the original part back, or re-pack the dataset; a part is "
                f"never a conversion target: append to {path.name} itself")
        if m.format != manifest.format or "parts" in m.extra:
            raise FormatError(f"{where}: not a {manifest.format} part; the dataset is damaged, re-pack it")
        return spec.reader(folder, m)

    def check_stored(self) -> list[str]:
        return [f"{r.path.name if r.path != self.path else '.'}: {line}" for r in self.parts
                for line in r.check_stored()]

    def _open(self) -> None:
        pass

    def close(self) -> None:
        for r in self.parts:
            r.close()

    def _locate(self, i: int) -> tuple[Reader, int]:
        k = bisect.bisect_right(self.starts, i) - 1
        return self.parts[k], i - self.starts[k]

    def _load(self, i: int) -> Sample:
        reader, j = self._locate(i)
        return reader.read(j)

    def _load_key(self, i: int) -> str:
        reader, j = self._locate(i)
        return reader.key(j)

    def _load_columns(self) -> LabelColumns:
        return LabelColumns.joined([r.columns() for r in self.parts])

    def units(self) -> list[range]:
        out: list[range] = []
        for start, r in zip(self.starts, self.parts):
            out += [range(u.start + start, u.stop + start) for u in r.units()]
        return out

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _pid=None)


def part_paths(where: str, manifest: Manifest) -> list[tuple[str, int, int]]:
    """(folder or file, as text, first sample, samples) of each part the manifest lists, below
    ``where`` (a folder or a URL), in order, for the
    lines that tell how to open them with other tools; ``[(path, 0, count)]`` for a dataset
    of one part. Entries a reader would refuse (a path leading out, a count that is not
    one) are left out: these lines name files, they never open them."""
    parts = manifest.extra.get("parts")
    if not isinstance(parts, list):
        return [(where, 0, manifest.count)]
    out, start = [], 0
    for p in parts:
        rel, n = (p.get("path"), p.get("count")) if isinstance(p, dict) else (None, None)
        if not isinstance(rel, str) or rel.startswith("/") or ".." in Path(rel).parts \
                or not isinstance(n, int) or isinstance(n, bool) or n < 0:
            return out
        out.append((f"{where.rstrip('/')}/{rel}", start, n))
        start += n
    return out


def samples_text(first: int, n: int) -> str:
    """``samples 0 to 243`` of a part (``no samples`` when it is empty)."""
    return f"samples {first:,} to {first + n - 1:,}" if n else "no samples"
