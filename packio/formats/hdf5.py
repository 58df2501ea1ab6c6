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

import errno
import os
import re
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from packio import limits
from packio.errors import CorruptSampleError, FormatError
from packio.formats.base import (FormatSpec, WriteOptions, Writer, decode_stored, file_starts_with, fixed_image_shape,
                                 pack_record, payload_bytes, unpack_record)
from packio.formats.reader import Reader, StoredBatch
from packio.formats.columns import ColumnBuffer, Columns, LabelColumns
from packio.formats.parts import part_paths, samples_text
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


def _append(f: h5py.File, open_sets: dict[str, h5py.Dataset], name: str, data: np.ndarray,
            chunks: tuple[int, ...]) -> None:
    """Append rows to dataset ``name``, kept open in ``open_sets`` for the writer's life:
    releasing a dataset flushes its chunk cache, and a write failing there (a full disk)
    is swallowed by h5py and leaves HDF5 in a state that segfaults later."""
    if name not in open_sets:
        if name not in f:
            f.create_dataset(name, shape=(0, *data.shape[1:]), maxshape=(None, *data.shape[1:]),
                             dtype=data.dtype, chunks=chunks)
        open_sets[name] = f[name]
    d = open_sets[name]
    n = d.shape[0]
    d.resize(n + len(data), axis=0)
    d[n:] = data


class HDF5Writer(Writer):
    def __init__(self, path: Path, options: WriteOptions) -> None:
        super().__init__(path, options)
        self._f = h5py.File(path, "w", libver="latest")
        self._ds: dict[str, h5py.Dataset] = {}
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
        try:
            self._write(self._f, self._buf)
            self._f.flush()  # a full disk shows here, as an exception, not in a later release
        except BaseException as exc:
            _sink(self._f)  # before the exception releases the dataset ids it holds (see _sink)
            raise _write_error(exc) from None
        self._buf = []

    def _write(self, f: h5py.File, buf: list[Sample]) -> None:
        fixed = self.options.fixed_shape
        if fixed is not None:
            _append(f, self._ds, "images", np.stack([s.payload for s in buf]), (1, *fixed, 3))
        else:
            blobs = [payload_bytes(s) for s in buf]
            _append(f, self._ds, "images_bytes", np.frombuffer(b"".join(blobs), np.uint8), (1 << 16,))
            ends = self._offset + np.cumsum([len(b) for b in blobs])
            self._offset = int(ends[-1])
            _append(f, self._ds, "offsets", ends.astype(np.int64), (4096,))
        for name, column in self._columns.drain().items():
            _append(f, self._ds, name, column, (4096, *column.shape[1:]))
        recs = [pack_record(s.record()) for s in buf]
        _append(f, self._ds, "records", np.frombuffer(b"".join(recs), np.uint8), (1 << 16,))
        ends = self._rec_offset + np.cumsum([len(r) for r in recs])
        self._rec_offset = int(ends[-1])
        _append(f, self._ds, "record_offsets", ends.astype(np.int64), (4096,))

    def close(self) -> dict[str, Any]:
        self._flush()
        digests = {n: array_digest(self._f[n]) for n in HASHED if n in self._f}
        _close(self._f)
        return {"layout": "see packio/formats/hdf5.py: images_bytes+offsets or images[N,H,W,3]; labels; "
                          "boxes+box_labels+box_offsets; records+record_offsets (msgpack)",
                "fixed_shape": list(self.options.fixed_shape) if self.options.fixed_shape else None,
                "digests": digests}

    def abort(self) -> None:
        _discard(self._f)

    def write_manifest(self, manifest: Manifest) -> None:
        manifest.files = {}  # one file: its own checksum cannot live inside it; samples carry theirs
        f = h5py.File(self.path, "r+")
        try:
            f.attrs[ATTR] = manifest.to_json()
        except BaseException as exc:
            _discard(f)
            raise _write_error(exc) from None
        _close(f)


def _close(f: h5py.File) -> None:
    """Close a file being written. Everything is flushed first, where a failure (a full
    disk) can still be handled: a failed close cannot (see ``_sink``)."""
    try:
        f.flush()
    except BaseException as exc:
        _discard(f)
        raise _write_error(exc) from None
    f.close()


def _write_error(exc: BaseException) -> BaseException:
    """h5py reports a failed write as OSError or RuntimeError, with HDF5's whole error
    stack as the message: an OSError with the errno and its short text instead."""
    if not isinstance(exc, (OSError, RuntimeError)):
        return exc
    found = re.search(r"errno = (\d+)", str(exc))
    code = int(found.group(1)) if found else getattr(exc, "errno", None) or errno.EIO
    return OSError(code, f"HDF5 write failed: {os.strerror(code)}")


