"""The dataset under diagnosis: an image folder or a packed dataset, read one sample
at a time, and a sample of it exported as a folder for ``packio.convert``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from packio.errors import CorruptSampleError, PackioError, SourceError
from packio.manifest import disk_bytes

__all__ = ["Source", "disk_bytes", "open_source"]


@dataclass
class Source:
    """``kind`` is ``"folder"`` or ``"packed"``; ``count`` samples (folder: files listed)."""

    path: Path
    kind: str
    count: int
    csv: str | None = None
    csv_columns: str | None = None  # the CSV's field=column map, as ``packio convert --csv-columns`` takes it
    format: str | None = None
    _paths: list[str] = field(default_factory=list)  # folder: absolute file paths
    _keys: list[str] = field(default_factory=list)  # folder: keys relative to the root
    _reader: Any = None  # packed: a packio Reader

    @property
    def name(self) -> str:
        """For output names: the folder's name, or a packed dataset's without its suffix."""
        return (self.path.stem if self.kind == "packed" else self.path.name) or "dataset"

    def describe(self) -> str:
        what = "image folder" if self.kind == "folder" else f"packed {self.format} dataset"
        return f"{self.path} ({what}, {self.count} {'files' if self.kind == 'folder' else 'samples'})"

    def payload(self, i: int) -> bytes | np.ndarray:
        """Sample ``i`` as stored: the file's bytes, or the packed payload."""
        if self.kind == "folder":
            with open(self._paths[i], "rb") as f:
                return f.read()
        return self._reader.read(i).payload

    def sizes(self, indices: list[int]) -> list[tuple[int, int]]:
        """(height, width) of these samples as stored, from their headers (a file's first
        MiB); those whose size cannot be told are left out."""
        from packio import decode as dec

        out = []
        for i in indices:
            try:
                if self.kind == "folder":
                    with open(self._paths[i], "rb") as f:
                        head = f.read(1 << 20)
                    w, h = dec.image_size(head, dec.sniff(head) or "")
                else:
                    s = self._reader.read(i)
                    w, h = s.width, s.height
            except (OSError, ValueError, PackioError):
                continue
            out.append((int(h), int(w)))
        return out

    def stored_bytes(self, indices: list[int]) -> float:
        """Mean bytes on disk per sample (folder: the sampled files; packed: the whole dataset / count)."""
        if self.kind == "folder":
            sizes = [os.path.getsize(self._paths[i]) for i in indices]
            return float(np.mean(sizes)) if sizes else 0.0
        return disk_bytes(self.path) / max(self.count, 1)

    def export(self, indices: list[int], dst: Path) -> Path:
        """The samples ``indices`` as an image folder that ``packio.convert`` packs
        like the source: symlinks to the original files (same relative paths, so the
        same labels), or a packed sample's stored bytes (raw pixels as lossless PNG)
        in one folder per label."""
        from packio import decode as dec
        from packio.sample import EXTENSIONS

        dst.mkdir(parents=True)
        for i in indices:
            if self.kind == "folder":
                link = dst / self._keys[i]
                link.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(os.path.abspath(self._paths[i]), link)
                continue
            try:
                s = self._reader.read(i)
            except CorruptSampleError:  # damaged: left out of the sample (measure_stages counts it)
                continue
            data, enc = (dec.encode(s.payload, "png"), "png") if isinstance(s.payload, np.ndarray) else (
                bytes(s.payload), s.encoding)
            folder = dst / (f"label_{s.label:05d}" if s.label >= 0 else "unlabelled")
            folder.mkdir(exist_ok=True)
            (folder / f"{i:010d}.{EXTENSIONS.get(enc, 'bin')}").write_bytes(data)
        return dst


def open_source(path: str | Path, csv: str | Path | None = None, csv_columns: str | None = None) -> Source:
    """An image folder (listed like ``packio convert`` lists it, with ``csv`` read through
    the ``csv_columns`` map) or a packed dataset."""
    from packio.formats import is_packed, open_reader

    p = Path(str(path).rstrip("/") or "/")
    if not p.exists():
        raise SourceError(f"{p}: no such file or folder; give an image folder or a packed dataset")
    if p.is_file() or is_packed(p):
        reader = open_reader(p)
        return Source(path=p, kind="packed", count=len(reader), format=reader.manifest.format, _reader=reader)
    from packio.sources import parse_columns, scan_source

    scan = scan_source(p, csv, parse_columns(csv_columns))
    if not scan.items:
        raise SourceError(f"{p}: no files found; give a folder of images (class sub-folders or flat)")
    return Source(path=p, kind="folder", count=len(scan.items), csv=str(csv) if csv else None,
                  csv_columns=csv_columns if csv else None,
                  _paths=[it.path for it in scan.items], _keys=[it.key for it in scan.items])
