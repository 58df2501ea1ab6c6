"""The one batch type, :class:`Batch`, where its memory comes from, and ``collate``.

A batch is made once, by the decoder (or merged from its sources' batches by a mix), and
keeps one form: columns. It is also a sequence of per-sample dicts, made when first asked
for, so any collate function works on it. Every tensor in it is fresh: packio never writes
into it again.
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


def item(image: Any, label: int, boxes: torch.Tensor, box_labels: torch.Tensor, key: str, index: int,
         source: int | None = None) -> Item:
    """One sample's dict: the one place its fields are named (a batch's samples and ``ds[i]`` alike)."""
    out = {"image": image, "label": label, "boxes": boxes, "box_labels": box_labels, "key": key, "index": index}
    if source is not None:
        out["source"] = source
    return out


class Ragged:
    """Per-sample tensors as one flat tensor + lengths: crosses from a DataLoader worker as one
    tensor (a list of 128 small tensors per batch was rebuilt one by one in the main process,
    which topped its profile)."""

    def __init__(self, flat: torch.Tensor, lengths: list[int]) -> None:
        self.flat, self.lengths = flat, lengths

    def split(self) -> list[torch.Tensor]:
        return list(self.flat.split(self.lengths)) if self.lengths else []

    def pin_memory(self, *args: Any) -> "Ragged":
        """What torch's pin-memory thread calls (``pin_memory=True``): the flat tensor pinned."""
        return Ragged(self.flat.pin_memory(*args), self.lengths)


class Batch(Sequence):
    """One batch, column by column: ``image`` (one ``[B, C, H, W]`` tensor when every image has
    one shape, else a list), ``label`` / ``index`` int64[B], ``boxes`` float32[M, 4] and
    ``box_labels`` int64[M] sample after sample (``counts`` each), ``key``, ``kept`` (False
    for a skipped corrupt sample; None when all are kept) and, from a mix, ``source`` int64[B].

    As a sequence it holds per-sample dicts (``None`` for a skipped sample), so torch's
    ``default_collate`` and any collate function take it; :func:`collate` takes the columns."""

    def __init__(self, image: torch.Tensor | list[Any], label: torch.Tensor, boxes: torch.Tensor,
                 box_labels: torch.Tensor, counts: list[int], key: list[str], index: torch.Tensor,
                 kept: list[bool] | None = None, source: torch.Tensor | None = None) -> None:
        self.image, self.label, self.index, self.key, self.source = image, label, index, key, source
        self.boxes, self.box_labels, self.counts = boxes, box_labels, counts
        self.kept = kept if kept is not None and not all(kept) else None
        self._items: list[Item | None] | None = None

    def __len__(self) -> int:
        return len(self.key)

    def _all(self) -> list[Item | None]:
        """The per-sample dicts, made all at once on first use (a collate function reads every
        sample once per field)."""
        if self._items is None:
            images = self.image.unbind(0) if isinstance(self.image, torch.Tensor) else self.image
            sources = self.source.tolist() if self.source is not None else [None] * len(self)
            rows = zip(images, self.label.tolist(), self.boxes.split(self.counts), self.box_labels.split(self.counts),
                       self.key, self.index.tolist(), sources)
            kept = self.kept or [True] * len(self)
            self._items = [item(*row) if ok else None for row, ok in zip(rows, kept)]
        return self._items

    def __getitem__(self, j: Any) -> Any:
        j = operator.index(j)  # a sample position; slices are not supported
        if not -len(self) <= j < len(self):
            raise IndexError(f"sample position {j} out of range for a batch of {len(self)}")
        return self._all()[j]

    def __iter__(self) -> Iterator[Item | None]:
        return iter(self._all())

    def collated(self, packed: bool = False) -> dict[str, Any]:
        """The batch dict (see :func:`collate`), without the skipped samples."""
        image, label, index, key, counts, source = self.image, self.label, self.index, self.key, self.counts, self.source
        if self.kept is not None:
            rows = [j for j, k in enumerate(self.kept) if k]
            image = image[rows] if isinstance(image, torch.Tensor) else [image[j] for j in rows]
            label, index = label[rows], index[rows]
            source = source[rows] if source is not None else None
            key, counts = [key[j] for j in rows], [counts[j] for j in rows]  # a skipped sample has no boxes
        if packed:
            boxes: Any = Ragged(self.boxes, counts)
            box_labels: Any = Ragged(self.box_labels, counts)
        else:
            boxes, box_labels = list(self.boxes.split(counts)), list(self.box_labels.split(counts))
        out = {"image": image, "label": label, "boxes": boxes, "box_labels": box_labels, "key": key, "index": index}
        return out if source is None else {**out, "source": source}


def batch_buffer(shape: tuple[int, ...]) -> torch.Tensor:
    """A fresh ``uint8`` buffer for one batch, never reused. In a DataLoader worker it is made in
    shared memory, so sending the batch passes its descriptor (a private buffer is copied into a
    new segment first: one more copy and its page faults). Made by torch's ``default_collate``,
    which in a worker stacks into a new shared segment (here a broadcast zero: a fill, no read),
    the public route to one (``torch.empty().share_memory_()`` copies: 8.5 vs 7.8 ms a batch).

    The pixels start 16 bytes past a 32-byte boundary: JPEGs decoded into 32-aligned rows cost
    up to twice as much (see ``packio.decode.OUT_SLACK``)."""
    n = math.prod(shape)
    if get_worker_info() is None:
        flat = torch.empty(n + dec.OUT_SLACK, dtype=torch.uint8)
    else:
        flat = default_collate([torch.zeros((), dtype=torch.uint8).expand(n + dec.OUT_SLACK)])[0]
    at = dec.out_offset(flat.data_ptr())
    return flat[at:at + n].view(shape)


