"""Boxes of a whole batch as one packed tensor, and the torch twin of ``packio.geometry``.

``PackedBoxes`` holds every box of a batch in one ``float32[M, 4]`` (xyxy, continuous
pixel coordinates), with ``labels`` ``int64[M]``, ``image`` ``int64[M]`` (which image
of the batch each box belongs to) and ``keep`` ``bool[M]``. It crosses to the GPU in
one copy, and every geometry step is a handful of elementwise kernels over all boxes
with per-image parameters gathered by ``image``: no per-image work, no host sync.

Dropping boxes changes M, which the host must learn (a sync), so crops only clear
``keep`` (deferred compaction): rows stay in step with their labels until
:meth:`PackedBoxes.compact` drops them all at once, one sync per batch, when the
consumer needs ragged per-image boxes (a loss can also use ``keep`` as a mask).

The rules are ``packio.geometry``'s exactly (tests compare on random boxes):
scale/flip never drop; crop keeps a box iff it overlaps the window's interior (and, with
``min_visible``, keeps at least that share of its area inside), then shifts and clips it.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from packio.cuda.device import h2d

__all__ = ["PackedBoxes", "crop", "hflip", "pack_batch", "resize", "scale"]


class PackedBoxes(NamedTuple):
    boxes: torch.Tensor  # float32[M, 4]
    labels: torch.Tensor  # int64[M]
    image: torch.Tensor  # int64[M]
    keep: torch.Tensor  # bool[M]
    num_images: int

    @classmethod
    def from_lists(cls, boxes: Sequence[torch.Tensor], labels: Sequence[torch.Tensor] | None = None,
                   ) -> PackedBoxes:
        """Per-image tensors (``[N_i, 4]``, ``[N_i]``) → one packed set, where they are
        (the Prefetcher packs on the host, then copies it once)."""
        n = len(boxes)
        lengths = [len(b) for b in boxes]
        dev = boxes[0].device if n else torch.device("cpu")
        flat = torch.cat([b.reshape(-1, 4).to(torch.float32) for b in boxes]) if n else torch.zeros(0, 4)
        if labels is None:
            lab = torch.full((len(flat),), -1, dtype=torch.int64, device=dev)
        else:
            if [len(x) for x in labels] != lengths:
                raise ValueError("boxes and box_labels differ in length for some image of the batch")
            lab = torch.cat([x.reshape(-1).to(torch.int64) for x in labels]) if n else torch.zeros(0, dtype=torch.int64)
        # The image index is built on the host from host-known lengths, then copied without a sync.
        image = h2d(torch.repeat_interleave(torch.arange(n), torch.tensor(lengths, dtype=torch.int64)), dev)
        return cls(flat, lab, image, torch.ones(len(flat), dtype=torch.bool, device=dev), n)

    def to(self, device: torch.device) -> PackedBoxes:
        """On ``device`` (pinned, non-blocking copies; the Prefetcher moves it in its one batched copy)."""
        return PackedBoxes(*(h2d(t, device) for t in self[:4]), self.num_images)

    def compact(self) -> PackedBoxes:
        """Only the kept rows (one host sync)."""
        k = self.keep
        return PackedBoxes(self.boxes[k], self.labels[k], self.image[k], self.keep[k], self.num_images)

    def per_image(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Kept boxes and labels as per-image lists (compacts: one host sync)."""
        c = self.compact()
        lengths = torch.bincount(c.image, minlength=self.num_images).tolist()
        return list(c.boxes.split(lengths)), list(c.labels.split(lengths))


def pack_batch(batch: dict) -> dict:
    """A packio batch with ``boxes`` (and ``box_labels``) as per-image lists → the same
    batch with ``boxes`` a :class:`PackedBoxes` carrying the labels (``box_labels`` is
    dropped: the labels live in the packed set, always in step). Other batches pass."""
    boxes = batch.get("boxes")
    if not isinstance(boxes, (list, tuple)) or not all(isinstance(b, torch.Tensor) for b in boxes):
        return batch
    out = {k: v for k, v in batch.items() if k != "box_labels"}
    out["boxes"] = PackedBoxes.from_lists(boxes, batch.get("box_labels"))
    return out


