"""Batch transforms as a few batched kernels, with no host sync, where the batch is.

Crop + resize + flip of a whole batch is two batched matrix products: each image's
output is ``Ry @ image @ Rx^T``, with ``Ry [h, H]`` and ``Rx [w, W]`` the per-image
resampling matrices (antialiased bilinear, the filter of
``F.interpolate(antialias=True)``), built on the device from per-image windows that
are drawn on the device too. Weights outside an image's window are zero, so images
of different sizes share one zero-padded canvas; a horizontal flip is ``Rx`` with
its rows reversed. Then one fused multiply-add normalises into the output dtype and
memory format. Boxes follow as a :class:`~packio.cuda.boxes.PackedBoxes`.

Nothing in the per-batch path reads a device value on the host (no ``.item()``,
``.tolist()``, boolean indexing, ``nonzero``); host values are only shapes and
parameters, which reach the device as pinned ``non_blocking`` copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from packio.cuda import boxes as bx
from packio.cuda.device import h2d, resolve

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "GPUTransform", "center_crops", "center_window", "image_sizes", "normalize", "rand", "resample_matrix", "resized_crop", "sample_crops"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
Images = torch.Tensor | Sequence[torch.Tensor]


def _device(images: Images) -> torch.device:
    return images.device if isinstance(images, torch.Tensor) else images[0].device


def image_sizes(images: Images) -> torch.Tensor:
    """``float32[B, 2]`` (height, width) of each image, on the images' device (from
    host-known shapes: one small non-blocking copy, no sync)."""
    dev = _device(images)
    if isinstance(images, torch.Tensor):
        host = torch.tensor([[images.shape[-2], images.shape[-1]]], dtype=torch.float32)
        return h2d(host, dev).expand(images.shape[0], 2)
    return h2d(torch.tensor([[im.shape[-2], im.shape[-1]] for im in images], dtype=torch.float32), dev)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.type == "cpu" or (a.index or 0) == (b.index or 0))


def rand(shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniform [0, 1) draws on ``device``: with ``generator`` on its device (a CUDA
    generator draws on the GPU; a CPU one on the host, then copied without a sync)."""
    if generator is None or _same_device(generator.device, device):
        return torch.rand(shape, generator=generator, device=device)
    return h2d(torch.rand(shape, generator=generator, device=generator.device), device)


def sample_crops(hw: torch.Tensor, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), generator: torch.Generator | None = None,
                 attempts: int = 10) -> torch.Tensor:
    """Inception-style random windows (torchvision's ``RandomResizedCrop`` rule), all
    images at once on ``hw``'s device: ``float32[B, 4]`` (top, left, height, width),
    whole pixels. Each image takes its first of ``attempts`` draws that fits, else the
    central crop clamped to ``ratio``, as torchvision does."""
    dev, n = hw.device, hw.shape[0]
    H, W = hw[:, :1].to(torch.float32), hw[:, 1:].to(torch.float32)
    u = rand((n, attempts, 4), dev, generator)
    area = H * W * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    lr0, lr1 = math.log(ratio[0]), math.log(ratio[1])
    r = torch.exp(lr0 + (lr1 - lr0) * u[..., 1])
    w, h = torch.sqrt(area * r).round(), torch.sqrt(area / r).round()
    ok = (w > 0) & (w <= W) & (h > 0) & (h <= H)
    first = ok.to(torch.uint8).argmax(1, keepdim=True)  # the first fitting attempt (0 when none fits)
    w, h = w.gather(1, first), h.gather(1, first)
    top = torch.floor(u[..., 2].gather(1, first) * (H - h + 1)).clamp(max=H - h)
    left = torch.floor(u[..., 3].gather(1, first) * (W - w + 1)).clamp(max=W - w)
    # Fallback: the whole image, clamped to the ratio range, centered.
    in_ratio = W / H
    fw = torch.where(in_ratio > ratio[1], (H * ratio[1]).round(), W)
    fh = torch.where(in_ratio < ratio[0], (W / ratio[0]).round(), H)
    ftop, fleft = torch.floor((H - fh) / 2), torch.floor((W - fw) / 2)
    fits = ok.any(1, keepdim=True)
    return torch.cat([torch.where(fits, top, ftop), torch.where(fits, left, fleft),
                      torch.where(fits, h, fh), torch.where(fits, w, fw)], 1)


def center_crops(hw: torch.Tensor, size: tuple[int, int], fraction: float | None = None) -> torch.Tensor:
    """Centered windows ``float32[B, 4]``: the whole image when ``fraction`` is None,
    else ``fraction`` of the largest window with the output's aspect ratio (0.875 is
    the usual resize-256-then-crop-224 evaluation)."""
    H, W = hw[:, :1].to(torch.float32), hw[:, 1:].to(torch.float32)
    if fraction is None:
        return torch.cat([torch.zeros_like(H), torch.zeros_like(W), H, W], 1)
    aspect = size[1] / size[0]
    w = (torch.minimum(W, H * aspect) * fraction).round().clamp(min=1)
    h = (torch.minimum(H, W / aspect) * fraction).round().clamp(min=1)
    return torch.cat([torch.floor((H - h) / 2), torch.floor((W - w) / 2), h, w], 1)


