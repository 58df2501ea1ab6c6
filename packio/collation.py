"""Batch samples: stack images, keep variable-length boxes as lists."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import get_worker_info

__all__ = ["Ragged", "ragged", "batch_buffer", "BufferPool", "slots_of_one_buffer", "unpack", "collate", "Leased"]


class Ragged:
    """Variable-length per-sample tensors as one flat tensor + lengths: crosses from
    a DataLoader worker as one tensor. Sending a list of per-sample tensors costs a
    tensor rebuild each on the main process (128 per batch of 64 with boxes and box
    labels; it topped a profile of the main process), which it cannot spare."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.flat = torch.cat(parts) if parts else torch.zeros(0)
        self.lengths = [p.shape[0] for p in parts]

    def split(self) -> list[torch.Tensor]:
        return list(self.flat.split(self.lengths)) if self.lengths else []


def ragged(parts: list[torch.Tensor], packed: bool = False) -> list[torch.Tensor] | Ragged:
    """``packed``: one Ragged. Otherwise, in a DataLoader worker, views of one block
    (one shared-memory segment to send, not one per tensor); in the main process
    the tensors themselves."""
    if not packed and get_worker_info() is None:
        return list(parts)
    r = Ragged(parts)
    return r if packed else r.split()


RING_SLOTS = 6  # per shape and worker: the one it fills, prefetched ones, the one in use, one not yet seen free


def _shared(n: int, h: int, w: int) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared(n * h * w * 3)
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(n, h, w, 3)


class _Ring:
    """A worker's reusable shared-memory batch buffers of one shape. A fresh
    shared-memory buffer costs its page faults and zeroing on both sides (~10 % of
    a worker's time at W1 on a loaded machine; no difference on a quiet one,
    benchmarks/loader.py w1 --compare); a slot is reused only once the main
    process has let go of every tensor on it, which it says through ``busy``
    (a shared byte per slot: the worker sets it when it fills the slot, the main
    process clears it when its storage has no tensor left, see :class:`Leased`)."""

    def __init__(self, n: int, h: int, w: int) -> None:
        self.shape = (n, h, w)
        self.busy = torch.zeros(RING_SLOTS, dtype=torch.uint8).share_memory_()
        self.flags = self.busy.numpy()
        self.slots: list[torch.Tensor] = []

    def take(self) -> torch.Tensor:
        for k, buf in enumerate(self.slots):
            if not self.flags[k]:
                self.flags[k] = 1
                return buf
        if len(self.slots) < RING_SLOTS:
            self.slots.append(_shared(*self.shape))
            self.flags[len(self.slots) - 1] = 1
            return self.slots[-1]
        return _shared(*self.shape)  # every slot still in use in the main process: a fresh buffer

    def slot_of(self, t: torch.Tensor) -> int | None:
        ptr = t.untyped_storage().data_ptr()
        return next((k for k, buf in enumerate(self.slots) if buf.untyped_storage().data_ptr() == ptr), None)


_RINGS: dict[tuple[int, int, int], _Ring] = {}
_RINGS_PID = [0]


def _rings() -> dict[tuple[int, int, int], _Ring]:
    import os

    if _RINGS_PID[0] != os.getpid():  # a forked worker starts with none of its parent's
        _RINGS.clear()
        _RINGS_PID[0] = os.getpid()
    return _RINGS


def batch_buffer(n: int, h: int, w: int, pool: "BufferPool | None" = None) -> torch.Tensor:
    """``uint8[n, h, w, 3]`` for a batch's images; in a DataLoader worker it is a
    shared-memory slot of the worker's ring (see :class:`_Ring`), so the batch
    crosses to the main process without a copy or a fresh allocation; in the main
    process it comes from ``pool`` when given (see :class:`BufferPool`)."""
    if get_worker_info() is None:
        return pool.take(n, h, w) if pool is not None else torch.empty((n, h, w, 3), dtype=torch.uint8)
    rings = _rings()
    ring = rings.get((n, h, w))
    if ring is None:
        ring = rings[(n, h, w)] = _Ring(n, h, w)
    return ring.take()


def _ring_slot(t: torch.Tensor) -> tuple[_Ring, int] | None:
    for ring in _rings().values():
        k = ring.slot_of(t)
        if k is not None:
            return ring, k
    return None


_PENDING: list[tuple[Any, Any, int]] = []  # main process: (weak ref to a slot's storage, busy flags, slot)
MAX_PENDING = 256  # batches kept alive past this are never handed back: their workers allocate fresh ones


def _release_expired() -> None:
    keep = []
    for ref, busy, k in _PENDING:
        if ref.expired():
            busy[k] = 0
        else:
            keep.append((ref, busy, k))
    _PENDING[:] = keep


def _rebuild_leased(images: torch.Tensor, busy: torch.Tensor, k: int) -> torch.Tensor:
    """In the receiving process: hand out the batch's images, and watch the slot's
    storage so that the worker may refill it once no tensor uses it any more."""
    from torch.multiprocessing.reductions import StorageWeakRef

    _release_expired()
    if len(_PENDING) < MAX_PENDING:
        _PENDING.append((StorageWeakRef(images.untyped_storage()), busy.numpy(), k))
    return images


class Leased:
    """A batch's images on a worker's ring slot, as it crosses to the main process,
    where it unpickles to the images tensor itself (``_rebuild_leased``). Only
    ``packio.DataLoader``'s own collate makes these; nothing else sees one."""

    def __init__(self, images: torch.Tensor, busy: torch.Tensor, k: int) -> None:
        self.images, self.busy, self.k = images, busy, k

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_leased, (self.images, self.busy, self.k)


