"""Batch samples: stack images, keep variable-length boxes as lists."""

from __future__ import annotations

from typing import Any

import torch


def collate(items: list[dict[str, Any] | None]) -> dict[str, Any]:
    """List of sample dicts → one batch dict.

    ``image``: one ``[B, C, H, W]`` tensor when all shapes agree, else a list (and a
    list of bytes when not decoded). ``label``/``index``: tensors. ``boxes`` /
    ``box_labels``: lists of per-sample tensors. ``None`` items (skipped corrupt
    samples) are dropped.
    """
    items = [x for x in items if x is not None]
    if not items:
        return {"image": [], "label": torch.zeros(0, dtype=torch.int64), "boxes": [], "box_labels": [],
                "key": [], "index": torch.zeros(0, dtype=torch.int64)}
    images = [x["image"] for x in items]
    if all(isinstance(im, torch.Tensor) for im in images) and len({im.shape for im in images}) == 1:
        images = torch.stack(images)
    return {
        "image": images,
        "label": torch.tensor([x["label"] for x in items], dtype=torch.int64),
        "boxes": [x["boxes"] for x in items],
        "box_labels": [x["box_labels"] for x in items],
        "key": [x["key"] for x in items],
        "index": torch.tensor([x["index"] for x in items], dtype=torch.int64),
    }