def _discard(f: h5py.File) -> None:
    """Close a file whose content is thrown away, without writing anything to disk."""
    _sink(f)
    try:
        f.close()
    except Exception:
        pass


def _sink(f: h5py.File) -> None:
    """Point the file's descriptor at /dev/null, where every later write succeeds.

    After a failed write (ENOSPC, EFBIG), HDF5 holds dirty data it cannot flush; each
    release of an object id then tries again and fails, which leaves the library in a
    state that segfaults on close or at interpreter exit. Called as soon as a write
    fails, before any id is released; the caller deletes the file."""
    try:
        if f.id.valid:
            sink = os.open(os.devnull, os.O_RDWR)
            os.dup2(sink, f.id.get_vfd_handle())
            os.close(sink)
    except Exception:  # not the sec2 driver, or no descriptor: nothing to redirect
        pass


def _array(f: h5py.File, name: str, dtype: str, shape: tuple[int | None, ...], size: int) -> h5py.Dataset:
    """Dataset ``name``, its declared dtype and shape checked (``None`` = any length) and
    its declared bytes bounded by the file's size, before anything of it is read: the
    shape is the file's claim, and reading ``[:]`` allocates what it claims."""
    d = f.get(name)
    if not isinstance(d, h5py.Dataset):
        raise FormatError(f"{f.filename}: HDF5 dataset {name!r} is missing; the file is damaged, re-pack it")
    if (d.dtype != np.dtype(dtype) or len(d.shape) != len(shape)
            or any(w is not None and w != g for w, g in zip(shape, d.shape)) or d.nbytes > size):
        raise FormatError(f"{f.filename}: HDF5 dataset {name!r} is {d.dtype}{list(d.shape)} ({d.nbytes} bytes); "
                          f"expected {dtype}{['N' if w is None else w for w in shape]} within the file's "
                          f"{size} bytes: the file is damaged, re-pack it")
    return d


def _offsets(f: h5py.File, name: str, n: int, size: int, end: int) -> np.ndarray:
    """``name``'s n+1 offsets, rising from 0 and ending within ``end`` bytes."""
    off = _array(f, name, "<i8", (n + 1,), size)[:]
    if off[0] != 0 or off[-1] > end or bool(np.any(np.diff(off) < 0)):
        raise FormatError(f"{f.filename}: HDF5 dataset {name!r} holds offsets that do not rise from 0 "
                          f"within {end} bytes; the file is damaged, re-pack it")
    return off


