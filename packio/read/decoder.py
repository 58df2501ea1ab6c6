"""The decoder: indices of one reader, in one epoch → one :class:`Batch`. Read (``read_batch`` when the
reader ``reads_batches``, else ``read`` per sample on the decode threads: reading overlaps decoding)
→ verify → decode → resize or read-time crop (into one fresh buffer) → boxes → transform, under an
error policy.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

import numpy as np
import torch

from packio import decode as dec
from packio import geometry as geo
from packio import limits
from packio.errors import CorruptSampleError, DatasetReplacedError, PackioError, RemoteError
from packio.formats.reader import Reader, StoredBatch
from packio.options import DecodeOptions
from packio.read.batch import Batch, Item, batch_buffer, item, stack_images
from packio.sample import Sample, checksum

__all__ = ["Decoder", "DecodeThreads", "ErrorPolicy", "chw"]

log = logging.getLogger("packio")
Got = Sample | PackioError  # a stored sample, or the error reading it raised
Decoded = tuple[Any, np.ndarray, np.ndarray, int]  # a sample's image, boxes, box labels, boxes its crop dropped


class ErrorPolicy:
    """``on_error="raise"`` re-raises a sample's error; ``"skip"`` counts it, warns now and then, and
    hands out ``None`` instead. A replaced dataset or a failing remote is no bad sample: it raises."""

    def __init__(self, on_error: str) -> None:  # checked by DecodeOptions
        self.on_error = on_error
        self.count = 0

    @staticmethod
    def fatal(exc: PackioError) -> bool:
        return isinstance(exc, (DatasetReplacedError, RemoteError))

    def __call__(self, exc: PackioError) -> None:
        if self.on_error == "raise" or self.fatal(exc):
            raise exc
        self.count += 1
        if self.count == 1 or self.count % 100 == 0:
            log.warning("packio: skipped %d corrupt sample(s) so far; latest: %s", self.count, exc)
        return None


_helpers: tuple[int, int, Any] | None = None  # (pid, threads, executor): this process's decode helpers


def _helper_pool(count: int) -> Any:
    """This process's one pool of at least ``count`` decode helpers, shared by every dataset (it only
    grows); a forked child makes its own."""
    global _helpers
    now = _helpers
    if now is None or now[0] != os.getpid() or now[1] < count:
        from concurrent.futures import ThreadPoolExecutor

        _helpers = (os.getpid(), count, ThreadPoolExecutor(count, thread_name_prefix="packio-decode"))
        if now is not None and now[0] == os.getpid():
            now[2].shutdown(wait=False)  # what it holds still runs; new work goes to the larger pool
    return _helpers[2]


def _start_helpers(fn: Callable[[], None], n: int, futures: list[Any]) -> None:
    """``fn`` submitted ``n`` times to the helper pool, its futures appended to ``futures``."""
    global _helpers
    pool = None
    try:
        pool = _helper_pool(n)
        for _ in range(n):
            futures.append(pool.submit(fn))
    except RuntimeError:  # the interpreter is exiting, or the pool was just replaced: the caller does the rest
        pass
    except BaseException:
        # Ctrl-C inside submit, while a new helper thread starts: the executor never registers that
        # thread, which would then wait for work forever and keep the process from exiting. The pool
        # is retired (its threads end after their task); the next batch makes a new one.
        if pool is not None:
            if _helpers is not None and _helpers[2] is pool:
                _helpers = None
            pool.shutdown(wait=False)
        raise


class DecodeThreads:
    """``count`` threads decode a batch (libjpeg-turbo and OpenCV release the GIL): ``count - 1`` pool
    helpers and the calling thread pull the next index from one shared counter (one task per thread
    per batch). ``None``: torch's CPU thread count at each batch (every core in a training process,
    1 in a DataLoader worker, ``OMP_NUM_THREADS`` where a launcher set it)."""

    def __init__(self, count: int | None) -> None:
        self.count = count

    def size(self) -> int:
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

        helpers: list[Any] = []
        try:
            _start_helpers(drain, count - 1, helpers)
            drain()
        except BaseException:  # also Ctrl-C while a helper starts, before this thread drains: they stop too
            for _ in todo:
                pass
            raise
        finally:
            for f in helpers:  # no helper may still write into `out`; one not started has nothing left
                if not f.cancel():  # (and waiting for it could wait on this very thread: a nested batch)
                    f.exception()
        for f in helpers:
            if not f.cancelled():
                f.result()
        return out


def chw(hwc: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A CHW tensor view of HWC pixels (no copy; a read-only array is copied once)."""
    if isinstance(hwc, np.ndarray):  # numpy's transpose, then one tensor: half the cost of a torch permute
        return torch.from_numpy((hwc if hwc.flags.writeable and hwc.flags.c_contiguous else np.array(hwc))
                                .transpose(2, 0, 1))
    return hwc.permute(2, 0, 1)