class BufferPool:
    """Reusable ``uint8[n, h, w, 3]`` batch buffers (pinned with ``pin=True``): a buffer
    is handed out again only once nothing else holds its memory (no batch, view or
    numpy array made from it is alive), so a batch a training loop keeps is never
    overwritten; while all are in use a new one is made, up to ``keep`` kept. Reuse
    saves the page faults of fresh memory, which cost about as much as the copy itself,
    and keeps glibc from raising its mmap threshold to a batch's size when one is freed
    (after which decoded images come from the heap, which then only grows: the HDF5
    reader's memory grew by 1.6x over an epoch that way, benchmarks/loader.py memory)."""

    def __init__(self, keep: int = 4, pin: bool = False) -> None:
        self.keep, self.pin = keep, pin
        self._free: list[tuple[torch.Tensor, int]] = []  # (buffer, its storage's use count when idle)

    @staticmethod
    def _uses(t: torch.Tensor) -> int:
        return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))

    def take(self, n: int, h: int, w: int) -> torch.Tensor:
        for buf, idle in self._free:
            if buf.shape[0] >= n and buf.shape[1:3] == (h, w) and self._uses(buf) == idle:
                return buf[:n]
        buf = torch.empty((n, h, w, 3), dtype=torch.uint8, pin_memory=self.pin)
        if hasattr(torch._C, "_storage_Use_Count"):  # private API: without it, never reuse
            if len(self._free) >= self.keep:
                self._free.pop(0)
            self._free.append((buf, self._uses(buf)))
        return buf

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _free=[])


def slots_of_one_buffer(images: list[Any]) -> torch.Tensor | None:
    """``[B, C, H, W]`` over the buffer when ``images`` are its consecutive HWC slots,
    first to last (what one batch read of packio's datasets hands out), else None."""
    first = images[0]
    if not isinstance(first, torch.Tensor) or first._base is None or first.dim() != 3:
        return None
    base, shape, stride = first._base, first.shape, first.stride()
    c, h, w = shape
    if stride != (1, w * c, c):
        return None
    ptr, step = first.data_ptr(), c * h * w * first.element_size()
    for j, im in enumerate(images):  # views of one base tensor (so of one allocation), slot after slot
        if (not isinstance(im, torch.Tensor) or im._base is not base or im.data_ptr() != ptr + j * step
                or im.shape != shape or im.stride() != stride):
            return None
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                   (len(images), h, w, c)).permute(0, 3, 1, 2)


def unpack(batch: Any) -> Any:
    """Turn a worker's packed batch (Ragged fields) back into lists of tensors."""
    if isinstance(batch, dict):
        for k, v in batch.items():
            if isinstance(v, Ragged):
                batch[k] = v.split()
    return batch


def collate(items: list[dict[str, Any] | None], packed: bool = False) -> dict[str, Any]:
    """List of sample dicts → one batch dict.

    ``image``: one ``[B, C, H, W]`` tensor when all shapes agree (decoded images come
    in channels_last memory: call ``.contiguous()`` for NCHW memory), else a list
    (and a list of bytes when not decoded). ``label``/``index``: tensors. ``boxes`` /
    ``box_labels``: lists of per-sample tensors (``packed``: one ``Ragged`` each, for
    ``packio.DataLoader``, which unpacks them). ``None`` items (skipped corrupt
    samples) are dropped.
    """
    items = [x for x in items if x is not None]
    if not items:
        return {"image": [], "label": torch.zeros(0, dtype=torch.int64), "boxes": [], "box_labels": [],
                "key": [], "index": torch.zeros(0, dtype=torch.int64)}
    images: Any = [x["image"] for x in items]
    block = slots_of_one_buffer(images)
    in_worker = get_worker_info() is not None
    slot = _ring_slot(images[0]) if in_worker and isinstance(images[0], torch.Tensor) else None
    if block is not None:
        images = block  # already one batch buffer: no stack, no copy
        if slot is not None and packed:  # packio.DataLoader: the main process hands the slot back
            images = Leased(block, slot[0].busy, slot[1])
    elif all(isinstance(im, torch.Tensor) for im in images) and len({im.shape for im in images}) == 1:
        # Decoded images are CHW views of HWC pixels: stack the HWC memory (a plain
        # copy; stacking the strided views is slower, see benchmarks/loader.py levers) and
        # return NCHW in channels_last memory.
        hwc = all(im.dim() == 3 and im.permute(1, 2, 0).is_contiguous() for im in images)
        parts = [im.permute(1, 2, 0) for im in images] if hwc else images
        out = None
        if in_worker:
            # In a DataLoader worker, stack straight into shared memory: the batch
            # then crosses to the main process without another copy.
            n = len(parts) * parts[0].numel()
            storage = torch.UntypedStorage._new_shared(n * parts[0].element_size())
            out = parts[0].new_empty(0).set_(storage).view(len(parts), *parts[0].shape)
        images = torch.stack(parts, out=out)
        if hwc:
            images = images.permute(0, 3, 1, 2)
    if (slot is not None and isinstance(images, torch.Tensor)
            and images.untyped_storage().data_ptr() != slot[0].slots[slot[1]].untyped_storage().data_ptr()):
        slot[0].flags[slot[1]] = 0  # copied out of the slot (a skipped sample left a gap): free again
    return {
        "image": images,
        "label": torch.tensor([x["label"] for x in items], dtype=torch.int64),
        "boxes": ragged([x["boxes"] for x in items], packed),
        "box_labels": ragged([x["box_labels"] for x in items], packed),
        "key": [x["key"] for x in items],
        "index": torch.tensor([x["index"] for x in items], dtype=torch.int64),
    }
