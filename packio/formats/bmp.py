"""Pre-resized BMP folder ``DST.bmpdir/``: ``images/{i // 1000:06d}/{i:010d}.bmp`` (decoding a BMP
is a copy, not a JPEG decode) plus ``records.bin`` / ``records.idx.npy``.

This format opens one file per sample by design: it trades file opens for zero
decode cost, which is what the users who asked for it measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from packio import limits
from packio.errors import CorruptSampleError
from packio.formats.base import FormatSpec, RecordFile, WriteOptions, Writer, decode_stored, payload_bytes
from packio.formats.parts import part_paths, samples_text
from packio.formats.reader import Reader, contained
from packio.manifest import Manifest
from packio.sample import Sample, sample_from_record

__all__ = ["BMPWriter", "BMPReader", "FORMAT"]


def _rel(i: int) -> str:
    return f"images/{i // 1000:06d}/{i:010d}.bmp"


class BMPWriter(Writer):
    def __init__(self, path: Path, options: WriteOptions) -> None:
        super().__init__(path, options)
        path.mkdir(parents=True)
        self._records = RecordFile(path)

    def add(self, sample: Sample) -> None:
        if sample.encoding != "bmp":
            raise ValueError("the bmp format stores BMP payloads only")
        p = self.path / _rel(self.count)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(payload_bytes(sample))
        self._records.add(sample.record())
        self.count += 1

    def close(self) -> dict[str, Any]:
        self._records.close()
        return {"images": "images/{i // 1000:06d}/{i:010d}.bmp", "records": RecordFile.BIN}

    def abort(self) -> None:
        self._records.abort()


class BMPReader(Reader):
    COUNT_FILE = RecordFile.IDX

    @classmethod
    def describe(cls, where: str, manifest: Manifest) -> list[str]:
        if "parts" not in manifest.extra:
            return [f"bmp:      {where}/images/000000/0000000000.bmp ... (one BMP file per sample)"]
        parts = part_paths(where, manifest)
        return [f"bmp:      {len(parts)} parts, one BMP file per sample, numbered from 0 in each part:",
                *[f"          {folder}/images/000000/0000000000.bmp ...  # {samples_text(a, n)}"
                  for folder, a, n in parts[:20]],
                *([f"          ... {len(parts) - 20} more: 'packio info --json' lists every part"] if len(parts) > 20
                  else [])]

    def _open(self) -> None:
        self._h_idx, self._h_blob = RecordFile.load(self.path, self.manifest.count)
        self._h_dirs: set[str] = set()  # image folders checked to lie inside the dataset

    def _drop_handles(self) -> None:
        self.__dict__.pop("_h_idx", None)
        self.__dict__.pop("_h_blob", None)
        self.__dict__.pop("_h_dirs", None)

    def _load_key(self, i: int) -> str:
        rec = RecordFile.get(self._h_idx, self._h_blob, i)
        return rec["key"] if isinstance(rec, dict) and isinstance(rec.get("key"), str) else self._load(i).key

    def _load_records(self, idx: np.ndarray) -> list[Sample]:
        """From ``records.bin`` alone: no image file opened."""
        return [sample_from_record(RecordFile.get(self._h_idx, self._h_blob, i), b"") for i in idx.tolist()]

    def _load(self, i: int) -> Sample:
        rec = RecordFile.get(self._h_idx, self._h_blob, i)
        key = str(rec.get("key", f"#{i}")) if isinstance(rec, dict) else f"#{i}"
        path = contained(self.path, _rel(i), self._h_dirs)
        # A FIFO in its place is refused without blocking; a huge file before it is read; a
        # missing one by its open (no stat before it: each system call here is ~1/8 of a read).
        try:
            payload = limits.read_regular(path, limits.MAX_PAYLOAD_BYTES, lambda m: CorruptSampleError(key, m))
        finally:
            self._check_root()  # from the dataset the records came from (gone: because it was replaced?)
        return decode_stored(rec, payload, f"#{i}")


FORMAT = FormatSpec(name="bmp", suffixes=(".bmpdir",), writer=BMPWriter, reader=BMPReader, encoding="bmp",
                    dataset_prefix="BMP", refused_suffixes=((".bmp", "image viewers"),))