class HDF5Reader(Reader):
    COUNT_FILE = ""  # the file itself: 8 bytes of record offsets per sample at the least
    reads_batches = True  # fixed-shape files: one pixel block; others: one h5py read per sample, in turn
    MANIFEST_BESIDE = False  # an attribute of the file

    @classmethod
    def claims(cls, path: str) -> bool:
        return file_starts_with(path, SIGNATURE)

    @classmethod
    def describe(cls, where: str, manifest: Manifest) -> list[str]:
        raw = manifest.extra.get("fixed_shape") or manifest.image.get("payload") == "raw"
        what = f"{'images uint8[N, H, W, 3]' if raw else 'images_bytes + offsets'}, labels, boxes + box_offsets"
        if "parts" not in manifest.extra:
            return [f"hdf5:     h5py.File({where!r}): {what}"]
        parts = part_paths(where, manifest)
        return [f"hdf5:     {len(parts)} parts, one HDF5 file each ({what}; N counts the part's samples):",
                *[f"          h5py.File({f!r})  # {samples_text(a, n)}" for f, a, n in parts[:20]],
                *([f"          ... {len(parts) - 20} more: 'packio info --json' lists every part"] if len(parts) > 20
                  else [])]

    @classmethod
    def open_unlisted(cls, path: str) -> "HDF5Reader":
        return cls(Path(path), cls.read_manifest(Path(path)))

    @classmethod
    def read_manifest(cls, path: Path) -> Manifest:
        limits.file_size(path)  # a FIFO would block h5py's open
        try:
            with h5py.File(path, "r") as f:
                if ATTR not in f.attrs:
                    raise FormatError(f"{path}: an HDF5 file without packio's '{ATTR}' attribute; pack it with packio")
                stored = f.attrs.get_id(ATTR).get_storage_size()
                if stored > limits.MAX_MANIFEST_BYTES:
                    raise FormatError(f"{path}: manifest attribute of {stored} bytes, over packio's limit")
                text = f.attrs[ATTR]
        except (OSError, KeyError, ValueError, RuntimeError) as exc:
            raise FormatError(f"{path}: cannot open as HDF5 ({exc})") from None
        if not isinstance(text, (str, bytes)):
            raise FormatError(f"{path}: the '{ATTR}' attribute is not text; the file is damaged")
        return Manifest.from_json(text, str(path))

    def _open(self) -> None:
        size = limits.file_size(self.path)  # a FIFO would block h5py's open
        try:
            f = h5py.File(self.path, "r")
        except OSError as exc:
            raise FormatError(f"{self.path}: cannot open as HDF5 ({exc})") from None
        self._h_f, self._h_size = f, size
        self._h_fd = f.id.get_vfd_handle()  # h5py's own descriptor, asked for once (15.9k instructions a read)
        n = self.manifest.count
        for name in ARRAYS:
            _contained(f, name, self.path)
        self._h_fixed = n > 0 and "images" in f
        self._h_records = _array(f, "records", "|u1", (None,), size) if n else None
        self._h_recoff = _offsets(f, "record_offsets", n, size, len(self._h_records) if n else 0)
        if not n:  # nothing was written but the first offsets
            self._h_images = self._h_off = None
        elif self._h_fixed:
            shape = fixed_image_shape(self.manifest, self.path)
            self._h_images = _array(f, "images", "|u1", (n, *shape), size)
            self._h_off = None
        else:
            self._h_images = _array(f, "images_bytes", "|u1", (None,), size)
            self._h_off = _offsets(f, "offsets", n, size, len(self._h_images))

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

    def _check_size(self) -> None:
        """HDF5 reads past the end of its file as zeros: a file cut under an open reader
        would hand out zeros silently (one ``fstat`` per read catches it)."""
        size = os.fstat(self._h_fd).st_size
        if size < self._h_size:
            raise FormatError(f"{self.path}: {size} bytes, but it held {self._h_size} when opened: the file was "
                              f"truncated while open; restore or re-pack it")

    def _record(self, i: int) -> Any:
        a, b = int(self._h_recoff[i]), int(self._h_recoff[i + 1])  # checked at open: 0 <= a <= b <= len
        return unpack_record(self._h_records[a:b].tobytes(), f"#{i}")

    def _load(self, i: int) -> Sample:
        self._check_size()
        rec = self._record(i)
        if self._h_fixed:
            payload: Any = self._h_images[i]
        else:
            a, b = int(self._h_off[i]), int(self._h_off[i + 1])  # checked at open: 0 <= a <= b <= len
            if b - a > limits.MAX_PAYLOAD_BYTES:
                raise CorruptSampleError(f"#{i}", f"payload of {b - a} bytes is over packio's limit")
            payload = self._h_images[a:b].tobytes()
        return decode_stored(rec, payload, f"#{i}")

    def _load_batch(self, idx: np.ndarray, threads: Any) -> StoredBatch:
        """Fixed-shape files: one chunk read per image straight into a fresh block,
        labels and boxes from the plain arrays (the keys from the records)."""
        if not self._h_fixed:
            return super()._load_batch(idx, threads)
        self._check_size()
        columns = self._columns()
        d = self._h_images
        out = np.empty((len(idx), *d.shape[1:]), np.uint8)
        for j, i in enumerate(idx.tolist()):
            d.read_direct(out, np.s_[i], np.s_[j])
        keys = [str(self._record(int(i)).get("key", "")) for i in idx]
        labels, boxes, box_labels, counts = columns.take(idx)
        return StoredBatch(idx, pixels=out, labels=labels, boxes=boxes, counts=counts, box_labels=box_labels,
                           keys=keys)

    def _load_columns(self) -> LabelColumns:
        """From the label/box columns: no record, no image read."""
        return self._columns().counted() if self.manifest.count else super()._load_columns()

    def _columns(self) -> Columns:
        """The label/box columns, read and checked once (declared shapes against the file first)."""
        if "_h_meta" not in self.__dict__:
            f, n, size = self._h_f, self.manifest.count, self._h_size
            boxes = _array(f, "boxes", "<f4", (None, 4), size)
            declared = {"labels": _array(f, "labels", "<i8", (n,), size), "boxes": boxes,
                        "box_labels": _array(f, "box_labels", "<i8", (len(boxes),), size),
                        "box_offsets": _array(f, "box_offsets", "<i8", (n + 1,), size)}
            self._h_meta = Columns.checked({k: d[:] for k, d in declared.items()}, n, str(self.path))
        return self._h_meta


FORMAT = FormatSpec(name="hdf5", suffixes=(".h5", ".hdf5"), writer=HDF5Writer, reader=HDF5Reader,
                    raw_when_fixed=True, dataset_prefix="HDF5")
