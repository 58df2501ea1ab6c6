"""From stored samples to the batch a training loop gets, in stages with one job each:

read a batch (:meth:`Reader.read_batch`: a pixel block, or samples with a bad one
isolated) → verify (checksum) → decode → resize (into one fresh batch buffer when
every output has one shape) → boxes (follow the resize) → one :class:`Batch`; an
error policy (raise or skip) and a per-process decode thread pool around them.
:class:`Items` strings the stages together for the datasets; nothing here knows
about ranks, workers or epochs.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info

from packio import decode as dec
from packio import geometry as geo
from packio import limits
from packio.collation import Batch, item, stack_images
from packio.errors import CorruptSampleError, DatasetReplacedError, FormatError, PackioError, RemoteError
from packio.formats import open_reader
from packio.formats.base import Reader, StoredBatch
from packio.options import DecodeOptions
from packio.sample import Sample, checksum

__all__ = ["Items", "Decoder", "ErrorPolicy", "DecodeThreads", "batch_buffer"]

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


_helpers: tuple[int, int, Any] | None = None  # (pid, threads, executor): this process's decode helpers


def _helper_pool(count: int) -> Any:
    """This process's one pool of decode helper threads, at least ``count`` of them, shared
    by every dataset (a ``packio.mix`` of ten sources holds one pool, not ten; it only
    grows). A forked child makes its own: the parent's threads are not in it."""
    global _helpers
    now = _helpers
    if now is None or now[0] != os.getpid() or now[1] < count:
        from concurrent.futures import ThreadPoolExecutor

        _helpers = (os.getpid(), count, ThreadPoolExecutor(count, thread_name_prefix="packio-decode"))
        if now is not None and now[0] == os.getpid():
            now[2].shutdown(wait=False)  # what it holds still runs; new work goes to the larger pool
    return _helpers[2]


class DecodeThreads:
    """``count`` threads decode a batch (libjpeg-turbo and OpenCV release the GIL):
    ``count - 1`` helper threads of the process's pool and the calling thread itself pull
    the next index from one shared counter, so there is one task per thread per batch
    (not a future per sample), no thread waits while work is left, and the caller is
    never idle. ``count=None``: as many as torch's own CPU threads
    (``torch.get_num_threads()``, asked at each batch): every core it may use in a
    training process, one in a DataLoader worker (torch sets 1 there),
    ``OMP_NUM_THREADS`` where a launcher set it."""

    def __init__(self, count: int | None) -> None:
        self.count = count

    def size(self) -> int:
        """The threads a batch is shared by now (1: the calling thread alone)."""
        return max(1, torch.get_num_threads() if self.count is None else self.count)

    def map(self, fn: Callable[[int], Any], n: int) -> list[Any]:
        count = min(self.size(), n)
        if count <= 1:
            return [fn(j) for j in range(n)]
        out: list[Any] = [None] * n
        todo = iter(range(n))  # next() on it is atomic under the GIL: each index goes to one thread

        def drain() -> None:
            try:
                for j in todo:
                    out[j] = fn(j)
            except BaseException:  # the batch fails (Ctrl-C, an error): no thread takes another sample
                for _ in todo:
                    pass
                raise

        helpers = []
        try:
            pool = _helper_pool(count - 1)
            for _ in range(count - 1):
                helpers.append(pool.submit(drain))
        except RuntimeError:  # the interpreter is exiting, or the pool was just replaced: this thread does the rest
            pass
        try:
            drain()
        finally:
            for f in helpers:  # no helper may still write into `out`; one not started has nothing left
                if not f.cancel():  # (and waiting for it could wait on this very thread: a nested batch)
                    f.exception()
        for f in helpers:
            if not f.cancelled():
                f.result()
        return out


def batch_buffer(shape: tuple[int, ...]) -> torch.Tensor:
    """A fresh ``uint8`` buffer for one batch, never reused. In a DataLoader worker it is
    made in shared memory: sending the batch to the main process then passes its
    descriptor, where a private buffer is copied into a new segment first (one more
    copy of the batch and its page faults, ~2,300 per 64 images of 224 px).

    Made by torch's ``default_collate``, which in a worker stacks into a new shared
    segment (here a broadcast zero: a fill, no read): the public route to one.
    ``torch.empty(...).share_memory_()`` copies the empty buffer into the segment
    (measured: 8.5 vs 7.8 ms per such batch, buffer costs only, main + workers).
    Anywhere else, or should torch stop doing so, it is a plain fresh tensor.

    The pixels start 16 bytes past a 32-byte boundary (``dec.OUT_SLACK`` bytes more are
    allocated): JPEGs decoded into 32-aligned rows cost up to twice as much (see
    ``packio.decode.OUT_SLACK``)."""
    n = math.prod(shape)
    if get_worker_info() is None:
        flat = torch.empty(n + dec.OUT_SLACK, dtype=torch.uint8)
    else:
        flat = default_collate([torch.zeros((), dtype=torch.uint8).expand(n + dec.OUT_SLACK)])[0]
    at = dec.out_offset(flat.data_ptr())
    return flat[at:at + n].view(shape)


