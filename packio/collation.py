"""Batch samples: stack images, keep variable-length boxes as lists."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import get_worker_info


def ragged(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-sample tensors as views of one concatenated tensor: a batch then crosses
    from a DataLoader worker as one shared-memory block, not one per sample (each
    costs a file descriptor and a mapping)."""
    if not parts:
        return []
    flat = torch.cat(parts)
    return list(flat.split([len(p) for p in parts]))


def collate(items: list[dict[str, Any] | None] | dict[str, Any]) -> dict[str, Any]:
    """List of sample dicts → one batch dict.

    ``image``: one ``[B, C, H, W]`` tensor when all shapes agree, else a list (and a
    list of bytes when not decoded). ``label``/``index``: tensors. ``boxes`` /
    ``box_labels``: lists of per-sample tensors. ``None`` items (skipped corrupt
    samples) are dropped.
    """
    if isinstance(items, dict):  # already a batch (a reader's whole-batch fast path)
        return items
    items = [x for x in items if x is not None]
    if not items:
        return {"image": [], "label": torch.zeros(0, dtype=torch.int64), "boxes": [], "box_labels": [],
                "key": [], "index": torch.zeros(0, dtype=torch.int64)}
    images = [x["image"] for x in items]
    if all(isinstance(im, torch.Tensor) for im in images) and len({im.shape for im in images}) == 1:
        out = None
        if get_worker_info() is not None:
            # In a DataLoader worker, stack straight into shared memory: the batch
            # then crosses to the main process without another copy.
            n = len(images) * images[0].numel()
            storage = images[0].untyped_storage()._new_shared(n * images[0].element_size())
            out = images[0].new(storage).resize_(len(images), *images[0].shape)
        images = torch.stack(images, out=out)
    return {
        "image": images,
        "label": torch.tensor([x["label"] for x in items], dtype=torch.int64),
        "boxes": ragged([x["boxes"] for x in items]),
        "box_labels": ragged([x["box_labels"] for x in items]),
        "key": [x["key"] for x in items],
        "index": torch.tensor([x["index"] for x in items], dtype=torch.int64),
    }
