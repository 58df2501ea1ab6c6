"""Pre-resized uint8 arrays, a folder ``DST.arrays/``: ``images.npy`` uint8[N, H, W, 3] (memory-mapped; a
batch of indices is one fancy-index slice), the label/box columns shared with HDF5
(packio/formats/columns.py) as ``labels.npy``, ``boxes.npy``, ``box_labels.npy``,
``box_offsets.npy``, ``keys.npy`` (unicode), and the full records (with checksums) in
``records.bin`` / ``records.idx.npy``. Plain ``numpy.load(..., mmap_mode="r")``
reads every array; a batch needs no per-sample record parsing.
"""

from __future__ import annotations

import struct
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from packio import limits
from packio.formats.base import FormatSpec, RecordFile, WriteOptions, Writer, decode_stored, fixed_image_shape
from packio.formats.reader import Reader, StoredBatch, inside
from packio.formats.columns import NAMES, ColumnBuffer, Columns, LabelColumns
from packio.formats.parts import part_paths, samples_text
from packio.formats.spill import SpilledColumn, npy_header
from packio.manifest import Manifest
from packio.sample import Sample

__all__ = ["ArrayWriter", "ArrayReader", "FORMAT"]

_KEY_CHUNK = 1 << 13  # keys turned into unicode at a time when keys.npy is written
_SPILL = 1 << 13  # samples whose columns and keys are held before they go to the spill files
_HEADER = 256  # bytes reserved for the .npy header, rewritten with the final N
# the spilled columns: dtype and row shape (keys: their UTF-8 bytes and where each ends)
_SPILLED = {"labels": ("<i8", ()), "boxes": ("<f4", (4,)), "box_labels": ("<i8", ()), "box_offsets": ("<i8", ()),
            "keys": ("u1", ()), "key_ends": ("<i8", ())}


def _npy_header(shape: tuple[int, ...]) -> bytes:
    d = "{'descr': '|u1', 'fortran_order': False, 'shape': %s, }" % (shape,)
    body = d.encode("latin1")
    pad = _HEADER - 10 - len(body) - 1
    if pad < 0:
        raise ValueError("shape too long for the reserved header")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", _HEADER - 10) + body + b" " * pad + b"\n"