def _pixels(s: Sample, backend: str, min_size: tuple[int, int] | None, out: np.ndarray | None = None) -> np.ndarray:
    """``uint8[H, W, 3]`` of a sample, decoded strictly (libjpeg's "corrupt data" warnings are
    damage, never made-up pixels); into ``out`` when they have its shape."""
    if isinstance(s.payload, np.ndarray):  # raw formats store pixels
        if out is None or out.shape != s.payload.shape:
            return s.payload
        np.copyto(out, s.payload)
        return out
    try:
        return dec.decode(s.payload, backend=backend, min_size=min_size, strict=True, out=out)
    except ValueError as exc:
        raise CorruptSampleError(s.key, f"image does not decode ({exc})") from None


def _room(s: Sample) -> np.ndarray | None:
    """A fresh array of the size the record gives, for the image to be decoded into (no separate
    header parse); None when it gives none, one over the pixel limit, or more than there is room for."""
    h, w = s.height, s.width
    if isinstance(s.payload, np.ndarray) or h <= 0 or w <= 0 or h * w > limits.MAX_PIXELS:
        return None
    try:
        return dec.pixel_room(h, w)
    except MemoryError:
        return None


def _boxes_for(s: Sample, out_h: int, out_w: int) -> np.ndarray:
    """The boxes in an ``out_h`` x ``out_w`` output, scaled from the stored size (a decode may use DCT scaling)."""
    if not len(s.boxes):
        return geo.as_boxes(s.boxes)
    try:
        return geo.resize(s.boxes, dec.stored_hw(s.payload, s.encoding, s.width, s.height), (out_h, out_w))
    except ValueError as exc:
        raise CorruptSampleError(s.key, f"image size unreadable ({exc})") from None


