"""``packio.DataLoader``: torch's DataLoader plus ``packio.collate``, whole batches from packio's
iterable datasets, ``set_epoch`` / ``epoch`` and an elastic resume state; the rest is torch's own.
It uses only the public resume protocol of what it loads (``position``, ``state_at``, ...).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Iterator

import torch

from packio.errors import StateError
from packio.options import check_int
from packio.read.batch import collate, unpack
from packio.read.datasets import PackedDataset, PackedIterableDataset
from packio.read.positions import Cursor, ResumableSampler

__all__ = ["DataLoader"]

log = logging.getLogger("packio")


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` with ``packio.collate`` and an elastic resume state.

    Resumable over a packio iterable dataset (a mix too), or a map-style one with
    ``sampler=packio.ResumableSampler(...)``: :meth:`state_dict` counts the batches yielded (each
    ``batch_size`` positions of the rank's sequence, skipped samples included); it resumes with any
    ``num_workers`` and world size (with ``in_order=False`` and workers it refuses: no position).
    ``batch_size=None`` yields sample dicts, as torch's loader does; else each worker of a packio
    iterable dataset makes whole batches (``len()`` and ``drop_last`` are this loader's)."""

    def __init__(self, dataset: Any, batch_size: int | None = 1, **kwargs: Any) -> None:
        if batch_size is not None:
            batch_size = check_int("batch_size", batch_size, 1)
            workers = kwargs.get("num_workers", 0) > 0
            kwargs.setdefault("collate_fn", functools.partial(collate, packed=True) if workers else collate)
        self._unordered = kwargs.get("in_order", True) is False and kwargs.get("num_workers", 0) > 0
        self._drop_last = bool(kwargs.get("drop_last", False))
        self._chunk = batch_size or 1
        torch_batch = batch_size
        if isinstance(dataset, PackedIterableDataset):
            dataset.batch_size = batch_size  # each worker then makes whole batches, in the rank's order
            dataset.whole_batches, dataset.drop_last = batch_size is not None, self._drop_last
            if batch_size is not None:
                torch_batch = None  # the dataset yields the batches: torch collates each one alone
                kwargs.pop("drop_last", None)
        super().__init__(dataset, batch_size=torch_batch, **kwargs)
        self._cursor: Cursor | None = None

    def __len__(self) -> int:
        ds = self.dataset
        if isinstance(ds, PackedIterableDataset) and ds.whole_batches:
            n = len(ds)
            return n // self._chunk if self._drop_last else math.ceil(n / self._chunk)
        return super().__len__()

    @property
    def resumable(self) -> PackedIterableDataset | ResumableSampler | None:  # what holds the position
        if isinstance(self.dataset, PackedIterableDataset):
            return self.dataset
        return self.sampler if isinstance(self.sampler, ResumableSampler) else None

    def _target(self) -> PackedIterableDataset | ResumableSampler:
        target = self.resumable
        if target is None:
            raise StateError("this loader cannot resume: give it a packio iterable dataset, or a map-style one "
                             "with sampler=packio.ResumableSampler(len(dataset), ...)")
        return target

    @property
    def epoch(self) -> int:
        return self._target().epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (the current one: a no-op); a map-style packio dataset is told it too."""
        target: Any = self.resumable
        if target is None and hasattr(self.sampler, "set_epoch"):
            target = self.sampler  # e.g. torch's DistributedSampler
        if isinstance(self.dataset, PackedDataset):
            self.dataset.set_epoch(epoch)
        elif target is None:
            raise StateError("set_epoch needs a packio dataset or a sampler with set_epoch")
        if target is not None:
            target.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        target = self.resumable
        if target is None:
            yield from map(unpack, super().__iter__())
            return
        if isinstance(target, PackedIterableDataset) and (target.batch_size or 1) != self._chunk:
            raise ValueError(f"the dataset's batch_size is now {target.batch_size}, this loader's is "
                             f"{self._chunk}: give each packio.DataLoader its own dataset")
        cur = self._cursor = target.position.begin(self._chunk)
        for batch in super().__iter__():
            cur.advance(self._chunk)
            yield unpack(batch)
        target.position.end(cur)

    def state_dict(self) -> dict[str, Any]:
        """The global position after the batches yielded so far (JSON-safe, the same on every rank)."""
        if self._unordered:
            raise StateError("this loader runs with in_order=False: its workers' batches arrive out of order, so "
                             "the batches yielded are not a position to resume from; use in_order=True (the "
                             "default) for a loader whose state you save")
        target = self._target()
        cur = self._cursor
        if cur is not None and target.position.live(cur):
            return target.state_at(cur.epoch, cur.consumed())
        return target.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        target = self._target()
        target.load_state_dict(state)
        if isinstance(self.dataset, PackedDataset):  # its decoder's epoch (read-time crops) is the state's
            self.dataset.set_epoch(target.epoch)
        self._cursor = None
        log.info("resumed epoch %d at sample %d of %d (world size %s before, %d now)", state["epoch"],
                 state["consumed"], target.position.length, state.get("world_size", "?"), target.position.world)