def verify(s: Sample) -> None:
    if s.checksum and checksum(s.payload) != s.checksum:
        raise CorruptSampleError(s.key, "checksum mismatch")


def pixels(s: Sample, backend: str, min_size: tuple[int, int] | None, strict: bool = False,
           out: np.ndarray | None = None) -> np.ndarray:
    """``uint8[H, W, 3]`` of a stored sample (raw payloads are pixels already); ``strict``:
    libjpeg's "corrupt data" warnings are errors too. ``out``: the pixels go there when
    they have its shape (and ``out`` is returned), else they come back on their own."""
    if isinstance(s.payload, np.ndarray):
        if out is None or out.shape != s.payload.shape:
            return s.payload
        np.copyto(out, s.payload)
        return out
    try:
        return dec.decode(s.payload, backend=backend, min_size=min_size, strict=strict, out=out)
    except ValueError as exc:
        raise CorruptSampleError(s.key, f"image does not decode ({exc})") from None


def _room(s: Sample) -> np.ndarray | None:
    """A fresh array of the size the sample's record gives, for its image to be decoded
    into (a JPEG then needs no separate header parse: the array bounds it); None when the
    record gives no size or one over the pixel limit (the decode then checks the header), or
    when the process has no room for the size claimed (a record may claim far more than its
    image: the image alone must still be read under a memory limit)."""
    h, w = s.height, s.width
    if isinstance(s.payload, np.ndarray) or h <= 0 or w <= 0 or h * w > limits.MAX_PIXELS:
        return None
    try:
        return dec.pixel_room(h, w)
    except MemoryError:
        return None


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
    if isinstance(hwc, np.ndarray):  # numpy's transpose, then one tensor: half the cost of a torch permute
        return torch.from_numpy((hwc if hwc.flags.writeable and hwc.flags.c_contiguous else np.array(hwc))
                                .transpose(2, 0, 1))
    return hwc.permute(2, 0, 1)


def _images(buf: torch.Tensor | None, own: list[Any], kept: list[bool]) -> Any:
    """A batch's images: the buffer (NCHW view) when every kept image went into it, else
    one per sample (the buffer's row, or the image that came back on its own, or None for
    a skipped sample), stacked when they are all tensors of one shape."""
    views = buf.permute(0, 3, 1, 2) if buf is not None else None
    if views is not None and all(im is None for im in own):
        return views
    images = [views[j] if im is None and ok else im for j, (im, ok) in enumerate(zip(own, kept))]  # type: ignore[index]
    return stack_images(images) if all(kept) else images


