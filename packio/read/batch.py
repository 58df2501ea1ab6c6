"""The one batch type, :class:`Batch` (columns, and a sequence of sample dicts for any collate
function), its fresh memory, and ``collate``. packio never writes into a batch it handed out.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info

from packio import decode as dec

__all__ = ["Batch", "Ragged", "item", "batch_buffer", "stack_images", "merge", "unpack", "collate"]

Item = dict[str, Any]
FIELDS = ("image", "label", "boxes", "box_labels", "key", "index", "source")


def item(*values: Any) -> Item:
    """One sample's dict (``image, label, boxes, box_labels, key, index[, source]``): the one place
    its fields are named, for a batch's samples and ``ds[i]`` alike."""
    return dict(zip(FIELDS, values))


class Ragged:
    """Per-sample tensors as one flat tensor + lengths: crosses from a DataLoader worker as one
    tensor (128 small tensors a batch were rebuilt one by one in the main process: its top cost)."""

    def __init__(self, flat: torch.Tensor, lengths: list[int]) -> None:
        self.flat, self.lengths = flat, lengths

    def split(self) -> list[torch.Tensor]:
        return list(self.flat.split(self.lengths)) if self.lengths else []

    def pin_memory(self, *args: Any) -> "Ragged":  # what torch's pin-memory thread calls
        return Ragged(self.flat.pin_memory(*args), self.lengths)


class Batch(Sequence):
    """One batch, column by column: ``image`` (one ``[B, C, H, W]`` tensor when every image has one
    shape, else a list), ``label`` / ``index`` int64[B], ``boxes`` float32[M, 4] and ``box_labels``
    int64[M] sample after sample (``counts`` each), ``key``, ``kept`` (False: a skipped corrupt
    sample; None: all kept), from a mix ``source`` int64[B] and, with read-time crops, ``dropped``:
    the boxes the crops dropped (outside the window, or under ``min_visible``; None without crops). As a sequence it holds per-sample
    dicts (``None`` for a skipped one), so any collate function takes it; :func:`collate` takes
    the columns as they are."""

    def __init__(self, image: torch.Tensor | list[Any], label: torch.Tensor, boxes: torch.Tensor,
                 box_labels: torch.Tensor, counts: list[int], key: list[str], index: torch.Tensor,
                 kept: list[bool] | None = None, source: torch.Tensor | None = None, dropped: int | None = None) -> None:
        self.image, self.label, self.index, self.key, self.source = image, label, index, key, source
        self.dropped = dropped
        self.boxes, self.box_labels, self.counts = boxes, box_labels, counts
        self.kept = kept if kept is not None and not all(kept) else None
        self._items: list[Item | None] | None = None

    def __len__(self) -> int:
        return len(self.key)

    def rows(self) -> list[tuple[Any, ...]]:
        """Per sample: (image, label, boxes, box_labels, key, index, kept)."""
        images = self.image.unbind(0) if isinstance(self.image, torch.Tensor) else self.image
        return list(zip(images, self.label.tolist(), self.boxes.split(self.counts), self.box_labels.split(self.counts),
                        self.key, self.index.tolist(), self.kept or [True] * len(self)))

    def _all(self) -> list[Item | None]:
        """The per-sample dicts, made all at once on first use."""
        if self._items is None:
            items = [item(*r[:6]) if r[6] else None for r in self.rows()]
            for x, s in zip(items, self.source.tolist() if self.source is not None else []):
                if x is not None:
                    x["source"] = s
            self._items = items
        return self._items

    def __getitem__(self, j: Any) -> Any:
        return self._all()[operator.index(j)]  # a sample position; slices are not supported

    def __iter__(self) -> Iterator[Item | None]:
        return iter(self._all())

    def collated(self, packed: bool = False) -> dict[str, Any]:
        """The batch dict (see :func:`collate`), without the skipped samples."""
        out = {"image": self.image, "label": self.label, "key": self.key, "index": self.index, "source": self.source}
        counts = self.counts
        if self.kept is not None:
            rows = [j for j, k in enumerate(self.kept) if k]
            out = {k: v if v is None else [v[j] for j in rows] if isinstance(v, list) else v[rows]
                   for k, v in out.items()}
            counts = [counts[j] for j in rows]  # a skipped sample has no boxes
        for name, flat in (("boxes", self.boxes), ("box_labels", self.box_labels)):
            out[name] = Ragged(flat, counts) if packed else list(flat.split(counts))
        out["dropped"] = self.dropped
        return {k: out[k] for k in (*FIELDS, "dropped") if out[k] is not None}


