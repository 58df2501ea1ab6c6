"""From stored samples to the dicts a training loop gets, in stages with one job each:

read (a batch of samples, isolating a bad one) → verify (checksum) → decode →
resize (into a slot of a batch buffer when every output has one shape) → boxes
(follow the resize) → item dict; an error policy (raise or skip) and a per-process
decode thread pool around them. :class:`Items` strings the stages together for the
datasets; nothing here knows about ranks, workers or epochs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from packio import decode as dec
from packio import geometry as geo
from packio.collation import BufferPool, batch_buffer
from packio.errors import CorruptSampleError, DatasetReplacedError, FormatError, PackioError, RemoteError
from packio.formats import open_reader
from packio.formats.base import Reader
from packio.options import DecodeOptions
from packio.sample import Sample, checksum

__all__ = ["Items", "Decoder", "ErrorPolicy", "DecodeThreads", "read_samples"]

log = logging.getLogger("packio")
Item = dict[str, Any]


class ErrorPolicy:
    """``on_error="raise"`` re-raises a sample's error; ``"skip"`` counts it, warns
    now and then, and hands out ``None`` in its place."""

    def __init__(self, on_error: str) -> None:  # checked by DecodeOptions
        self.on_error = on_error
        self.count = 0

    def __call__(self, exc: PackioError) -> None:
        if self.on_error == "raise" or isinstance(exc, (DatasetReplacedError, RemoteError)):  # not one bad sample
            raise exc
        self.count += 1
        if self.count == 1 or self.count % 100 == 0:
            log.warning("packio: skipped %d corrupt sample(s) so far; latest: %s", self.count, exc)
        return None


class DecodeThreads:
    """``count`` threads per process decode a batch (libjpeg-turbo and OpenCV release
    the GIL): ``count - 1`` pool threads and the calling thread itself pull the next
    index from one shared counter, so there is one task per thread per batch (not a
    future per sample), no thread waits while work is left, and the caller is never
    idle. A forked or unpickled copy makes its own pool."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._pool: tuple[int, Any] | None = None

    def map(self, fn: Callable[[int], Any], n: int) -> list[Any]:
        if self.count <= 1 or n <= 1:
            return [fn(j) for j in range(n)]
        if self._pool is None or self._pool[0] != os.getpid():
            from concurrent.futures import ThreadPoolExecutor

            self._pool = (os.getpid(), ThreadPoolExecutor(self.count - 1, thread_name_prefix="packio-decode"))
        out: list[Any] = [None] * n
        todo = iter(range(n))  # next() on it is atomic under the GIL: each index goes to one thread

        def drain() -> None:
            for j in todo:
                out[j] = fn(j)

        helpers = [self._pool[1].submit(drain) for _ in range(min(self.count, n) - 1)]
        try:
            drain()
        finally:
            for f in helpers:  # even when this thread raised: no helper may still write into `out`
                f.exception()
        for f in helpers:
            f.result()
        return out

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _pool=None)


def read_samples(reader: Reader, indices: Sequence[int]) -> list[Sample | PackioError]:
    """The stored samples, one batch read; a bad one becomes its error, in its place."""
    try:
        return list(reader.read_many(list(indices)))
    except PackioError:
        out: list[Sample | PackioError] = []
        for i in indices:
            try:
                out.append(reader.read(i))
            except PackioError as exc:
                out.append(exc)
        return out


def verify(s: Sample) -> None:
    if s.checksum and checksum(s.payload) != s.checksum:
        raise CorruptSampleError(s.key, "checksum mismatch")


def pixels(s: Sample, backend: str, min_size: tuple[int, int] | None, strict: bool = False) -> np.ndarray:
    """``uint8[H, W, 3]`` of a stored sample (raw payloads are pixels already); ``strict``:
    libjpeg's "corrupt data" warnings are errors too."""
    if isinstance(s.payload, np.ndarray):
        return s.payload
    try:
        return dec.decode(s.payload, backend=backend, min_size=min_size, strict=strict)
    except ValueError as exc:
        raise CorruptSampleError(s.key, f"image does not decode ({exc})") from None


