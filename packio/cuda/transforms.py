"""Batch transforms that run where the batch is (GPU or CPU), on ``uint8`` input.

Geometry first on ``uint8``/float, then one fused-ish normalisation: convert,
subtract, scale, optional ``channels_last``. Boxes (lists of ``[N, 4]`` xyxy
tensors) follow the geometry when given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "Boxes", "resize", "center_crop", "random_resized_crop", "hflip",
           "normalize", "GPUTransform"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
Boxes = list[torch.Tensor] | None


def _as_list(images: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return list(images.unbind(0)) if isinstance(images, torch.Tensor) else list(images)


def resize(images: torch.Tensor | Sequence[torch.Tensor], size: tuple[int, int], boxes: Boxes = None,
           antialias: bool = True) -> tuple[torch.Tensor, Boxes]:
    """Resize each ``[C, H, W]`` image (any sizes) to ``size`` → ``[B, C, h, w]`` float32 (0-255 range)."""
    h, w = size
    out, new_boxes = [], [] if boxes is not None else None
    for k, img in enumerate(_as_list(images)):
        x = img.unsqueeze(0).float()
        if tuple(x.shape[-2:]) != (h, w):
            x = F.interpolate(x, size=(h, w), mode="bilinear", antialias=antialias, align_corners=False)
        out.append(x)
        if new_boxes is not None:
            sy, sx = h / img.shape[-2], w / img.shape[-1]
            new_boxes.append(boxes[k].to(x.device).float() * x.new_tensor([sx, sy, sx, sy]))
    return torch.cat(out), new_boxes


def _crop_boxes(b: torch.Tensor, top: int, left: int, ch: int, cw: int) -> torch.Tensor:
    b = b.float() - b.new_tensor([left, top, left, top], dtype=torch.float32)
    return torch.stack([b[:, 0].clamp(0, cw), b[:, 1].clamp(0, ch), b[:, 2].clamp(0, cw), b[:, 3].clamp(0, ch)], 1)


def center_crop(images: torch.Tensor, size: tuple[int, int], boxes: Boxes = None) -> tuple[torch.Tensor, Boxes]:
    """Center crop a ``[B, C, H, W]`` batch (a view, no copy)."""
    ch, cw = size
    H, W = images.shape[-2:]
    if ch > H or cw > W:
        raise ValueError(f"crop {size} is larger than the images ({H}, {W})")
    top, left = (H - ch) // 2, (W - cw) // 2
    out = images[..., top:top + ch, left:left + cw]
    return out, None if boxes is None else [_crop_boxes(b.to(out.device), top, left, ch, cw) for b in boxes]


def random_resized_crop(images: torch.Tensor | Sequence[torch.Tensor], size: tuple[int, int], boxes: Boxes = None,
                        scale: tuple[float, float] = (0.08, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3),
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, Boxes]:
    """Inception-style crop (torchvision's sampling rule) per image, then resize to ``size``."""
    imgs = _as_list(images)
    crops, crop_boxes = [], [] if boxes is not None else None
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    for k, img in enumerate(imgs):
        H, W = img.shape[-2:]
        top, left, ch, cw = 0, 0, H, W
        for _ in range(10):
            area = H * W * float(torch.empty(1).uniform_(*scale, generator=generator))
            r = math.exp(float(torch.empty(1).uniform_(*log_r, generator=generator)))
            w, h = int(round(math.sqrt(area * r))), int(round(math.sqrt(area / r)))
            if 0 < w <= W and 0 < h <= H:
                top = int(torch.randint(0, H - h + 1, (1,), generator=generator))
                left = int(torch.randint(0, W - w + 1, (1,), generator=generator))
                ch, cw = h, w
                break
        crops.append(img[..., top:top + ch, left:left + cw])
        if crop_boxes is not None:
            crop_boxes.append(_crop_boxes(boxes[k].to(img.device), top, left, ch, cw))
    return resize(crops, size, crop_boxes)


def hflip(images: torch.Tensor, boxes: Boxes = None, p: float = 0.5,
          generator: torch.Generator | None = None) -> tuple[torch.Tensor, Boxes, torch.Tensor]:
    """Flip each image left-right with probability ``p``; returns (images, boxes, flipped mask)."""
    flip = torch.rand(images.shape[0], generator=generator) < p
    mask = flip.to(images.device).view(-1, *([1] * (images.dim() - 1)))
    out = torch.where(mask, images.flip(-1), images)
    if boxes is None:
        return out, None, flip
    W = images.shape[-1]
    new = []
    for b, f in zip(boxes, flip.tolist()):
        b = b.float()
        new.append(torch.stack([W - b[:, 2], b[:, 1], W - b[:, 0], b[:, 3]], 1) if f else b)
    return out, new, flip


def normalize(images: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
              dtype: torch.dtype = torch.float32, channels_last: bool = False) -> torch.Tensor:
    """``uint8``/0-255 ``[B, C, H, W]`` → ``(x/255 - mean) / std`` in ``dtype``: one multiply-add
    over a single converted copy (scale and shift folded together)."""
    c = images.shape[1]
    scale = torch.tensor([1.0 / (255.0 * s) for s in std], device=images.device).view(1, c, 1, 1)
    shift = torch.tensor([-m / s for m, s in zip(mean, std)], device=images.device).view(1, c, 1, 1)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = images.to(dtype=torch.float32, memory_format=fmt)
    x = torch.addcmul(shift, x, scale)  # x * scale + shift in one kernel
    return x.to(dtype=dtype, memory_format=fmt)


@dataclass
class GPUTransform:
    """The usual training/eval pipeline as one callable over a packio batch dict,
    meant to run on the device right after the prefetcher's copy."""

    size: tuple[int, int] = (224, 224)
    train: bool = True
    dtype: torch.dtype = torch.float32
    channels_last: bool = False
    mean: Sequence[float] = IMAGENET_MEAN
    std: Sequence[float] = IMAGENET_STD
    crop_scale: tuple[float, float] = (0.08, 1.0)

    def __call__(self, batch: dict) -> dict:
        images, boxes = batch["image"], batch.get("boxes")
        if self.train:
            x, boxes = random_resized_crop(images, self.size, boxes, scale=self.crop_scale)
            x, boxes, _ = hflip(x, boxes)
        else:
            x, boxes = resize(images, self.size, boxes)
        out = dict(batch)
        out["image"] = normalize(x, self.mean, self.std, self.dtype, self.channels_last)
        if boxes is not None:
            out["boxes"] = boxes
        return out