def _per_box(v: torch.Tensor | float, p: PackedBoxes) -> torch.Tensor:
    """A per-image parameter ``[B]`` gathered to ``[M]`` (a scalar broadcasts)."""
    if isinstance(v, torch.Tensor) and v.dim() == 1:
        return v[p.image]
    return torch.full((1,), float(v), dtype=torch.float32, device=p.boxes.device)


def scale(p: PackedBoxes, sx: torch.Tensor | float, sy: torch.Tensor | float) -> PackedBoxes:
    """x *= sx, y *= sy (per image ``[B]`` or scalars), the factors rounded to float32
    first, as geometry.scale does."""
    fx, fy = (_per_box(v, p).to(torch.float32).reshape(-1, 1) for v in (sx, sy))
    return p._replace(boxes=p.boxes * torch.cat(torch.broadcast_tensors(fx, fy, fx, fy), 1))


def resize(p: PackedBoxes, src_hw: torch.Tensor, dst_hw: tuple[int, int]) -> PackedBoxes:
    """Per image from ``src_hw`` (``[B, 2]`` h, w) to ``dst_hw``: ``x * w1 / w0`` in float64, as geometry does
    (an edge at ``w0`` lands exactly on ``w1``)."""
    # (w, h, w, h) per box by flip + repeat: a list index or a tensor built on the device
    # would be a pageable host-to-device copy, i.e. a host sync.
    src = src_hw.to(torch.float64)[p.image].flip(-1).repeat(1, 2)
    dst = h2d(torch.tensor([dst_hw[1], dst_hw[0], dst_hw[1], dst_hw[0]], dtype=torch.float64), p.boxes.device)
    return p._replace(boxes=(p.boxes.to(torch.float64) * dst / src).to(torch.float32))


def hflip(p: PackedBoxes, width: torch.Tensor | float, flip: torch.Tensor | None = None) -> PackedBoxes:
    """Mirror left-right the boxes of the images where ``flip`` (``bool[B]``; all when None)."""
    w = _per_box(width, p).to(torch.float32)
    flipped = torch.stack([w - p.boxes[:, 2], p.boxes[:, 1], w - p.boxes[:, 0], p.boxes[:, 3]], -1)
    if flip is None:
        return p._replace(boxes=flipped)
    return p._replace(boxes=torch.where(_per_box(flip, p).view(-1, 1), flipped, p.boxes))


def crop(p: PackedBoxes, window: torch.Tensor, min_visible: float = 0.0) -> PackedBoxes:
    """Per image window ``[B, 4]`` (top, left, height, width; whole pixels): clear
    ``keep`` for the boxes not overlapping the window's interior, or with less than
    ``min_visible`` of their area inside it (a zero-area box counts as wholly inside),
    shift the rest into the window's frame and clip them to it. Dropped rows keep
    clipped coordinates."""
    top, left, h, w = (window[:, k].to(torch.float32)[p.image] for k in range(4))
    b = p.boxes
    inside = (b[:, 0] < left + w) & (b[:, 2] > left) & (b[:, 1] < top + h) & (b[:, 3] > top)
    shifted = b - torch.stack([left, top, left, top], -1)
    lim = torch.stack([w, h, w, h], -1)
    clipped = torch.minimum(shifted.clamp(min=0), lim)
    if min_visible > 0:
        area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
        seen = (clipped[:, 2] - clipped[:, 0]) * (clipped[:, 3] - clipped[:, 1])
        inside = inside & ((area <= 0) | (seen >= min_visible * area))
    return p._replace(boxes=clipped, keep=p.keep & inside)
