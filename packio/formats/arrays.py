"""Pre-resized uint8 arrays, a folder ``DST.arrays/``: ``images.npy`` uint8[N, H, W, 3] (memory-mapped; a
batch of indices is one fancy-index slice), ``labels.npy`` int64[N], boxes as
``boxes.npy`` float32[M, 4] + ``box_labels.npy`` int64[M] + ``box_offsets.npy``
int64[N+1], ``keys.npy`` (unicode), and the full records (with checksums) in
``records.bin`` / ``records.idx.npy``. Plain ``numpy.load(..., mmap_mode="r")``
reads every array; a batch needs no per-sample record parsing.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from packio.errors import FormatError
from packio.formats.base import FormatSpec, Reader, RecordFile, WriteOptions, Writer, decode_stored, inside
from packio.sample import Sample

_HEADER = 256  # bytes reserved for the .npy header, rewritten with the final N


def _npy_header(shape: tuple[int, ...]) -> bytes:
    d = "{'descr': '|u1', 'fortran_order': False, 'shape': %s, }" % (shape,)
    body = d.encode("latin1")
    pad = _HEADER - 10 - len(body) - 1
    if pad < 0:
        raise ValueError("shape too long for the reserved header")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", _HEADER - 10) + body + b" " * pad + b"\n"


class ArrayWriter(Writer):
    def __init__(self, path: Path, options: WriteOptions) -> None:
        super().__init__(path, options)
        if options.fixed_shape is None:
            raise ValueError("the arrays format needs a fixed image shape")
        path.mkdir(parents=True)
        self._h, self._w = options.fixed_shape
        self._out = open(path / "images.npy", "wb")
        self._out.write(_npy_header((0, self._h, self._w, 3)))
        self._labels: list[int] = []
        self._boxes: list[np.ndarray] = []
        self._box_labels: list[np.ndarray] = []
        self._keys: list[str] = []
        self._records = RecordFile(path)

    def add(self, sample: Sample) -> None:
        img = sample.payload
        if not isinstance(img, np.ndarray) or img.shape != (self._h, self._w, 3) or img.dtype != np.uint8:
            raise ValueError(f"{sample.key}: expected uint8[{self._h}, {self._w}, 3]")
        self._out.write(np.ascontiguousarray(img).data)
        self._labels.append(sample.label)
        self._boxes.append(np.asarray(sample.boxes, np.float32).reshape(-1, 4))
        self._box_labels.append(np.asarray(sample.box_labels, np.int64))
        self._keys.append(sample.key)
        self._records.add(sample.record())
        self.count += 1

    def close(self) -> dict[str, Any]:
        self._out.seek(0)
        self._out.write(_npy_header((self.count, self._h, self._w, 3)))
        self._out.close()
        save = lambda name, arr: np.save(self.path / name, arr, allow_pickle=False)  # noqa: E731
        save("labels.npy", np.asarray(self._labels, np.int64))
        save("boxes.npy", np.concatenate(self._boxes) if self._boxes else np.zeros((0, 4), np.float32))
        save("box_labels.npy", np.concatenate(self._box_labels) if self._box_labels else np.zeros(0, np.int64))
        save("box_offsets.npy", np.concatenate([[0], np.cumsum([len(b) for b in self._boxes])]).astype(np.int64))
        save("keys.npy", np.asarray(self._keys, dtype=str) if self._keys else np.zeros(0, "U1"))
        self._records.close()
        return {"images": "images.npy", "labels": "labels.npy", "shape": [self._h, self._w, 3]}

    def abort(self) -> None:
        self._out.close()
        self._records._out.close()


class ArrayReader(Reader):
    cheap_gather = True

    def _open(self) -> None:
        try:
            images = np.load(inside(self.path, "images.npy"), mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise FormatError(f"{self.path}: cannot map images.npy ({exc}); re-pack the dataset") from None
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[0] != self.manifest.count:
            raise FormatError(f"{self.path}: images.npy is {images.dtype}{list(images.shape)}, but the manifest "
                              f"says {self.manifest.count} uint8 images; the dataset is damaged")
        self._h_images = images
        self._h_flat = np.asarray(images)
        self._h_idx, self._h_blob = RecordFile.load(self.path, self.manifest.count)
        self._h_meta = None

    def _meta(self) -> tuple[np.ndarray, ...]:
        """labels, boxes, box labels, box offsets, keys: loaded and checked once."""
        if self._h_meta is None:
            n = self.manifest.count
            try:
                arrs = [np.load(inside(self.path, f), allow_pickle=False, mmap_mode="r" if f == "keys.npy" else None)
                        for f in ("labels.npy", "boxes.npy", "box_labels.npy", "box_offsets.npy", "keys.npy")]
            except (OSError, ValueError) as exc:
                raise FormatError(f"{self.path}: cannot read the label/box arrays ({exc}); re-pack it") from None
            self._check_root()  # loaded later than the images: from the same dataset?
            labels, boxes, box_labels, off, keys = arrs
            ok = (labels.shape == (n,) and labels.dtype == np.int64 and boxes.dtype == np.float32
                  and boxes.ndim == 2 and boxes.shape[1] == 4 and box_labels.shape == (len(boxes),)
                  and box_labels.dtype == np.int64 and off.shape == (n + 1,) and off.dtype == np.int64
                  and keys.shape == (n,) and keys.dtype.kind == "U"
                  and (n == 0 or (off[0] == 0 and off[-1] == len(boxes) and bool(np.all(np.diff(off) >= 0)))))
            if not ok:
                raise FormatError(f"{self.path}: label/box arrays do not match the manifest's {n} samples; "
                                  f"the dataset is damaged, re-pack it")
            self._h_meta = (labels, boxes, box_labels, off, keys)
        return self._h_meta

    def _drop_handles(self) -> None:
        for k in ("_h_images", "_h_flat", "_h_idx", "_h_blob", "_h_meta"):
            self.__dict__.pop(k, None)

    def read(self, i: int) -> Sample:
        i = self.check_index(i)
        self._ensure_open()
        rec = RecordFile.get(self._h_idx, self._h_blob, i)
        return decode_stored(rec, np.array(self._h_images[i]), f"#{i}")

    def read_many(self, indices: list[int]) -> list[Sample]:
        self._ensure_open()
        idx = np.asarray([self.check_index(i) for i in indices], np.int64)
        block = self._h_flat[idx]  # one gather from the memory map
        return [decode_stored(RecordFile.get(self._h_idx, self._h_blob, int(i)), block[j], f"#{i}")
                for j, i in enumerate(idx)]

    def read_batch(self, indices: list[int]) -> dict[str, Any] | None:
        self._ensure_open()
        idx = np.asarray([self.check_index(i) for i in indices], np.int64)
        labels, boxes, box_labels, off, keys = self._meta()
        a, b = off[idx], off[idx + 1]
        return {"image": self.gather(idx), "label": labels[idx],
                "boxes": [boxes[i:j] for i, j in zip(a.tolist(), b.tolist())],
                "box_labels": [box_labels[i:j] for i, j in zip(a.tolist(), b.tolist())],
                "key": keys[idx].tolist(), "index": idx}

    def gather(self, idx: np.ndarray) -> np.ndarray:
        """uint8[B, H, W, 3] for these indices. From a plain ndarray view of the map:
        several times faster than np.take(out=...) on the np.memmap (tools/bench_levers.py)."""
        self._ensure_open()
        return self._h_flat[idx]

    def images(self) -> np.ndarray:
        """The memory-mapped ``uint8[N, H, W, 3]`` array itself."""
        self._ensure_open()
        return self._h_images


FORMAT = FormatSpec(name="arrays", suffixes=(".arrays",), writer=ArrayWriter, reader=ArrayReader,
                    payload="raw", needs_fixed_shape=True)
