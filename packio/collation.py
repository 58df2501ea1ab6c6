"""Batch samples: stack images, keep variable-length boxes as lists."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import get_worker_info

__all__ = ["Ragged", "ragged", "unpack", "collate"]


class Ragged:
    """Variable-length per-sample tensors as one flat tensor + lengths: crosses from
    a DataLoader worker as one tensor. Sending a list of per-sample tensors costs a
    tensor rebuild each on the main process (128 per batch of 64 with boxes and box
    labels; it topped a profile of the main process), which it cannot spare."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.flat = torch.cat(parts) if parts else torch.zeros(0)
        self.lengths = [len(p) for p in parts]

    def split(self) -> list[torch.Tensor]:
        return list(self.flat.split(self.lengths)) if self.lengths else []


def ragged(parts: list[torch.Tensor], packed: bool = False) -> list[torch.Tensor] | Ragged:
    """Per-sample tensors as views of one block (``packed``: the Ragged itself)."""
    r = Ragged(parts)
    return r if packed else r.split()


def unpack(batch: Any) -> Any:
    """Turn a worker's packed batch (Ragged fields) back into lists of tensors."""
    if isinstance(batch, dict):
        for k, v in batch.items():
            if isinstance(v, Ragged):
                batch[k] = v.split()
    return batch


def collate(items: list[dict[str, Any] | None] | dict[str, Any], packed: bool = False) -> dict[str, Any]:
    """List of sample dicts → one batch dict.

    ``image``: one ``[B, C, H, W]`` tensor when all shapes agree (decoded images come
    in channels_last memory: call ``.contiguous()`` for NCHW memory), else a list
    (and a list of bytes when not decoded). ``label``/``index``: tensors. ``boxes`` /
    ``box_labels``: lists of per-sample tensors (``packed``: one ``Ragged`` each, for
    ``packio.DataLoader``, which unpacks them). ``None`` items (skipped corrupt
    samples) are dropped.
    """
    if not isinstance(items, list):  # already a batch (a reader's whole-batch fast path), or deferred
        return items
    items = [x for x in items if x is not None]
    if not items:
        return {"image": [], "label": torch.zeros(0, dtype=torch.int64), "boxes": [], "box_labels": [],
                "key": [], "index": torch.zeros(0, dtype=torch.int64)}
    images = [x["image"] for x in items]
    if all(isinstance(im, torch.Tensor) for im in images) and len({im.shape for im in images}) == 1:
        # Decoded images are CHW views of HWC pixels: stack the HWC memory (a plain
        # copy; stacking the strided views is slower, see tools/bench_levers.py) and
        # return NCHW in channels_last memory.
        hwc = all(im.dim() == 3 and im.permute(1, 2, 0).is_contiguous() for im in images)
        parts = [im.permute(1, 2, 0) for im in images] if hwc else images
        out = None
        if get_worker_info() is not None:
            # In a DataLoader worker, stack straight into shared memory: the batch
            # then crosses to the main process without another copy.
            n = len(parts) * parts[0].numel()
            storage = torch.UntypedStorage._new_shared(n * parts[0].element_size())
            out = parts[0].new_empty(0).set_(storage).view(len(parts), *parts[0].shape)
        images = torch.stack(parts, out=out)
        if hwc:
            images = images.permute(0, 3, 1, 2)
    return {
        "image": images,
        "label": torch.tensor([x["label"] for x in items], dtype=torch.int64),
        "boxes": ragged([x["boxes"] for x in items], packed),
        "box_labels": ragged([x["box_labels"] for x in items], packed),
        "key": [x["key"] for x in items],
        "index": torch.tensor([x["index"] for x in items], dtype=torch.int64),
    }