def _boxes_for(sample: Sample, out_h: int, out_w: int) -> np.ndarray:
    """The sample's boxes (xyxy in stored-image pixels) in the pixels of an
    ``out_h`` x ``out_w`` output image: scaled from the stored size, never from a
    decoded shape (a read-time decode may use DCT downscaling)."""
    if not len(sample.boxes):
        return geo.as_boxes(sample.boxes)
    try:
        return geo.resize(sample.boxes, dec.stored_hw(sample.payload, sample.encoding, sample.width, sample.height),
                          (out_h, out_w))
    except ValueError as exc:
        raise CorruptSampleError(sample.key, f"image size unreadable ({exc})") from None


def chw(hwc: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A CHW tensor view of HWC pixels (no copy; a read-only array is copied once)."""
    if isinstance(hwc, np.ndarray):
        hwc = torch.from_numpy(hwc if hwc.flags.writeable and hwc.flags.c_contiguous else np.array(hwc))
    return hwc.permute(2, 0, 1)


def item(index: int, s: Sample, image: Any, boxes: np.ndarray) -> Item:
    return {"image": image, "label": s.label, "boxes": torch.from_numpy(boxes),
            "box_labels": torch.from_numpy(np.array(s.box_labels, np.int64)), "key": s.key, "index": index}


class Decoder:
    """One stored sample → its item: verify, decode, resize, boxes, transform."""

    def __init__(self, options: DecodeOptions) -> None:
        self.options = options  # checked when made
        self.decode, self.size, self.transform = options.decode, options.resize, options.transform
        self.backend, self.verify = options.backend, options.verify

    def __call__(self, index: int, s: Sample, slot: tuple[np.ndarray, torch.Tensor] | None = None) -> Item:
        """``slot``: a batch buffer's ``uint8[h, w, 3]`` slot to resize into, and its CHW view."""
        if self.verify:
            verify(s)
        if not self.decode:  # as stored: bytes, or the pixels of raw formats (CHW, like decoded ones)
            raw = isinstance(s.payload, np.ndarray)
            return item(index, s, chw(s.payload) if raw else s.payload, geo.as_boxes(s.boxes))
        img = pixels(s, self.backend, self.size, strict=True)  # libjpeg's warnings are damage: never made-up pixels
        if slot is not None:
            img = dec.resize(img, self.size, out=slot[0])  # type: ignore[arg-type]
            image = slot[1]
        else:
            if self.size is not None:
                img = dec.resize(img, self.size)
            image = chw(np.ascontiguousarray(img))
        boxes = _boxes_for(s, img.shape[0], img.shape[1])
        return item(index, s, image if self.transform is None else self.transform(image), boxes)


class Items:
    """What the datasets call: indices → item dicts (``None`` for a skipped sample).

    A batch of indices is read in one go, and when every output image has one
    shape its items' images are consecutive slots of one ``[B, H, W, 3]`` buffer:
    decoded and resized straight into it (made in shared memory inside a DataLoader
    worker), or the block a fixed-shape raw format gathers in one read. They are still plain
    per-sample dicts (torch's ``__getitems__`` contract); ``packio.collate`` sees
    the slots and hands out the buffer itself instead of stacking a copy.
    """

    def __init__(self, path: str | Path, format_name: str | None, options: DecodeOptions) -> None:
        self.options = options
        self.errors = ErrorPolicy(options.on_error)
        self.decoder = Decoder(options)
        self.pool = DecodeThreads(options.threads)
        self.buffers = BufferPool()  # batch buffers, reused in the main process (pickled empty)
        self.reader: Reader = open_reader(path)
        if format_name and self.reader.manifest.format != format_name:
            raise FormatError(f"{path} holds the {self.reader.manifest.format!r} format, not {format_name!r}; "
                              f"use packio.open_dataset() to open any format")

    @property
    def threads(self) -> int:
        return self.pool.count

    @threads.setter
    def threads(self, n: int) -> None:
        self.pool = DecodeThreads(n)

    @property
    def _stored_shape(self) -> tuple[int, int] | None:
        shape = (self.reader.manifest.image or {}).get("shape")
        return (int(shape[0]), int(shape[1])) if shape else None

    @property
    def raw_batches(self) -> bool:
        """True when the reader's whole-batch gather gives exactly the items (stored
        pixels, nothing to decode, resize, transform or verify)."""
        d, shape = self.decoder, self._stored_shape
        return (shape is not None and d.transform is None and not d.verify
                and (not d.decode or d.size is None or d.size == shape))

    @property
    def gathers_cheaply(self) -> bool:
        """Batches are one gather from a page-cached memory map: reading them in the
        main process beats sending them from DataLoader workers (tools/bench_levers.py)."""
        return self.reader.cheap_gather and self.raw_batches

    def get(self, indices: Sequence[int]) -> list[Item | None]:
        indices = [int(i) for i in indices]
        if self.raw_batches and len(indices) > 1:
            try:
                got = self.reader.read_batch(indices)
            except PackioError:
                got = None  # the per-sample path below finds the bad one
            if got is not None:
                return self._gathered(got)
        d = self.decoder
        fixed = d.decode and d.size is not None and d.transform is None and len(indices) > 1
        slots: list[Any] = [None] * len(indices)
        if fixed:  # views made once per batch, not once per sample
            buf = batch_buffer(len(indices), *d.size, self.buffers)  # type: ignore[misc]
            slots = list(zip(buf.numpy(), buf.permute(0, 3, 1, 2).unbind(0)))
        samples: list[Sample | PackioError | None]
        lock = None
        if self.pool.count > 1 and type(self.reader).read_many is Reader.read_many:
            # A reader that reads sample by sample: each decode thread reads its own
            # sample (one at a time, under a lock), so reading overlaps the other
            # threads' decoding instead of holding them all up before the batch starts.
            import threading

            lock, samples = threading.Lock(), [None] * len(indices)
        else:
            samples = read_samples(self.reader, indices)  # type: ignore[assignment]

        def one(j: int) -> Item | PackioError:
            s = samples[j]
            if lock is not None:
                with lock:
                    s = read_samples(self.reader, indices[j:j + 1])[0]
            if isinstance(s, PackioError):
                return s
            try:
                return d(indices[j], s, slots[j])  # type: ignore[arg-type]
            except PackioError as exc:
                return exc

        return [self.errors(r) if isinstance(r, PackioError) else r for r in self.pool.map(one, len(indices))]

    def collated(self, indices: Any, pool: BufferPool, copiers: DecodeThreads | None = None) -> dict[str, Any] | None:
        """The whole batch as ``packio.collate`` would make it, straight from the reader's
        whole-array gather into a buffer of ``pool``, with no per-sample Python: for
        :attr:`gathers_cheaply` datasets. ``None`` when a read fails (the per-sample
        path then finds the bad sample and applies ``on_error``). ``copiers``: threads
        that share the copy."""
        read_flat = getattr(self.reader, "read_flat", None)
        h, w = self._stored_shape or (0, 0)
        if read_flat is None or not len(indices):
            return None
        buf = pool.take(len(indices), h, w)
        try:
            got = read_flat(indices, buf.numpy(), copiers)
        except PackioError:
            return None
        counts = got["counts"].tolist()
        boxes = torch.from_numpy(got["boxes"]).split(counts)
        box_labels = torch.from_numpy(got["box_labels"]).split(counts)
        return {"image": buf.permute(0, 3, 1, 2), "label": torch.from_numpy(got["label"]),
                "boxes": list(boxes), "box_labels": list(box_labels), "key": got["key"],
                "index": torch.from_numpy(got["index"])}

    @staticmethod
    def _gathered(got: dict[str, Any]) -> list[Item]:
        """Items over a reader's whole-batch gather: images are views of its block,
        boxes views of one copy of the batch's boxes (a few calls per batch, not per sample)."""
        block = torch.from_numpy(np.ascontiguousarray(got["image"]))
        counts = [len(b) for b in got["boxes"]]
        boxes = torch.from_numpy(np.concatenate(got["boxes"]).astype(np.float32).reshape(-1, 4)).split(counts)
        box_labels = torch.from_numpy(np.concatenate(got["box_labels"]).astype(np.int64)).split(counts)
        return [{"image": image, "label": label, "boxes": b, "box_labels": bl, "key": str(key), "index": index}
                for image, label, b, bl, key, index in zip(block.permute(0, 3, 1, 2).unbind(0), got["label"].tolist(),
                                                           boxes, box_labels, got["key"], got["index"].tolist())]