class Decoder:
    """A batch of stored samples → one :class:`Batch`: verify, decode, resize, boxes, transform."""

    def __init__(self, options: DecodeOptions) -> None:
        self.options = options  # checked when made
        self.decode, self.size, self.transform = options.decode, options.resize, options.transform
        self.backend, self.verify = options.backend, options.verify
        # issue 39 (g-geometry): read-time crop/flip; the epoch stays 0 until r1's decoder stage passes it
        self.recipe, self.seed, self.epoch = options.recipe, options.crop_seed, 0

    def one(self, s: Sample, out: np.ndarray | None = None, index: int = 0) -> tuple[Any, np.ndarray, np.ndarray]:
        """``(image, boxes, box_labels)`` of sample ``index`` (fresh arrays). With ``out``
        (a ``uint8[h, w, 3]`` row of the batch buffer) the pixels are decoded or resized into
        it and the image is ``None``, unless they do not have its shape (an unresized image
        of another size): then the image comes back on its own."""
        if self.verify:
            verify(s)
        labels = np.array(s.box_labels, np.int64).reshape(-1)
        if not self.decode:  # as stored: bytes, or the pixels of raw formats (CHW, like decoded ones)
            raw = isinstance(s.payload, np.ndarray)
            return (chw(s.payload) if raw else s.payload), geo.as_boxes(s.boxes), labels
        if self.recipe is not None:  # issue 39 (g-geometry): the one call the read/ decoder stage makes
            try:
                got = dec.place(s.payload, s.encoding, s.width, s.height, s.boxes, labels, self.recipe, self.seed,
                                self.epoch, index, out=out, backend=self.backend, strict=True)
            except ValueError as exc:
                raise CorruptSampleError(s.key, f"image does not decode ({exc})") from None
            image = None if got.image is out else chw(got.image)
            return (image if image is None or self.transform is None else self.transform(image)), got.boxes, \
                got.box_labels
        # strict: libjpeg's warnings are damage, never made-up pixels
        if self.size is not None:
            img = dec.resize(pixels(s, self.backend, self.size, strict=True), self.size, out=out)
        else:
            img = pixels(s, self.backend, None, strict=True, out=_room(s) if out is None else out)
        image = None
        if out is None or img is not out:
            image = chw(np.ascontiguousarray(img))
            if self.transform is not None:
                image = self.transform(image)
        return image, _boxes_for(s, img.shape[0], img.shape[1]), labels

    def item(self, s: Sample, index: int) -> Item:
        """Sample ``index`` (stored as ``s``) as the per-sample dict of a batch holding it:
        the same stages (:meth:`one`), without building a batch around it."""
        image, boxes, labels = self.one(s, None, index)  # fresh arrays
        return item(image, int(s.label), torch.from_numpy(boxes), torch.from_numpy(labels), s.key, index)

    @staticmethod
    def block(stored: StoredBatch) -> Batch:
        """A fixed-shape raw format's pixel block and columns, as they are (fresh arrays)."""
        return Batch(torch.from_numpy(stored.pixels).permute(0, 3, 1, 2), torch.from_numpy(stored.labels),
                     torch.from_numpy(stored.boxes), torch.from_numpy(stored.box_labels),
                     stored.counts.tolist(), list(stored.keys), torch.from_numpy(stored.index.astype(np.int64)))

    def _shape(self, first: Sample | PackioError | None, n: int) -> tuple[int, int] | None:
        """``(h, w)`` of the one buffer a batch of ``n`` starting with ``first`` is decoded into:
        the resize target; unresized, the first image's size from its header (the samples whose
        records give that size go into the buffer; one of another size comes out on its own).
        None with a transform, with nothing to decode, when the first sample is unreadable, or
        when ``n`` images of its size would be over the pixel limit: one header must not make
        every sample of the batch cost that much (each is then decoded on its own)."""
        if not self.decode or self.transform is not None:
            return None
        if self.recipe is not None:
            return self.recipe.size
        if self.size is not None:
            return self.size
        if not isinstance(first, Sample):
            return None
        try:
            h, w = dec.stored_hw(first.payload, first.encoding, 0, 0)
            dec.check_pixels(w, h * n)
        except ValueError:
            return None
        return h, w

    def samples(self, idx: np.ndarray, sample: Callable[[int], Sample | PackioError], pool: "DecodeThreads",
                errors: ErrorPolicy) -> Batch:
        """Decode sample ``j`` = ``sample(j)`` of the batch on ``pool``'s threads, into one
        fresh ``[B, H, W, 3]`` buffer when the outputs have one shape (no image of its own
        per sample, no stacking copy)."""
        n = len(idx)
        first = sample(0) if n else None
        shape = self._shape(first, n)
        buf = batch_buffer((n, *shape, 3)) if shape is not None else None
        rows = buf.numpy() if buf is not None else None
        unresized = self.size is None and self.recipe is None

        def one(j: int) -> tuple[Sample, Any, np.ndarray, np.ndarray] | PackioError:
            s = first if j == 0 else sample(j)
            if isinstance(s, PackioError):
                return s
            fits = rows is not None and (not unresized or (s.height, s.width) in (shape, (0, 0)))
            try:
                return (s, *self.one(s, rows[j] if fits else None, int(idx[j])))  # type: ignore[index]
            except PackioError as exc:
                return exc

        got = pool.map(one, n)
        for j, r in enumerate(got):
            if isinstance(r, PackioError):
                got[j] = errors(r)  # raises, or counts the skip
        kept = [r is not None for r in got]
        for j in (j for j, k in enumerate(kept) if not k and rows is not None):
            rows[j] = 0  # a skipped sample's row: not the buffer's old memory, nor a partial decode
        ok = [r for r in got if r is not None]
        images = _images(buf, [r[1] if r else None for r in got], kept)
        boxes = [np.asarray(r[2], np.float32).reshape(-1, 4) for r in ok]
        box_labels = [r[3] for r in ok]
        return Batch(images, torch.tensor([r[0].label if r else -1 for r in got], dtype=torch.int64),
                     torch.from_numpy(np.concatenate(boxes) if boxes else np.zeros((0, 4), np.float32)),
                     torch.from_numpy(np.concatenate(box_labels) if box_labels else np.zeros(0, np.int64)),
                     [len(r[2]) if r else 0 for r in got], [r[0].key if r else "" for r in got],
                     torch.tensor(idx, dtype=torch.int64), kept)