def batch_buffer(shape: tuple[int, ...]) -> torch.Tensor:
    """A fresh ``uint8`` buffer for one batch, never reused. In a DataLoader worker it is made in
    shared memory, so sending the batch passes its descriptor (a private one is first copied into
    a new segment), by torch's ``default_collate`` stacking a broadcast zero (a fill, no read): the
    public route to one (``torch.empty().share_memory_()`` copies: 8.5 vs 7.8 ms a batch). The
    pixels start 16 bytes past a 32-byte boundary: JPEGs decoded into 32-aligned rows cost up to
    twice as much (``packio.decode.OUT_SLACK``)."""
    n = math.prod(shape)
    if get_worker_info() is None:
        flat = torch.empty(n + dec.OUT_SLACK, dtype=torch.uint8)
    else:
        flat = default_collate([torch.zeros((), dtype=torch.uint8).expand(n + dec.OUT_SLACK)])[0]
    at = dec.out_offset(flat.data_ptr())
    return flat[at:at + n].view(shape)


def stack_images(images: list[Any]) -> torch.Tensor | list[Any]:
    """One ``[B, C, H, W]`` tensor when every image is a tensor of one shape, else the list. CHW views
    of HWC pixels are stacked as HWC memory (a plain copy, faster) and handed out in channels_last."""
    if not images or not all(isinstance(im, torch.Tensor) for im in images) or len({im.shape for im in images}) != 1:
        return images
    if not all(im.dim() == 3 and im.permute(1, 2, 0).is_contiguous() for im in images):
        return torch.stack(images)
    return torch.stack([im.permute(1, 2, 0) for im in images]).permute(0, 3, 1, 2)


def merge(parts: list[tuple[np.ndarray, Batch]], source: np.ndarray) -> Batch:
    """One batch from parts' batches (each: the rows it fills, its batch) with a ``source`` column:
    a mix's batch, its sources' samples back in the mix's order (one fresh buffer when they stack)."""
    n = len(source)
    got: list[Any] = [None] * n
    for at, b in parts:
        for r, row in zip(at.tolist(), b.rows()):
            got[r] = row
    images: Any = [x[0] for x in got]
    if all(isinstance(im, torch.Tensor) and im.dtype == torch.uint8 and im.dim() == 3 for im in images) \
            and len({im.shape for im in images}) == 1:
        c, h, w = images[0].shape
        stacked = batch_buffer((n, h, w, c)).permute(0, 3, 1, 2)  # channels_last, as decoded
        for j, im in enumerate(images):
            stacked[j] = im
        images = stacked
    boxes, box_labels = [x[2] for x in got], [x[3] for x in got]
    dropped = [b.dropped for _, b in parts if b.dropped is not None]
    return Batch(stack_images(images) if isinstance(images, list) else images,
                 torch.tensor([x[1] for x in got], dtype=torch.int64), torch.cat(boxes), torch.cat(box_labels),
                 [len(x) for x in boxes], [x[4] for x in got], torch.tensor([x[5] for x in got], dtype=torch.int64),
                 [x[6] for x in got], torch.from_numpy(source.astype(np.int64)), sum(dropped) if dropped else None)


def unpack(batch: Any) -> Any:
    """A worker's packed batch (Ragged fields) back into lists of tensors."""
    if isinstance(batch, dict):
        for k, v in batch.items():
            if isinstance(v, Ragged):
                batch[k] = v.split()
    return batch


def collate(items: Batch | Sequence[Item | None], packed: bool = False) -> dict[str, Any]:
    """A batch (or a list of sample dicts) → one batch dict. ``image``: one ``[B, C, H, W]`` tensor
    when all shapes agree (decoded images in channels_last memory: ``.contiguous()`` gives NCHW),
    else a list (bytes when not decoded). ``label``, ``index`` (a mix's ``source``): tensors.
    ``boxes`` / ``box_labels``: lists of per-sample tensors (``packed``: one ``Ragged`` each, which
    ``packio.DataLoader`` unpacks). Skipped corrupt samples are dropped. A packio :class:`Batch` is
    taken as it is: no stack, no copy."""
    if isinstance(items, Batch):
        return items.collated(packed)
    got = [x for x in items if x is not None]
    boxes = [x["boxes"] for x in got] or [torch.zeros(0, 4)]
    box_labels = [x["box_labels"] for x in got] or [torch.zeros(0, dtype=torch.int64)]
    source = torch.tensor([x["source"] for x in got]) if got and "source" in got[0] else None
    return Batch(stack_images([x["image"] for x in got]), torch.tensor([x["label"] for x in got], dtype=torch.int64),
                 torch.cat(boxes), torch.cat(box_labels), [len(b) for b in boxes][:len(got)], [x["key"] for x in got],
                 torch.tensor([x["index"] for x in got], dtype=torch.int64), source=source).collated(packed)
