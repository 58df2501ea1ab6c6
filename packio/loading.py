"""``packio.DataLoader``: torch's DataLoader plus what packio's datasets can do better.

It adds, and nothing else: ``packio.collate`` (boxes cross from workers as one
tensor each), the main-process gather of memory-mapped arrays, ``set_epoch`` /
``epoch``, and a resume state that is a global position: it continues exactly on
any number of ranks and workers (torchdata's StatefulDataLoader, which also works
with packio's datasets and sampler, resumes only with the same ``num_workers``).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Iterator

import torch

from torch.utils.data._utils.pin_memory import pin_memory

from packio.collation import BufferPool, collate, unpack
from packio.datasets import PackedDataset, PackedIterableDataset, ResumableSampler, _Pass, _Resumable
from packio.errors import StateError
from packio.items import DecodeThreads, Items
from packio.order import check_int

__all__ = ["DataLoader"]

log = logging.getLogger("packio")
_WORKER_ARGS = ("num_workers", "persistent_workers", "prefetch_factor", "worker_init_fn", "multiprocessing_context",
                "timeout", "in_order")


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` with ``packio.collate`` and an elastic resume state.

    Resumable over a packio iterable dataset, or a map-style one with
    ``sampler=packio.ResumableSampler(...)``: :meth:`state_dict` counts the batches
    this loader has yielded (each batch is ``batch_size`` positions of the rank's
    sequence, skipped corrupt samples included), and :meth:`load_state_dict`
    continues from there with any ``num_workers`` and any world size.

    Memory-mapped fixed-shape arrays (``.npy``, nothing to decode, resize or
    transform) are gathered a batch at a time in the main process, since sending the
    batch from a worker costs more than the gather itself (tools/bench_levers.py):
    ``num_workers`` threads share each batch's copy instead (one core does not reach
    the memory bandwidth), and the other worker settings are not used.
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, **kwargs: Any) -> None:
        if batch_size is not None:
            batch_size = check_int("batch_size", batch_size, 1)
        items = getattr(dataset, "items", None)
        copiers = 0
        if isinstance(items, Items) and items.gathers_cheaply and kwargs.get("num_workers", 0):
            log.info("packio: memory-mapped arrays are gathered in the main process; num_workers threads copy")
            copiers = min(check_int("num_workers", kwargs["num_workers"], 0), os.cpu_count() or 1)
            for k in _WORKER_ARGS:
                kwargs.pop(k, None)
        self._copiers = DecodeThreads(copiers)
        workers = kwargs.get("num_workers", 0) > 0
        # Our own collate over a gather-cheaply dataset whose items are ours (a subclass may
        # remap indices or items): whole batches straight from the gather.
        ours = isinstance(dataset, PackedDataset) and all(
            getattr(type(dataset), k) is getattr(PackedDataset, k) for k in ("__getitem__", "__getitems__"))
        self._pool = (BufferPool(pin=bool(kwargs.get("pin_memory")) and torch.cuda.is_available())
                      if ours and isinstance(items, Items) and items.gathers_cheaply
                      and kwargs.get("collate_fn") in (None, collate) and batch_size is not None else None)
        kwargs.setdefault("collate_fn", functools.partial(collate, packed=True) if workers else collate)
        if isinstance(dataset, PackedIterableDataset):
            dataset.batch_size = batch_size  # each worker then makes whole batches, in the rank's order
        super().__init__(dataset, batch_size=batch_size, **kwargs)
        self._chunk = batch_size or 1
        self._pass: _Pass | None = None

    @property
    def resumable(self) -> _Resumable | None:
        """What holds the epoch and position: the iterable dataset, or the ResumableSampler."""
        if isinstance(self.dataset, PackedIterableDataset):
            return self.dataset
        return self.sampler if isinstance(self.sampler, ResumableSampler) else None

    def _target(self) -> _Resumable:
        target = self.resumable
        if target is None:
            raise StateError("this loader cannot resume: give it a packio iterable dataset, or a map-style one "
                             "with sampler=packio.ResumableSampler(len(dataset), ...)")
        return target

    @property
    def epoch(self) -> int:
        return self._target().epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a no-op when it is the current one: a resumed epoch keeps its position)."""
        target: Any = self.resumable
        if target is None and hasattr(self.sampler, "set_epoch"):
            target = self.sampler  # e.g. torch's DistributedSampler
        if target is None:
            raise StateError("set_epoch needs a packio iterable dataset or a sampler with set_epoch")
        target.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        target = self.resumable
        if target is None:
            yield from map(unpack, self._batches())
            return
        if isinstance(target, PackedIterableDataset) and (target.batch_size or 1) != self._chunk:
            raise ValueError(f"the dataset's batch_size is now {target.batch_size}, this loader's is "
                             f"{self.batch_size}: give each packio.DataLoader its own dataset")
        p = self._pass = target._begin()
        own = p.split.lengths()[p.split.rank]
        for batch in self._batches():
            p.taken = min(p.taken + self._chunk, own)
            yield unpack(batch)
        target._end(p)

    def _batches(self) -> Iterator[Any]:
        """torch's iteration, or for memory-mapped arrays each batch gathered whole into a
        reusable (pinned with ``pin_memory``) buffer: the batch sampler's indices → one
        gather, no per-sample items, no collate."""
        if self._pool is None:
            return super().__iter__()
        return self._gathered_batches(self._pool)

    def _gathered_batches(self, pool: BufferPool) -> Iterator[Any]:
        items = self.dataset.items
        for indices in self.batch_sampler:
            batch = items.collated(indices, pool, self._copiers)
            if batch is None:  # a read failed: the per-sample path finds the bad sample, applies on_error
                batch = collate(self.dataset.__getitems__(indices))
            if pool.pin:
                batch = pin_memory(batch)  # labels, boxes, ...: the images are pinned already
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The global position after the batches yielded so far (JSON-safe, the same on every rank)."""
        target = self._target()
        p = self._pass
        if p is not None and p.generation == target._generation:
            return target._state(p.consumed(), p.epoch)
        return target.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        target = self._target()
        target.load_state_dict(state)
        self._pass = None
        log.info("resumed epoch %d at sample %d of %d (world size %s before, %d now)", state["epoch"],
                 state["consumed"], target.length, state.get("world_size", "?"), target.world_size)