class Items:
    """What the datasets call: indices → one :class:`Batch`, by one route: the reader's
    :meth:`~Reader.read_batch`, then the decoder. A fixed-shape raw format with nothing
    to decode, resize, transform or verify hands its pixel block on as it is.
    :meth:`one` (``ds[i]``) reads one sample through the same per-sample stages
    (:meth:`Decoder.one`) without a batch around it: a batch's cost was twice the
    sample's on tiny images (tests/test_single_reads.py: both hand out the same dicts)."""

    def __init__(self, path: str | Path, format_name: str | None, options: DecodeOptions) -> None:
        self.options = options
        self.errors = ErrorPolicy(options.on_error)
        self.decoder = Decoder(options)
        self.pool = self._threads(options.threads)
        self.reader: Reader = open_reader(path)
        if format_name and self.reader.manifest.format != format_name:
            raise FormatError(f"{path} holds the {self.reader.manifest.format!r} format, not {format_name!r}; "
                              f"use packio.open_dataset() to open any format")

    @property
    def threads(self) -> int | None:
        return self.pool.count

    @threads.setter
    def threads(self, n: int | None) -> None:
        self.pool = self._threads(n)

    def _threads(self, n: int | None) -> DecodeThreads:
        """``n`` decode threads; by default one with a transform, which may draw random
        numbers: it then sees the samples in order, on one thread."""
        return DecodeThreads(1 if n is None and self.options.transform is not None else n)

    @property
    def _stored_shape(self) -> tuple[int, int] | None:
        shape = (self.reader.manifest.image or {}).get("shape")
        return (int(shape[0]), int(shape[1])) if shape else None

    @property
    def raw_batches(self) -> bool:
        """True when a stored pixel block is exactly the batch's images (stored pixels of
        one shape, nothing to decode, resize, transform or verify)."""
        d, shape = self.decoder, self._stored_shape
        return (shape is not None and d.transform is None and not d.verify and d.recipe is None
                and (not d.decode or d.size is None or d.size == shape))

    def get(self, indices: Sequence[int]) -> Batch:
        idx = self.reader.check_indices(indices)
        if self.raw_batches:
            try:
                stored = self.reader.read_batch(idx, self.pool)
            except PackioError:
                stored = None  # the per-sample route below finds the bad sample and applies on_error
            if stored is not None and stored.pixels is not None:
                return self.decoder.block(stored)
        return self.decoder.samples(idx, self._samples(idx), self.pool, self.errors)

    def one(self, i: int) -> Item | None:
        """Sample ``i`` (a checked index) as :meth:`get` would hand it in a batch, without
        the batch: read, then :meth:`Decoder.item`; ``None`` when skipped as corrupt."""
        try:
            return self.decoder.item(self.reader.read(i), i)
        except PackioError as exc:
            return self.errors(exc)

    def _samples(self, idx: np.ndarray) -> Callable[[int], Sample | PackioError]:
        """Sample ``j`` of the batch, each read on its own (a bad one is its error)."""
        reader = self.reader
        if self.pool.size() > 1 and type(reader).read_many is Reader.read_many:
            # A reader that reads sample by sample: each decode thread reads its own
            # sample (one at a time, under a lock), so reading overlaps the other
            # threads' decoding instead of holding them all up before the batch starts.
            lock = threading.Lock()

            def read(j: int) -> Sample | PackioError:
                with lock:
                    try:
                        return reader.read(int(idx[j]))
                    except PackioError as exc:
                        return exc

            return read
        return Reader.read_batch(reader, idx).samples.__getitem__  # type: ignore[union-attr]