class Decoder:
    """Stored samples → one :class:`Batch` (:meth:`batch_of`) or one sample dict (:meth:`item_of`)."""

    def __init__(self, options: DecodeOptions) -> None:
        self.options = options  # checked when made
        self.errors = ErrorPolicy(options.on_error)
        self.threads = options.threads

    @property
    def threads(self) -> int | None:
        return self.pool.count

    @threads.setter
    def threads(self, n: int | None) -> None:  # by default 1 with a transform: it sees the samples in order
        self.pool = DecodeThreads(1 if n is None and self.options.transform is not None else n)

    def batch_of(self, reader: Reader, indices: Any, epoch: int = 0) -> Batch:
        """Samples ``indices`` of ``reader``, in ``epoch``, as one batch."""
        idx = reader.check_indices(indices)
        o = self.options
        if not reader.reads_batches or (o.verify and (reader.manifest.image or {}).get("shape")):
            return self.samples(idx, self._reads(reader, idx), epoch)  # a block has no checksums to verify
        try:
            stored = reader.read_batch(idx, self.pool)
        except PackioError as exc:
            if self.errors.fatal(exc):
                raise  # never read again sample by sample: every sample would fail alike
            return self.samples(idx, self._reads(reader, idx), epoch)  # finds the bad sample, applies on_error
        block = stored.pixels is not None and o.transform is None and o.recipe is None
        if block and (not o.decode or o.resize in (None, stored.pixels.shape[1:3])):
            return self.block(stored)
        return self.samples(idx, stored.rows().__getitem__, epoch)  # samples, or a block's rows to resize

    def item_of(self, reader: Reader, i: int, epoch: int = 0) -> Item | None:
        """Sample ``i`` (checked) as a batch holds it, without a batch; ``None`` when skipped."""
        try:
            s = reader.read(i)
            image, boxes, labels, _ = self.sample(s, i, epoch)
        except PackioError as exc:
            return self.errors(exc)
        return item(image, int(s.label), torch.from_numpy(boxes), torch.from_numpy(labels), s.key, i)

    def sample(self, s: Sample, index: int, epoch: int, out: np.ndarray | None = None) -> Decoded:
        """``(image, boxes, box_labels, boxes dropped)`` of sample ``index`` stored as ``s``, in ``epoch``.
        With ``out`` (a row of the batch buffer) the pixels go there and the image is ``None``, unless
        they do not fit it."""
        o = self.options
        if o.verify and s.checksum and checksum(s.payload) != s.checksum:
            raise CorruptSampleError(s.key, "checksum mismatch")
        labels = np.array(s.box_labels, np.int64).reshape(-1)
        if not o.decode:  # as stored: bytes, or the pixels of raw formats (CHW, like decoded ones)
            return (chw(s.payload) if isinstance(s.payload, np.ndarray) else s.payload), geo.as_boxes(s.boxes), \
                labels, 0
        if o.recipe is not None:  # issue 39: a plan from (crop_seed, epoch, index, stored size) moves pixels and boxes
            try:
                placed = dec.place(s.payload, s.encoding, s.width, s.height, s.boxes, labels, o.recipe, o.crop_seed,
                                   epoch, index, out=out, backend=o.backend, strict=True)
            except ValueError as exc:
                raise CorruptSampleError(s.key, f"image does not decode ({exc})") from None
            img, boxes, labels, dropped = placed[:4]
        elif o.resize is not None:
            img = dec.resize(_pixels(s, o.backend, o.resize), o.resize, out=out)
        else:
            img = _pixels(s, o.backend, None, out=_room(s) if out is None else out)
        if o.recipe is None:
            boxes, dropped = _boxes_for(s, img.shape[0], img.shape[1]), 0
        image = None
        if out is None or img is not out:
            image = chw(np.ascontiguousarray(img))
            if o.transform is not None:
                image = o.transform(image)
        return image, boxes, labels, dropped

    @staticmethod
    def block(stored: StoredBatch) -> Batch:
        """A fixed-shape raw format's pixel block and columns, as they are (fresh arrays)."""
        return Batch(torch.from_numpy(stored.pixels).permute(0, 3, 1, 2), torch.from_numpy(stored.labels),
                     torch.from_numpy(stored.boxes), torch.from_numpy(stored.box_labels),
                     stored.counts.tolist(), list(stored.keys or []), torch.from_numpy(stored.index.astype(np.int64)))

    def _shape(self, first: Got | None, n: int) -> tuple[int, int] | None:
        """``(h, w)`` of the one buffer a batch is decoded into: the resize target, else the first
        image's header size (None over the pixel limit for ``n``: one header must not size them all)."""
        o = self.options
        if not o.decode or o.transform is not None:
            return None
        if o.out_size is not None or o.recipe is not None:
            return o.out_size
        if not isinstance(first, Sample):
            return None
        try:
            h, w = dec.stored_hw(first.payload, first.encoding, 0, 0)
            dec.check_pixels(w, h * n)
        except ValueError:
            return None
        return h, w

    def _reads(self, reader: Reader, idx: np.ndarray) -> Callable[[int], Got]:
        """Sample ``j``, read by the decode thread that decodes it, one read at a time (reading
        overlaps the other threads' decoding); on one thread, the batch's reads first, in a row."""
        lock = threading.Lock()

        def read(j: int) -> Got:
            with lock:
                try:
                    return reader.read(int(idx[j]))
                except PackioError as exc:
                    return exc

        if self.pool.size() > 1:
            return read
        got = []
        for j in range(len(idx)):
            got.append(read(j))
            if isinstance(got[-1], PackioError) and self.errors.fatal(got[-1]):
                break  # the batch fails on it: no read after
        return got.__getitem__

    def samples(self, idx: np.ndarray, sample: Callable[[int], Got], epoch: int) -> Batch:
        """Decode ``sample(j)`` for each ``j`` on the threads, into one fresh ``[B, H, W, 3]`` buffer
        when the outputs have one shape (no image per sample, no stacking copy)."""
        n = len(idx)
        first = sample(0) if n else None
        shape = self._shape(first, n)
        buf = batch_buffer((n, *shape, 3)) if shape is not None else None
        rows = buf.numpy() if buf is not None else None

        def one(j: int) -> tuple[Any, ...] | PackioError:
            s = first if j == 0 else sample(j)
            if isinstance(s, PackioError):
                if self.errors.fatal(s):
                    raise s  # the batch fails now: no other thread takes another sample
                return s
            fits = rows is not None and (self.options.out_size is not None or (s.height, s.width) in (shape, (0, 0)))
            try:
                return (s, *self.sample(s, int(idx[j]), epoch, rows[j] if rows is not None and fits else None))
            except PackioError as exc:
                return exc

        got = [self.errors(r) if isinstance(r, PackioError) else r for r in self.pool.map(one, n)]
        return self._batch(idx, got, buf, self.options.recipe is not None)

    @staticmethod
    def _batch(idx: np.ndarray, got: list[tuple[Any, ...] | None], buf: torch.Tensor | None, crops: bool) -> Batch:
        """One :class:`Batch` of the decoded samples (``None``: skipped; its buffer row is zeros)."""
        kept = [r is not None for r in got]
        views = buf.permute(0, 3, 1, 2) if buf is not None else None
        for j in (j for j, k in enumerate(kept) if not k and buf is not None):
            buf[j] = 0
        own = [r[1] if r is not None else None for r in got]
        if views is not None and all(im is None for im in own):
            images: Any = views
        else:
            images = [views[j] if im is None and ok and views is not None else im
                      for j, (im, ok) in enumerate(zip(own, kept))]
            images = stack_images(images) if all(kept) else images
        ok = [r for r in got if r is not None]
        boxes = [np.asarray(r[2], np.float32).reshape(-1, 4) for r in ok]
        box_labels = [r[3] for r in ok]
        return Batch(images, torch.tensor([r[0].label if r else -1 for r in got], dtype=torch.int64),
                     torch.from_numpy(np.concatenate(boxes) if boxes else np.zeros((0, 4), np.float32)),
                     torch.from_numpy(np.concatenate(box_labels) if box_labels else np.zeros(0, np.int64)),
                     [len(r[2]) if r else 0 for r in got], [r[0].key if r else "" for r in got],
                     torch.tensor(idx, dtype=torch.int64), kept, dropped=sum(r[4] for r in ok) if crops else None)