def center_window(hw: torch.Tensor, crop_hw: tuple[int, int]) -> torch.Tensor:
    """Centered ``crop_hw`` windows ``float32[B, 4]``, shrunk to fit each image (torchvision's
    ``CenterCrop`` without padding): the twin of ``packio.geometry.center_window``."""
    H, W = hw[:, :1].to(torch.float32), hw[:, 1:].to(torch.float32)
    h, w = H.clamp(max=crop_hw[0]), W.clamp(max=crop_hw[1])
    return torch.cat([torch.floor((H - h) / 2), torch.floor((W - w) / 2), h, w], 1)


def resample_matrix(n_in: int, start: torch.Tensor, length: torch.Tensor, n_out: int,
                    flip: torch.Tensor | None = None, antialias: bool = True,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[B, n_out, n_in]``: row ``i`` of image ``b`` holds the weights of input pixels
    ``start[b] .. start[b] + length[b]`` for output pixel ``i`` (triangle filter, widened
    by the downscale factor when ``antialias``: PIL's and torch's antialiased bilinear;
    taps outside the window are dropped and the rest renormalised, as they do at edges).
    ``flip[b]`` reverses image b's rows (a mirror)."""
    dev = start.device
    x = torch.arange(n_in, device=dev, dtype=torch.float32).view(1, 1, -1) + 0.5
    i = torch.arange(n_out, device=dev, dtype=torch.float32).view(1, -1, 1) + 0.5
    start, length = start.view(-1, 1, 1).to(torch.float32), length.view(-1, 1, 1).to(torch.float32)
    s = length / n_out
    support = s.clamp(min=1.0) if antialias else torch.ones_like(s)
    t = (x - (start + s * i)) / support
    wgt = (1 - t.abs()).clamp(min=0) * ((x > start) & (x < start + length))
    wgt = wgt / wgt.sum(-1, keepdim=True)
    if flip is not None:
        wgt = torch.where(flip.view(-1, 1, 1), wgt.flip(1), wgt)
    return wgt.to(dtype)


def _groups(sizes: list[tuple[int, int]], waste: float = 1.5, max_groups: int = 4) -> list[list[int]]:
    """Split a batch of differently sized images into few groups whose padded canvas
    wastes at most ``waste`` x their pixels (host-side, from shapes)."""
    def fits(g: list[int]) -> bool:
        hmax, wmax = max(sizes[i][0] for i in g), max(sizes[i][1] for i in g)
        return hmax * wmax * len(g) <= waste * sum(sizes[i][0] * sizes[i][1] for i in g)

    everything = list(range(len(sizes)))
    if fits(everything):
        return [everything]
    groups: list[list[int]] = [[]]
    for i in sorted(everything, key=lambda k: sizes[k]):
        if groups[-1] and not fits(groups[-1] + [i]) and len(groups) < max_groups:
            groups.append([])
        groups[-1].append(i)
    return groups


def _canvas(images: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``[b, C, Hmax, Wmax]`` zero-padded copy of differently sized ``[C, H, W]`` images:
    one fill and one copy kernel per image, all queued without a host sync
    (``torch.nested.nested_tensor`` of device tensors synchronises the host, which
    stalled an asynchronous decoder feeding this)."""
    hmax, wmax = max(im.shape[-2] for im in images), max(im.shape[-1] for im in images)
    canvas = images[0].new_zeros((len(images), images[0].shape[0], hmax, wmax), dtype=dtype)
    for k, im in enumerate(images):
        canvas[k, :, :im.shape[-2], :im.shape[-1]] = im
    return canvas


def _resample(canvas: torch.Tensor, window: torch.Tensor, size: tuple[int, int], flip: torch.Tensor | None,
              antialias: bool) -> torch.Tensor:
    (h, w), (b, c, hc, wc) = size, canvas.shape
    ry = resample_matrix(hc, window[:, 0], window[:, 2], h, None, antialias, canvas.dtype)
    rxt = resample_matrix(wc, window[:, 1], window[:, 3], w, flip, antialias, canvas.dtype).transpose(1, 2)
    # Two products; the width one is a plain bmm over [b, C*H, W] rows, the height one
    # broadcasts Ry over channels. Contract the cheaper side first.
    if hc * wc * w + h * hc * w <= h * hc * wc + h * wc * w:
        tmp = torch.bmm(canvas.reshape(b, c * hc, wc), rxt).view(b, c, hc, w)
        return torch.matmul(ry.unsqueeze(1), tmp)
    tmp = torch.matmul(ry.unsqueeze(1), canvas)
    return torch.bmm(tmp.reshape(b, c * h, wc), rxt).view(b, c, h, w)


def resized_crop(images: Images, window: torch.Tensor, size: tuple[int, int], flip: torch.Tensor | None = None,
                 antialias: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Crop ``window[b]`` (top, left, h, w) out of each image, resize it to ``size``
    and mirror it where ``flip[b]``: ``dtype[B, C, h, w]`` in the 0-255 range.
    ``images``: a ``[B, C, H, W]`` tensor or a list of ``[C, H_i, W_i]`` tensors."""
    if isinstance(images, torch.Tensor):
        canvas = images.to(dtype=dtype, memory_format=torch.contiguous_format)
        return _resample(canvas, window, size, flip, antialias)
    sizes = [(int(im.shape[-2]), int(im.shape[-1])) for im in images]
    groups = _groups(sizes)
    if len(groups) == 1:
        return _resample(_canvas(images, dtype), window, size, flip, antialias)
    dev = _device(images)
    out = torch.empty((len(images), images[0].shape[0], *size), dtype=dtype, device=dev)
    for g in groups:
        idx = h2d(torch.tensor(g, dtype=torch.int64), dev)
        part = _resample(_canvas([images[i] for i in g], dtype), window[idx], size,
                         None if flip is None else flip[idx], antialias)
        out.index_copy_(0, idx, part)
    return out


def _affine(mean: Sequence[float], std: Sequence[float], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    c = len(mean)
    scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32).view(1, c, 1, 1)
    shift = torch.tensor([-m / s for m, s in zip(mean, std)], dtype=torch.float32).view(1, c, 1, 1)
    return h2d(scale, device), h2d(shift, device)


def normalize(images: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
              dtype: torch.dtype = torch.float32, channels_last: bool = False,
              affine: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """0-255 ``[B, C, H, W]`` (uint8 or float) → ``(x/255 - mean) / std`` in ``dtype``
    and the asked memory format: one multiply-add kernel writing the output directly."""
    scale, shift = affine if affine is not None else _affine(mean, std, images.device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty(images.shape, dtype=dtype, device=images.device, memory_format=fmt)
    return torch.addcmul(shift, images, scale, out=out)


@dataclass
class GPUTransform:
    """The usual training/eval pipeline over a packio batch dict, on the batch's device.

    ``image``: ``[B, C, H, W]`` uint8, a list of ``[C, H_i, W_i]`` tensors, or a list
    of encoded images (decoded first by ``decoder``, a :class:`BatchDecoder`, on
    ``device``). Training: random resized crop (``crop_scale``, ``crop_ratio``) and a
    horizontal flip with probability ``flip_p``, both drawn on the device (``generator``
    may be a CUDA generator); eval: the centered window of ``eval_crop`` (None: the
    whole image) resized to ``size``. ``boxes`` (lists, or packed by the Prefetcher)
    come out as one :class:`PackedBoxes` with ``keep`` cleared for boxes the crop
    dropped (``min_visible``: also those with less of their area inside, as
    ``packio.DecodeOptions(min_visible=...)``); ``crop`` (``[B, 4]`` top, left, h, w in input pixels) and ``flip``
    (``bool[B]``) say what was done to each image.
    """

    size: tuple[int, int] = (224, 224)
    train: bool = True
    dtype: torch.dtype = torch.float32
    channels_last: bool = False
    mean: Sequence[float] = IMAGENET_MEAN
    std: Sequence[float] = IMAGENET_STD
    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    min_visible: float = 0.0
    eval_crop: float | None = None
    antialias: bool = True
    compute_dtype: torch.dtype = torch.float32
    generator: torch.Generator | None = None
    device: str | torch.device | None = None
    decoder: Any = None
    _affine: dict = field(default_factory=dict, init=False, repr=False)

    def _decode(self, images: list) -> list[torch.Tensor]:
        if self.decoder is None:
            from packio.cuda.decode import BatchDecoder

            self.decoder = BatchDecoder(resolve(self.device))
        return self.decoder(images)

    def __call__(self, batch: dict) -> dict:
        images = batch["image"]
        if isinstance(images, (list, tuple)) and images and (not isinstance(images[0], torch.Tensor)
                                                             or images[0].dim() == 1):
            images = self._decode(images)  # encoded bytes (decode=False datasets)
        dev, n = _device(images), len(images)
        hw = image_sizes(images)
        if self.train:
            window = sample_crops(hw, self.crop_scale, self.crop_ratio, self.generator)
            flip = rand((n,), dev, self.generator) < self.flip_p
        else:
            window = center_crops(hw, self.size, self.eval_crop)
            flip = torch.zeros(n, dtype=torch.bool, device=dev)
        x = resized_crop(images, window, self.size, flip if self.train else None, self.antialias, self.compute_dtype)
        if dev not in self._affine:
            self._affine[dev] = _affine(self.mean, self.std, dev)
        out = bx.pack_batch(batch)
        out["image"] = normalize(x, dtype=self.dtype, channels_last=self.channels_last, affine=self._affine[dev])
        out["crop"], out["flip"] = window, flip
        packed = out.get("boxes")
        if isinstance(packed, bx.PackedBoxes):
            packed = bx.crop(packed.to(dev), window, self.min_visible)
            packed = bx.resize(packed, window[:, 2:], self.size)
            out["boxes"] = bx.hflip(packed, self.size[1], flip)
        return out
