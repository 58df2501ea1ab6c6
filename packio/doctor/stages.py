"""Per-stage cost of one sample on one core: read, decode, resize, collate, and the
hand-over of a decoded batch from a DataLoader worker to the training process."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from packio import decode as dec
from packio.read.batch import collate, item
from packio.errors import CorruptSampleError

__all__ = ["StageCosts", "measure_stages", "transfer_cost"]

STAGES = ("read", "decode", "resize", "collate", "transfer")


@dataclass
class StageCosts:
    """Mean seconds per sample of each stage, measured on ``n`` samples of ``layout``."""

    layout: str
    n: int
    read: float
    decode: float
    resize: float
    collate: float
    transfer: float
    stored_hw: tuple[int, int]  # mean stored image height, width
    skipped: int = 0  # samples that did not decode
    passes: int = 0  # samples read and decoded while measuring (each timed once or twice)

    @property
    def total(self) -> float:
        return self.read + self.decode + self.resize + self.collate + self.transfer

    def per_core(self) -> float:
        """Samples/s one core could sustain if these stages were all there is."""
        return 1.0 / self.total if self.total > 0 else float("inf")

    def share(self, stage: str) -> float:
        return getattr(self, stage) / self.total if self.total > 0 else 0.0

    def as_loaded(self, workers: bool, resized: bool) -> "StageCosts":
        """The stages a loader with these settings runs: the hand-over from a worker only with
        worker processes, the read-time resize only when the reader resizes (arrays come at
        the training size)."""
        return dataclasses.replace(self, transfer=self.transfer if workers else 0.0,
                                   resize=self.resize if resized else 0.0)


def measure_stages(layout: str, payload: Callable[[int], bytes | np.ndarray], indices: list[int], size: int,
                   batch_size: int, transfer: float, deadline: float | None = None) -> StageCosts:
    """Time each stage per sample, in this process, until ``indices`` run out or
    ``deadline`` (perf_counter) passes (at least 4 samples). Decode is packio's
    (libjpeg-turbo with DCT scaling toward ``size``); resize is packio's read-time
    resize to ``size``×``size``; collate stacks the resized images as packio does.

    Each sample is timed twice and the faster run kept, then the mean is taken over
    samples: a time slice lost to another process is not the stage's cost, but
    a costlier (larger) image is. So ``read`` is a warm page-cache read. Past the
    deadline a sample is timed once, and at least one sample is always measured: a
    huge image (one decode taking seconds) costs one decode here, not nine. Torch runs
    on one thread meanwhile: these are one core's costs, and torch's parallel ops
    stall for whole time slices when the other cores are busy (seen here: 600 ms
    for a 1 ms stack)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(layout, payload, indices, size, batch_size, transfer, deadline)
    finally:
        torch.set_num_threads(threads)


def _measure(layout: str, payload: Callable[[int], bytes | np.ndarray], indices: list[int], size: int,
             batch_size: int, transfer: float, deadline: float | None) -> StageCosts:
    sums = {"read": 0.0, "decode": 0.0, "resize": 0.0}
    items: list[dict[str, Any]] = []
    hw: list[tuple[int, int]] = []
    skipped = done = passes = 0
    _warm_up(size)
    t_start = time.perf_counter()
    share = deadline - t_start if deadline is not None else 0.0
    for k, i in enumerate(indices):
        now = time.perf_counter()
        if deadline is not None and k and now > deadline and (k >= 4 or (now - t_start) / k > share / 4):
            break  # 4 samples at least, unless each takes a good part of the time: a huge image
        runs = [_one(payload, i, size)]
        passes += 1
        if runs[0] is None:
            skipped += 1
            continue
        if deadline is None or 2 * time.perf_counter() - now < deadline:  # a second run fits: the faster kept
            runs.append(_one(payload, i, size))
            passes += 1
        for j, name in enumerate(sums):
            sums[name] += min(r[0][j] for r in runs)  # type: ignore[index]
        _, img, out, stored = runs[0]  # type: ignore[misc]
        done += 1
        hw.append(stored or img.shape[:2])
        items.append(item(torch.from_numpy(np.ascontiguousarray(out)).permute(2, 0, 1), 0, torch.zeros(0, 4),
                          torch.zeros(0, dtype=torch.int64), str(i), i))
    coll = 0.0
    if items:
        chunks = [items[a:a + batch_size] for a in range(0, len(items), batch_size)]
        collate(items[:2])  # warm-up
        for chunk in chunks:
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                collate(chunk)
                best = min(best, time.perf_counter() - t0)
            coll += best
        coll /= len(items)
    n = max(done, 1)
    mean_hw = tuple(int(v) for v in np.mean(hw, axis=0)) if hw else (0, 0)
    return StageCosts(layout=layout, n=done, read=sums["read"] / n, decode=sums["decode"] / n,
                      resize=sums["resize"] / n, collate=coll, transfer=transfer, stored_hw=mean_hw,  # type: ignore[arg-type]
                      skipped=skipped, passes=passes)


