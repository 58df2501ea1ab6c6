"""HDF5 (one ``.h5`` file). Layout, readable with plain h5py:

- ``images_bytes`` uint8[total] + ``offsets`` int64[N+1]: encoded image i is
  ``images_bytes[offsets[i]:offsets[i+1]]``; or, for pre-resized fixed-shape data,
  ``images`` uint8[N, H, W, 3] chunked one sample per chunk.
- ``labels``, ``boxes``, ``box_labels``, ``box_offsets``: the label/box columns shared
  with the arrays format (packio/formats/columns.py).
- ``records`` uint8 + ``record_offsets``: packio's msgpack record per sample.
- attribute ``packio_manifest``: the manifest as JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np

from packio.errors import CorruptSampleError, FormatError
from packio.formats.base import (FormatSpec, Reader, WriteOptions, Writer, decode_stored, file_starts_with,
                                 pack_record, payload_bytes, unpack_record)
from packio.formats.columns import NAMES, ColumnBuffer, Columns
from packio.manifest import Manifest
from packio.sample import Sample

__all__ = ["HDF5Writer", "HDF5Reader", "FORMAT"]

ATTR = "packio_manifest"
SIGNATURE = b"\x89HDF\r\n\x1a\n"
_FLUSH = 256
ARRAYS = ("images", "images_bytes", "offsets", "labels", "boxes", "box_labels", "box_offsets", "records",
          "record_offsets")
HASHED = ARRAYS[2:]  # digests in the manifest for verify; every sample's checksum covers its image bytes


def _contained(f: h5py.File, name: str, where: Path) -> h5py.Dataset | None:
    """``f[name]`` if it is a plain dataset stored in this file; refuses links, external
    raw storage and virtual layouts (each can return bytes of other files)."""
    link = f.get(name, getlink=True)
    if link is None:
        return None
    d = f[name] if isinstance(link, h5py.HardLink) else None
    if not isinstance(d, h5py.Dataset) or d.is_virtual or d.external:
        raise FormatError(f"{where}: {name!r} is a link, a virtual dataset or external storage, which can read "
                          f"other files; refusing it (packio writes plain datasets: re-pack the data)")
    return d


def array_digest(d: h5py.Dataset, block: int = 1 << 24) -> str:
    """xxh3_128 of a dataset's bytes in C order, read in blocks of about ``block`` bytes."""
    import xxhash

    h = xxhash.xxh3_128()
    step = max(1, block // max(1, d.dtype.itemsize * int(np.prod(d.shape[1:], dtype=np.int64))))
    for a in range(0, d.shape[0], step):
        h.update(np.ascontiguousarray(d[a:a + step]).data)
    return h.hexdigest()


def _append(f: h5py.File, name: str, data: np.ndarray, chunks: tuple[int, ...]) -> None:
    if name not in f:
        f.create_dataset(name, shape=(0, *data.shape[1:]), maxshape=(None, *data.shape[1:]),
                         dtype=data.dtype, chunks=chunks)
    d = f[name]
    n = d.shape[0]
    d.resize(n + len(data), axis=0)
    d[n:] = data


class HDF5Writer(Writer):
    def __init__(self, path: Path, options: WriteOptions) -> None:
        super().__init__(path, options)
        self._f = h5py.File(path, "w", libver="latest")
        self._buf: list[Sample] = []
        self._offset = 0
        self._columns = ColumnBuffer()
        self._rec_offset = 0
        self._f.create_dataset("offsets", data=np.zeros(1, np.int64), maxshape=(None,), chunks=(4096,))
        self._f.create_dataset("box_offsets", data=np.zeros(1, np.int64), maxshape=(None,), chunks=(4096,))
        self._f.create_dataset("record_offsets", data=np.zeros(1, np.int64), maxshape=(None,), chunks=(4096,))

    def add(self, sample: Sample) -> None:
        self._buf.append(sample)
        self._columns.add(sample)
        self.count += 1
        if len(self._buf) >= _FLUSH:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        f, buf = self._f, self._buf
        fixed = self.options.fixed_shape
        if fixed is not None:
            _append(f, "images", np.stack([s.payload for s in buf]), (1, *fixed, 3))
        else:
            blobs = [payload_bytes(s) for s in buf]
            _append(f, "images_bytes", np.frombuffer(b"".join(blobs), np.uint8), (1 << 16,))
            ends = self._offset + np.cumsum([len(b) for b in blobs])
            self._offset = int(ends[-1])
            _append(f, "offsets", ends.astype(np.int64), (4096,))
        for name, column in self._columns.drain().items():
            _append(f, name, column, (4096, *column.shape[1:]))
        recs = [pack_record(s.record()) for s in buf]
        _append(f, "records", np.frombuffer(b"".join(recs), np.uint8), (1 << 16,))
        ends = self._rec_offset + np.cumsum([len(r) for r in recs])
        self._rec_offset = int(ends[-1])
        _append(f, "record_offsets", ends.astype(np.int64), (4096,))
        self._buf = []

    def close(self) -> dict[str, Any]:
        self._flush()
        digests = {n: array_digest(self._f[n]) for n in HASHED if n in self._f}
        self._f.close()
        return {"layout": "see packio/formats/hdf5.py: images_bytes+offsets or images[N,H,W,3]; labels; "
                          "boxes+box_labels+box_offsets; records+record_offsets (msgpack)",
                "fixed_shape": list(self.options.fixed_shape) if self.options.fixed_shape else None,
                "digests": digests}

    def abort(self) -> None:
        try:
            self._f.close()
        except Exception:
            pass

    def write_manifest(self, manifest: Manifest) -> None:
        manifest.files = {}  # one file: its own checksum cannot live inside it; samples carry theirs
        with h5py.File(self.path, "r+") as f:
            f.attrs[ATTR] = manifest.to_json()


class HDF5Reader(Reader):
    @classmethod
    def claims(cls, path: str) -> bool:
        return file_starts_with(path, SIGNATURE)

    @classmethod
    def describe(cls, path: Path, manifest: Manifest) -> list[str]:
        what = "images uint8[N, H, W, 3]" if manifest.extra.get("fixed_shape") else "images_bytes + offsets"
        return [f"hdf5:     h5py.File('{path}'): {what}, labels, boxes + box_offsets"]

    @classmethod
    def open_unlisted(cls, path: str) -> "HDF5Reader":
        return cls(Path(path), cls.read_manifest(Path(path)))

    @classmethod
    def read_manifest(cls, path: Path) -> Manifest:
        try:
            with h5py.File(path, "r") as f:
                text = f.attrs.get(ATTR)
        except OSError as exc:
            raise FormatError(f"{path}: cannot open as HDF5 ({exc})") from None
        if text is None:
            raise FormatError(f"{path}: an HDF5 file without packio's '{ATTR}' attribute; pack it with packio")
        return Manifest.from_json(text, str(path))

    def _open(self) -> None:
        try:
            f = h5py.File(self.path, "r")
        except OSError as exc:
            raise FormatError(f"{self.path}: cannot open as HDF5 ({exc})") from None
        self._h_f = f
        n = self.manifest.count
        for name in ARRAYS:
            _contained(f, name, self.path)
        try:
            self._h_recoff = f["record_offsets"][:]
            self._h_records = f["records"] if n else None
            self._h_fixed = "images" in f
            self._h_images = f["images"] if self._h_fixed else (f["images_bytes"] if n else None)
            self._h_off = None if self._h_fixed else f["offsets"][:]
        except KeyError as exc:
            raise FormatError(f"{self.path}: HDF5 dataset {exc} is missing; the file is damaged") from None
        count = len(self._h_images) if self._h_fixed else len(self._h_off) - 1
        if len(self._h_recoff) != n + 1 or count != n:
            raise FormatError(f"{self.path}: holds {count} images / {len(self._h_recoff) - 1} records but "
                              f"the manifest says {n}; the file is damaged, re-pack it")

    def _drop_handles(self) -> None:
        for k in [k for k in self.__dict__ if k.startswith("_h_")]:
            del self.__dict__[k]

    def _stored_id(self) -> str:
        try:
            if "_h_f" not in self.__dict__:
                return self.read_manifest(self.path).id
            return Manifest.from_json(self._h_f.attrs.get(ATTR, ""), str(self.path)).id
        except (OSError, FormatError):
            raise self._replaced() from None

    def check_stored(self) -> list[str]:
        """The label, box, record and offset arrays against their digests in the manifest."""
        self._ensure_open()
        digests = self.manifest.extra.get("digests")
        if not isinstance(digests, dict):
            return ["arrays: no digests in the manifest (packed by an older packio); re-pack to protect them"]
        out = []
        for name in HASHED:
            d = _contained(self._h_f, name, self.path)
            if d is None:
                if name in digests:
                    out.append(f"{name}: missing")
            elif name not in digests:
                out.append(f"{name}: not in the manifest's digests")
            elif array_digest(d) != digests[name]:
                out.append(f"{name}: checksum differs")
        return out

    def _record(self, i: int) -> Any:
        a, b = int(self._h_recoff[i]), int(self._h_recoff[i + 1])
        if not 0 <= a <= b:
            raise CorruptSampleError(f"#{i}", "record offsets out of order")
        return unpack_record(self._h_records[a:b].tobytes(), f"#{i}")

    def read(self, i: int) -> Sample:
        i = self.check_index(i)
        self._ensure_open()
        rec = self._record(i)
        if self._h_fixed:
            payload: Any = self._h_images[i]
        else:
            a, b = int(self._h_off[i]), int(self._h_off[i + 1])
            if not 0 <= a <= b:
                raise CorruptSampleError(f"#{i}", "image offsets out of order")
            payload = self._h_images[a:b].tobytes()
        return decode_stored(rec, payload, f"#{i}")

    def read_batch(self, indices: list[int]) -> dict[str, Any] | None:
        """Fixed-shape files: one chunk read per image straight into the batch array,
        labels and boxes from the plain arrays (no per-sample record parsing)."""
        self._ensure_open()
        if not self._h_fixed:
            return None
        f = self._h_f
        if "_h_meta" not in self.__dict__:
            self._h_meta = Columns.checked({k: f[k][:] for k in NAMES if k in f}, self.manifest.count,
                                           str(self.path))
        idx = np.asarray([self.check_index(i) for i in indices], np.int64)
        d = self._h_images
        out = np.empty((len(idx), *d.shape[1:]), np.uint8)
        for j, i in enumerate(idx.tolist()):
            d.read_direct(out, np.s_[i], np.s_[j])
        keys = [str(self._record(int(i)).get("key", "")) for i in idx]
        return {"image": out, **self._h_meta.take(idx), "key": keys, "index": idx}

    def read_many(self, indices: list[int]) -> list[Sample]:
        self._ensure_open()
        if not self._h_fixed or len(indices) < 2:
            return [self.read(i) for i in indices]
        idx = np.asarray([self.check_index(i) for i in indices])
        uniq, inv = np.unique(idx, return_inverse=True)
        block = self._h_images[uniq]  # h5py wants increasing indices: one read, then reorder
        return [decode_stored(self._record(int(i)), block[j], f"#{i}") for i, j in zip(idx, inv)]


FORMAT = FormatSpec(name="hdf5", suffixes=(".h5", ".hdf5"), writer=HDF5Writer, reader=HDF5Reader,
                    raw_when_fixed=True, dataset_prefix="HDF5")
