"""A batch as packio hands it out, and ``collate``: one batch dict from it (or from
any list of sample dicts)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Iterator

import torch
from torch.utils.data import get_worker_info

__all__ = ["Batch", "Ragged", "ragged", "item", "stack_images", "unpack", "collate"]

Item = dict[str, Any]


class Ragged:
    """Variable-length per-sample tensors as one flat tensor + lengths: crosses from
    a DataLoader worker as one tensor. Sending a list of per-sample tensors costs a
    tensor rebuild each on the main process (128 per batch of 64 with boxes and box
    labels; it topped a profile of the main process), which it cannot spare."""

    def __init__(self, flat: torch.Tensor, lengths: list[int]) -> None:
        self.flat, self.lengths = flat, lengths

    @classmethod
    def of(cls, parts: list[torch.Tensor]) -> "Ragged":
        return cls(torch.cat(parts) if parts else torch.zeros(0), [p.shape[0] for p in parts])

    def split(self) -> list[torch.Tensor]:
        return list(self.flat.split(self.lengths)) if self.lengths else []

    def pin_memory(self, *args: Any) -> "Ragged":
        """What torch's pin-memory thread calls (``pin_memory=True``): the flat tensor pinned."""
        return Ragged(self.flat.pin_memory(*args), self.lengths)


def ragged(parts: list[torch.Tensor], packed: bool = False) -> list[torch.Tensor] | Ragged:
    """``packed``: one Ragged. Otherwise, in a DataLoader worker, views of one block
    (one shared-memory segment to send, not one per tensor); in the main process
    the tensors themselves."""
    if not packed and get_worker_info() is None:
        return list(parts)
    r = Ragged.of(parts)
    return r if packed else r.split()


def item(image: Any, label: int, boxes: torch.Tensor, box_labels: torch.Tensor, key: str, index: int) -> Item:
    """One sample's dict: the one place its fields are named (a batch's samples and
    ``ds[i]`` alike)."""
    return {"image": image, "label": label, "boxes": boxes, "box_labels": box_labels, "key": key, "index": index}


class Batch(Sequence):
    """One batch, column by column, as packio's datasets make it: ``image`` (one
    ``[B, C, H, W]`` tensor when every image has one shape, else a list), ``label`` /
    ``index`` int64[B], ``boxes`` float32[M, 4] / ``box_labels`` int64[M] sample after
    sample (``counts`` each), ``key``, and ``kept`` (False for a skipped corrupt sample).

    It is a sequence of per-sample dicts (``None`` for a skipped sample), made when
    first asked for, so torch's ``default_collate`` and any collate function work on it;
    :func:`collate` takes the columns as they are. Every tensor in it is fresh: packio
    never writes into it again.
    """

    def __init__(self, image: torch.Tensor | list[Any], label: torch.Tensor, boxes: torch.Tensor,
                 box_labels: torch.Tensor, counts: list[int], key: list[str], index: torch.Tensor,
                 kept: list[bool] | None = None) -> None:
        self.image, self.label, self.index, self.key = image, label, index, key
        self.boxes, self.box_labels, self.counts = boxes, box_labels, counts
        self.kept = kept if kept is not None and not all(kept) else None
        self._items: list[Item | None] | None = None

    def __len__(self) -> int:
        return len(self.key)

    def _all(self) -> list[Item | None]:
        """The per-sample dicts, made on first use (all at once: a few calls per batch,
        then plain list access, as a collate function reads every sample once per field)."""
        if self._items is None:
            images = self.image.unbind(0) if isinstance(self.image, torch.Tensor) else self.image
            boxes, box_labels = self.boxes.split(self.counts), self.box_labels.split(self.counts)
            rows = zip(images, self.label.tolist(), boxes, box_labels, self.key, self.index.tolist())
            self._items = [item(*row) for row in rows]
            if self.kept is not None:
                self._items = [x if ok else None for x, ok in zip(self._items, self.kept)]
        return self._items

    def __getitem__(self, j: int) -> Item | None:  # type: ignore[override]
        j = operator.index(j)  # a sample position; slices are not supported
        if not -len(self) <= j < len(self):
            raise IndexError(f"sample position {j} out of range for a batch of {len(self)}")
        return self._all()[j]

    def __iter__(self) -> Iterator[Item | None]:
        return iter(self._all())

    def collated(self, packed: bool = False) -> dict[str, Any]:
        """The batch dict (see :func:`collate`), without the skipped samples."""
        image, label, index, key, counts = self.image, self.label, self.index, self.key, self.counts
        if self.kept is not None:
            rows = [j for j, k in enumerate(self.kept) if k]
            image = image[rows] if isinstance(image, torch.Tensor) else [image[j] for j in rows]
            label, index = label[rows], index[rows]
            key, counts = [key[j] for j in rows], [counts[j] for j in rows]  # a skipped sample has no boxes
        if packed:
            boxes: Any = Ragged(self.boxes, counts)
            box_labels: Any = Ragged(self.box_labels, counts)
        else:
            boxes, box_labels = list(self.boxes.split(counts)), list(self.box_labels.split(counts))
        return {"image": image, "label": label, "boxes": boxes, "box_labels": box_labels, "key": key,
                "index": index}


def stack_images(images: list[Any]) -> torch.Tensor | list[Any]:
    """One ``[B, C, H, W]`` tensor when every image is a tensor of one shape, else the
    list as it is. CHW views of HWC pixels are stacked as HWC memory (a plain copy;
    stacking the strided views is slower, tools/loader.py levers) and handed out NCHW
    in channels_last memory."""
    if not images or not all(isinstance(im, torch.Tensor) for im in images) or len({im.shape for im in images}) != 1:
        return images
    hwc = all(im.dim() == 3 and im.permute(1, 2, 0).is_contiguous() for im in images)
    if not hwc:
        return torch.stack(images)
    return torch.stack([im.permute(1, 2, 0) for im in images]).permute(0, 3, 1, 2)


def unpack(batch: Any) -> Any:
    """Turn a worker's packed batch (Ragged fields) back into lists of tensors."""
    if isinstance(batch, dict):
        for k, v in batch.items():
            if isinstance(v, Ragged):
                batch[k] = v.split()
    return batch


def collate(items: Batch | Sequence[Item | None], packed: bool = False) -> dict[str, Any]:
    """A batch (or a list of sample dicts) → one batch dict.

    ``image``: one ``[B, C, H, W]`` tensor when all shapes agree (decoded images come
    in channels_last memory: call ``.contiguous()`` for NCHW memory), else a list
    (and a list of bytes when not decoded). ``label``/``index``: tensors. ``boxes`` /
    ``box_labels``: lists of per-sample tensors (``packed``: one ``Ragged`` each, for
    ``packio.DataLoader``, which unpacks them). Skipped corrupt samples are dropped.
    A packio :class:`Batch` is taken as it is: no stack, no copy.
    """
    if isinstance(items, Batch):
        return items.collated(packed)
    items = [x for x in items if x is not None]
    if not items:
        return {"image": [], "label": torch.zeros(0, dtype=torch.int64), "boxes": [], "box_labels": [],
                "key": [], "index": torch.zeros(0, dtype=torch.int64)}
    return {
        "image": stack_images([x["image"] for x in items]),
        "label": torch.tensor([x["label"] for x in items], dtype=torch.int64),
        "boxes": ragged([x["boxes"] for x in items], packed),
        "box_labels": ragged([x["box_labels"] for x in items], packed),
        "key": [x["key"] for x in items],
        "index": torch.tensor([x["index"] for x in items], dtype=torch.int64),
    }