def _warm_up(size: int) -> None:
    """Imports and decoder set-up, on a small image of each kind (not on the first sample:
    that may be a huge image, a full decode of its own)."""
    img = np.full((2 * size, 2 * size, 3), 127, np.uint8)
    for enc in ("jpeg", "png"):
        dec.resize(dec.decode(dec.encode(img, enc), min_size=(size, size)), (size, size))


def _one(payload: Callable[[int], bytes | np.ndarray], i: int, size: int) -> tuple | None:
    """((read, decode, resize) seconds, decoded image, resized image, stored (h, w) or None) for sample ``i``."""
    t0 = time.perf_counter()
    try:
        data = payload(i)
    except CorruptSampleError:  # one damaged record: counted as skipped, the diagnosis goes on
        return None
    t1 = time.perf_counter()
    try:
        img = data if isinstance(data, np.ndarray) else dec.decode(data, min_size=(size, size))
    except ValueError:
        return None
    t2 = time.perf_counter()
    out = dec.resize(img, (size, size))
    t3 = time.perf_counter()
    stored = None if isinstance(data, np.ndarray) else _stored_hw(data, img)
    return (t1 - t0, t2 - t1, t3 - t2), img, out, stored


def _stored_hw(data: bytes | memoryview, decoded: np.ndarray) -> tuple[int, int]:
    """The stored image's size (a DCT-scaled decode is smaller than the image)."""
    try:
        w, h = dec.image_size(bytes(data), dec.sniff(data) or "")
        return int(h), int(w)
    except Exception:  # header parsers raise many types; the decoded size is a fair fallback
        return int(decoded.shape[0]), int(decoded.shape[1])


class _BatchStream(IterableDataset):
    """Yields ``count`` freshly made decoded batches, each in shared memory as
    packio's and torch's collate make them in a worker (module level: spawn-safe)."""

    def __init__(self, shape: tuple[int, ...], count: int) -> None:
        self.shape, self.count = shape, count

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self.count):
            yield torch.empty(self.shape, dtype=torch.uint8).share_memory_().fill_(7)


def transfer_cost(batch_size: int, size: int, seconds: float = 0.5) -> float:
    """CPU seconds per sample to hand decoded ``batch_size``×``size``²×3 uint8 batches
    from one DataLoader worker to this process: made in shared memory in the worker,
    received and touched here; both processes' CPU time, after the first batch. CPU
    time, not wall time: other processes on a busy machine stretch the latter."""
    from packio.measure import cpu_seconds

    loader = DataLoader(_BatchStream((batch_size, size, size, 3), 10_000), batch_size=None, num_workers=1,
                        prefetch_factor=2)
    n, t_first, cpu_first = 0, None, 0.0
    it = iter(loader)
    try:
        for batch in it:
            int(batch.view(-1)[::4096].sum())  # touch every page, as a copy to the GPU would
            now = time.perf_counter()
            if t_first is None:  # the first batch is start-up
                t_first, cpu_first = now, cpu_seconds()
                continue
            n += 1
            if now - t_first >= seconds and n >= 5:
                cpu = cpu_seconds() - cpu_first  # while the worker is still alive
                break
        else:
            cpu = cpu_seconds() - cpu_first
    finally:
        del it  # stops the worker
    return cpu / (n * batch_size) if n else 0.0
