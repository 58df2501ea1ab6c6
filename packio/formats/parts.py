"""Multi-part datasets (written by distributed conversion): a folder whose manifest
lists parts, each a complete dataset of the same format. Global indexing runs
across the parts in order; streaming uses each part's units."""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import numpy as np

from packio.errors import FormatError
from packio.formats.base import FormatSpec, Reader, inside
from packio.manifest import Manifest
from packio.sample import Sample

__all__ = ["MultiPartReader"]


class MultiPartReader(Reader):
    COUNT_FILE = None  # each part checks its own; their sum must equal the count

    def __init__(self, path: Path, manifest: Manifest, spec: FormatSpec) -> None:
        super().__init__(path, manifest)
        parts = manifest.extra.get("parts")
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and isinstance(p.get("path"), str) and isinstance(p.get("count"), int)
                for p in parts):
            raise FormatError(f"{path}: manifest 'parts' is malformed; re-pack the dataset")
        self.parts: list[Reader] = []
        for p in parts:
            sub = inside(path, p["path"])
            if sub == path.resolve():
                raise FormatError(f"{path}: part {p['path']!r} is the dataset itself; re-pack the dataset")
            reader = spec.reader(sub, spec.reader.read_manifest(sub))
            if len(reader) != p["count"]:
                raise FormatError(f"{sub}: holds {len(reader)} samples, the manifest says {p['count']}")
            self.parts.append(reader)
        self.starts = np.concatenate([[0], np.cumsum([len(r) for r in self.parts])]).astype(np.int64).tolist()
        if self.starts[-1] != manifest.count:
            raise FormatError(f"{path}: parts hold {self.starts[-1]} samples, the manifest says {manifest.count}")

    def _open(self) -> None:
        pass

    def close(self) -> None:
        for r in self.parts:
            r.close()

    def _locate(self, i: int) -> tuple[Reader, int]:
        i = self.check_index(i)
        k = bisect.bisect_right(self.starts, i) - 1
        return self.parts[k], i - self.starts[k]

    def read(self, i: int) -> Sample:
        reader, j = self._locate(i)
        return reader.read(j)

    def units(self) -> list[range]:
        out: list[range] = []
        for start, r in zip(self.starts, self.parts):
            out += [range(u.start + start, u.stop + start) for u in r.units()]
        return out

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _pid=None)