def stack_images(images: list[Any]) -> torch.Tensor | list[Any]:
    """One ``[B, C, H, W]`` tensor when every image is a tensor of one shape, else the list.
    CHW views of HWC pixels are stacked as HWC memory (a plain copy; stacking the strided
    views is slower) and handed out NCHW in channels_last memory."""
    if not images or not all(isinstance(im, torch.Tensor) for im in images) or len({im.shape for im in images}) != 1:
        return images
    if not all(im.dim() == 3 and im.permute(1, 2, 0).is_contiguous() for im in images):
        return torch.stack(images)
    return torch.stack([im.permute(1, 2, 0) for im in images]).permute(0, 3, 1, 2)


def _merged_images(parts: list[tuple[np.ndarray, Batch]], n: int) -> torch.Tensor | list[Any]:
    """One ``[n, C, H, W]`` tensor when every part's images are tensors of one shape, else a list."""
    firsts = [b.image for _, b in parts]
    if all(isinstance(im, torch.Tensor) for im in firsts) and len({tuple(im.shape[1:]) for im in firsts}) == 1:
        shape, dtype = firsts[0].shape[1:], firsts[0].dtype
        out = (batch_buffer((n, *shape[1:], shape[0])).permute(0, 3, 1, 2)  # channels_last, as decoded
               if dtype == torch.uint8 and len(shape) == 3 else torch.empty((n, *shape), dtype=dtype))
        for rows, b in parts:
            out[torch.from_numpy(rows)] = b.image
        return out
    images: list[Any] = [None] * n
    for rows, b in parts:
        for r, im in zip(rows.tolist(), b.image.unbind(0) if isinstance(b.image, torch.Tensor) else b.image):
            images[r] = im
    return images


def merge(parts: list[tuple[np.ndarray, Batch]], source: np.ndarray) -> Batch:
    """One batch from its parts' batches (each part: the rows it fills, its batch), with a
    ``source`` column: a mix's batch, its sources' samples back in the mix's order."""
    n = len(source)
    label, index = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    keys, kept, boxes, box_labels = [""] * n, [True] * n, [torch.zeros((0, 4))] * n, [torch.zeros(0, dtype=torch.int64)] * n
    for rows, b in parts:
        at = torch.from_numpy(rows)
        label[at], index[at] = b.label, b.index
        for r, k, ok, bx, bl in zip(rows.tolist(), b.key, b.kept or [True] * len(b), b.boxes.split(b.counts),
                                    b.box_labels.split(b.counts)):
            keys[r], kept[r], boxes[r], box_labels[r] = k, ok, bx, bl
    return Batch(_merged_images(parts, n), label, torch.cat(boxes), torch.cat(box_labels), [len(x) for x in boxes],
                 keys, index, kept, source=torch.from_numpy(source.astype(np.int64)))


def unpack(batch: Any) -> Any:
    """A worker's packed batch (Ragged fields) back into lists of tensors."""
    if isinstance(batch, dict):
        for k, v in batch.items():
            if isinstance(v, Ragged):
                batch[k] = v.split()
    return batch


def collate(items: Batch | Sequence[Item | None], packed: bool = False) -> dict[str, Any]:
    """A batch (or a list of sample dicts) → one batch dict.

    ``image``: one ``[B, C, H, W]`` tensor when all shapes agree (decoded images in
    channels_last memory: ``.contiguous()`` gives NCHW memory), else a list (bytes when not
    decoded). ``label``, ``index`` (and a mix's ``source``): tensors. ``boxes`` /
    ``box_labels``: lists of per-sample tensors (``packed``: one ``Ragged`` each, for
    ``packio.DataLoader``, which unpacks them). Skipped corrupt samples are dropped. A packio
    :class:`Batch` is taken as it is: no stack, no copy."""
    if isinstance(items, Batch):
        return items.collated(packed)
    got = [x for x in items if x is not None]
    if packed or get_worker_info() is not None:  # in a worker: one block to send, not a segment per tensor
        boxes: Any = Ragged(torch.cat([x["boxes"] for x in got]) if got else torch.zeros(0, 4),
                            [len(x["boxes"]) for x in got])
        box_labels: Any = Ragged(torch.cat([x["box_labels"] for x in got]) if got else torch.zeros(0, dtype=torch.int64),
                                 boxes.lengths)
        boxes, box_labels = (boxes, box_labels) if packed else (boxes.split(), box_labels.split())
    else:
        boxes, box_labels = [x["boxes"] for x in got], [x["box_labels"] for x in got]
    out = {"image": stack_images([x["image"] for x in got]),
           "label": torch.tensor([x["label"] for x in got], dtype=torch.int64), "boxes": boxes,
           "box_labels": box_labels, "key": [x["key"] for x in got],
           "index": torch.tensor([x["index"] for x in got], dtype=torch.int64)}
    if got and "source" in got[0]:
        out["source"] = torch.tensor([x["source"] for x in got], dtype=torch.int64)
    return out