def _copy_rows(flat: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = flat[idx]``. np.take, even for a run of consecutive indices: as fast
    as one memcpy of the whole run (tools/loader.py w2), so one path serves every batch.
    Indices are checked already; mode "raise" would buffer a copy of ``out``."""
    np.take(flat, idx, axis=0, out=out, mode="clip")


class ArrayWriter(Writer):
    def __init__(self, path: Path, options: WriteOptions) -> None:
        super().__init__(path, options)
        if options.fixed_shape is None:
            raise ValueError("the arrays format needs a fixed image shape")
        path.mkdir(parents=True)
        self._h, self._w = options.fixed_shape
        self._out = open(path / "images.npy", "wb")
        self._out.write(_npy_header((0, self._h, self._w, 3)))
        self._columns = ColumnBuffer()
        self._keys, self._key_ends = bytearray(), array("q")  # no Python object per sample
        self._key_chars, self._key_bytes = 1, 0  # the longest key; key bytes spilled so far
        # columns and keys go to files beside the output every _SPILL samples: held, they
        # were ~100 B a sample at the peak of a pack; made into the .npy files at close
        self._spill = {name: SpilledColumn(path / f".{name}.spill", *kind) for name, kind in _SPILLED.items()}
        self._records = RecordFile(path)

    def add(self, sample: Sample) -> None:
        img = sample.payload
        if not isinstance(img, np.ndarray) or img.shape != (self._h, self._w, 3) or img.dtype != np.uint8:
            raise ValueError(f"{sample.key}: expected uint8[{self._h}, {self._w}, 3]")
        self._out.write(np.ascontiguousarray(img).data)
        self._columns.add(sample)
        self._keys += sample.key.encode("utf-8", "surrogatepass")
        self._key_ends.append(self._key_bytes + len(self._keys))
        self._key_chars = max(self._key_chars, len(sample.key))
        self._records.add(sample.record())
        self.count += 1
        if not self.count % _SPILL:
            self._flush()

    def _flush(self) -> None:
        """The columns and keys held so far appended to their spill files."""
        for name, col in self._columns.drain().items():
            self._spill[name].append(col)
        self._spill["keys"].append(np.frombuffer(self._keys, np.uint8))
        self._spill["key_ends"].append(np.frombuffer(self._key_ends, np.int64))
        self._key_bytes += len(self._keys)
        self._keys, self._key_ends = bytearray(), array("q")

    def close(self) -> dict[str, Any]:
        self._out.seek(0)
        self._out.write(_npy_header((self.count, self._h, self._w, 3)))
        self._out.close()
        self._flush()
        for name in NAMES:  # box_offsets starts at 0; the spill holds the ends
            self._spill[name].finish(self.path / f"{name}.npy", np.zeros(1, np.int64) if name == "box_offsets" else None)
        self._save_keys()
        self._records.close()
        return {"images": "images.npy", "labels": "labels.npy", "shape": [self._h, self._w, 3]}

    def _save_keys(self) -> None:
        """``keys.npy`` as ``np.save`` writes it, a chunk of keys at a time from the spill
        files: the whole unicode array (4 B a character) is never held."""
        dtype = np.dtype(f"U{self._key_chars}")
        try:
            with open(self.path / "keys.npy", "wb") as f, self._spill["keys"].read_back() as data, \
                    self._spill["key_ends"].read_back() as ends:
                npy_header(f, dtype, (self.count,))
                last = 0
                for k in range(0, self.count, _KEY_CHUNK):
                    part = np.fromfile(ends, np.int64, min(_KEY_CHUNK, self.count - k)).tolist()
                    raw = data.read(part[-1] - last)
                    keys = (raw[a - last:b - last].decode("utf-8", "surrogatepass")
                            for a, b in zip([last, *part[:-1]], part))
                    f.write(np.fromiter(keys, dtype, len(part)).data)
                    last = part[-1]
        finally:
            self._spill["keys"].discard()
            self._spill["key_ends"].discard()

    def abort(self) -> None:
        self._out.close()
        self._records.abort()
        for col in self._spill.values():
            col.discard()


class ArrayReader(Reader):
    """Reads ``images.npy`` (and ``keys.npy``) through memory maps: a page past the end
    of a truncated file would kill the process with SIGBUS, so every read first checks
    (one ``fstat`` each) that the files still hold what their headers claim. Residual
    risk: a truncation between that check and the copy; and :meth:`images` hands out
    the map itself."""

    COUNT_FILE = RecordFile.IDX
    reads_batches = True  # one gather per batch into a pixel block

    @classmethod
    def describe(cls, where: str, manifest: Manifest) -> list[str]:
        shape = ", ".join(map(str, manifest.image.get("shape") or ["H", "W", 3]))
        if "parts" not in manifest.extra:
            n = manifest.count
            return [f"arrays:   {where}/images.npy uint8[{n}, {shape}], labels.npy int64[{n}]"
                    f" (numpy.load(..., mmap_mode='r'))"]
        parts = part_paths(where, manifest)
        return [f"arrays:   {len(parts)} parts, each with images.npy uint8[N, {shape}] and labels.npy int64[N] "
                "(numpy.load(..., mmap_mode='r')):",
                *[f"          {folder}/images.npy  # {samples_text(a, n)}" for folder, a, n in parts[:20]],
                *([f"          ... {len(parts) - 20} more: 'packio info --json' lists every part"] if len(parts) > 20
                  else [])]

    def _open(self) -> None:
        n, shape = self.manifest.count, fixed_image_shape(self.manifest, self.path)
        images = limits.load_npy(inside(self.path, "images.npy"), "|u1", (n, *shape), mmap=True)
        self._h_guard = limits.MapGuard()
        self._h_guard.add(inside(self.path, "images.npy"), images.offset + images.nbytes if n else 0)
        self._h_images = images
        self._h_flat = np.asarray(images)
        self._h_idx, self._h_blob = RecordFile.load(self.path, self.manifest.count)
        self._h_meta = None

    def _meta(self) -> tuple[Columns, np.ndarray]:
        """The label/box columns and the keys: loaded and checked once."""
        if self._h_meta is None:
            n = self.manifest.count
            shapes = {"labels": (n,), "boxes": (None, 4), "box_labels": (None,), "box_offsets": (n + 1,)}
            dtypes = {"labels": "<i8", "boxes": "<f4", "box_labels": "<i8", "box_offsets": "<i8"}
            # headers checked against the manifest and the files' sizes before anything is read
            arrays = {name: limits.load_npy(inside(self.path, f"{name}.npy"), dtypes[name], shapes[name]) for name in NAMES}
            keys = limits.load_npy(inside(self.path, "keys.npy"), "U", (n,), mmap=True)
            self._check_root()  # loaded later than the images: from the same dataset?
            if isinstance(keys, np.memmap):
                self._h_guard.add(inside(self.path, "keys.npy"), keys.offset + keys.nbytes)
            self._h_meta = (Columns.checked(arrays, n, str(self.path)), np.asarray(keys))  # a plain view: no memmap per batch
        return self._h_meta

    def _drop_handles(self) -> None:
        guard = self.__dict__.pop("_h_guard", None)
        if guard is not None:
            guard.close()
        for k in ("_h_images", "_h_flat", "_h_idx", "_h_blob", "_h_meta"):
            self.__dict__.pop(k, None)

    def _load(self, i: int) -> Sample:
        rec = RecordFile.get(self._h_idx, self._h_blob, i)
        self._h_guard.check()
        return decode_stored(rec, np.array(self._h_images[i]), f"#{i}")

    def _load_batch(self, idx: np.ndarray, threads: Any) -> StoredBatch:
        """One gather of the batch's pixels into a fresh block (``threads`` share the
        copy), and its labels and boxes sliced from the columns: no per-sample records."""
        columns, keys = self._meta()
        self._h_guard.check()  # the maps still hold what their headers claim
        flat = self._h_flat
        out = np.empty((len(idx), *flat.shape[1:]), np.uint8)
        k = min(threads.size(), len(idx)) if threads is not None else 1
        if k <= 1:
            _copy_rows(flat, idx, out)
        else:  # numpy copies without the GIL: one core does not reach the memory bandwidth (tools/loader.py w2)
            cuts = [len(idx) * j // k for j in range(k + 1)]
            threads.map(lambda j: _copy_rows(flat, idx[cuts[j]:cuts[j + 1]], out[cuts[j]:cuts[j + 1]]), k)
        labels, boxes, box_labels, counts = columns.take(idx)
        return StoredBatch(idx, pixels=out, labels=labels, boxes=boxes, counts=counts, box_labels=box_labels,
                           keys=keys[idx].tolist())

    def _load_columns(self) -> LabelColumns:
        """From ``labels.npy`` and ``box_offsets.npy``: no record, no image read."""
        return self._meta()[0].counted()

    def _load_key(self, i: int) -> str:
        """From ``keys.npy`` (with the label columns, loaded once): no image, no record read."""
        return str(self._meta()[1][i])

    def images(self) -> np.ndarray:
        """The memory-mapped ``uint8[N, H, W, 3]`` array itself."""
        self._ensure_open()
        return self._h_images


FORMAT = FormatSpec(name="arrays", suffixes=(".arrays",), writer=ArrayWriter, reader=ArrayReader,
                    stores="pixels", needs_fixed_shape=True, dataset_prefix="Array",
                    refused_suffixes=((".npy", "np.load"),), folder_holds="images.npy, labels.npy, ... + packio.json")
