"""Box geometry: the one set of rules for pack time, read time and (via its torch twin) the GPU.

Boxes are ``float32[N, 4]`` ``xmin, ymin, xmax, ymax`` in continuous pixel
coordinates: pixel column ``i`` spans ``[i, i + 1)``, so an image of width ``W``
spans ``[0, W]``. Box labels (``int64[N]``) travel with the boxes.

One rule everywhere: scale, flip and orient never drop a box; ``crop`` drops
exactly the boxes that do not overlap the window's interior, with their labels.
Every function is pure: inputs are never modified.

Read-time geometry (a random-resized crop, a horizontal flip, a short-side resize and
center crop) is a :class:`Recipe`; :func:`plan` turns it, with the stored image's size
and ``(seed, epoch, index)``, into one sample's :class:`Plan` (a window of the stored
image, the output size, a flip), drawing from its own generator seeded by those three
numbers alone: no global RNG, the same plan on any thread, worker, rank or resume.
:func:`plan_boxes` moves the sample's boxes by the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

__all__ = ["ORIENTATIONS", "as_boxes", "as_labels", "scale", "resize", "hflip", "vflip", "transpose",
           "upright_size", "orient", "inverse_orientation", "orient_image", "clip", "crop", "center_window",
           "ATTEMPTS", "Recipe", "Plan", "random_resized_window", "short_side_size", "center_crop_window",
           "draws", "plan", "plan_boxes"]

ORIENTATIONS = range(1, 9)


def as_boxes(boxes: np.ndarray | list) -> np.ndarray:
    """Any ``[N, 4]``-shaped input → a fresh ``float32[N, 4]`` array."""
    return np.array(boxes, np.float32, copy=True).reshape(-1, 4)


def as_labels(labels: np.ndarray | list, n: int) -> np.ndarray:
    """Box labels as ``int64[n]``; ValueError when they do not pair with the boxes."""
    out = np.array(labels, np.int64, copy=True).reshape(-1)
    if len(out) != n:
        raise ValueError(f"{n} boxes but {len(out)} box labels")
    return out


def scale(boxes: np.ndarray, sx: float, sy: float) -> np.ndarray:
    """Multiply x by ``sx`` and y by ``sy`` (a resize by those factors)."""
    b = as_boxes(boxes)
    b[:, 0::2] *= np.float32(sx)
    b[:, 1::2] *= np.float32(sy)
    return b


def resize(boxes: np.ndarray, src_hw: tuple[int, int], dst_hw: tuple[int, int]) -> np.ndarray:
    """Boxes of an image of ``src_hw=(h0, w0)`` resized to ``dst_hw=(h1, w1)``."""
    (h0, w0), (h1, w1) = src_hw, dst_hw
    if h0 <= 0 or w0 <= 0:
        raise ValueError(f"cannot resize boxes from an image of size {src_hw}")
    if (h0, w0) == (h1, w1):
        return as_boxes(boxes)
    # x * w1 / w0 in float64, not x * float32(w1 / w0): an edge at w0 lands exactly on w1
    # (a rounded factor puts it a float32 ulp outside the image, which box checkers reject)
    b = as_boxes(boxes).astype(np.float64)
    b[:, 0::2] = b[:, 0::2] * w1 / w0
    b[:, 1::2] = b[:, 1::2] * h1 / h0
    return b.astype(np.float32)


def hflip(boxes: np.ndarray, width: float) -> np.ndarray:
    """Mirror left-right in an image ``width`` wide."""
    b = as_boxes(boxes)
    b[:, [0, 2]] = np.float32(width) - b[:, [2, 0]]
    return b


def vflip(boxes: np.ndarray, height: float) -> np.ndarray:
    """Mirror top-bottom in an image ``height`` high."""
    b = as_boxes(boxes)
    b[:, [1, 3]] = np.float32(height) - b[:, [3, 1]]
    return b


def transpose(boxes: np.ndarray) -> np.ndarray:
    """Swap x and y (mirror over the main diagonal)."""
    return as_boxes(boxes)[:, [1, 0, 3, 2]]


def _check_orientation(orientation: int) -> int:
    o = int(orientation)
    if o not in ORIENTATIONS:
        raise ValueError(f"EXIF orientation must be 1..8, got {orientation!r}")
    return o


# Each orientation as (transpose, then hflip, then vflip) of the stored image: the
# decomposition PIL.ImageOps.exif_transpose's operations amount to.
_STEPS = {1: (False, False, False), 2: (False, True, False), 3: (False, True, True), 4: (False, False, True),
          5: (True, False, False), 6: (True, True, False), 7: (True, True, True), 8: (True, False, True)}


def upright_size(orientation: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) of the upright image for a stored image of ``width, height``."""
    return (height, width) if _STEPS[_check_orientation(orientation)][0] else (width, height)


def orient(boxes: np.ndarray, orientation: int, width: int, height: int) -> np.ndarray:
    """Boxes of the stored image (``width, height`` before the orientation is applied)
    → boxes of the upright image, as ``PIL.ImageOps.exif_transpose`` shows it."""
    swap, fx, fy = _STEPS[_check_orientation(orientation)]
    b = transpose(boxes) if swap else as_boxes(boxes)
    w, h = (height, width) if swap else (width, height)
    if fx:
        b = hflip(b, w)
    if fy:
        b = vflip(b, h)
    return b


def inverse_orientation(orientation: int) -> int:
    """The orientation that undoes ``orientation`` (6 and 8 swap; the others are their own inverse)."""
    o = _check_orientation(orientation)
    return {6: 8, 8: 6}.get(o, o)


def orient_image(img: np.ndarray, orientation: int) -> np.ndarray:
    """Pixels ``[H, W, ...]`` as stored → upright (a view; same steps as :func:`orient`)."""
    swap, fx, fy = _STEPS[_check_orientation(orientation)]
    if swap:
        img = img.swapaxes(0, 1)
    if fx:
        img = img[:, ::-1]
    if fy:
        img = img[::-1]
    return img


def clip(boxes: np.ndarray, width: float, height: float) -> np.ndarray:
    """Clamp coordinates into ``[0, width] x [0, height]`` (never drops a box)."""
    b = as_boxes(boxes)
    b[:, 0::2] = np.clip(b[:, 0::2], 0, width)
    b[:, 1::2] = np.clip(b[:, 1::2], 0, height)
    return b


def crop(boxes: np.ndarray, labels: np.ndarray, top: float, left: float, height: float,
         width: float, min_visible: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Boxes and labels inside the window ``(top, left, height, width)`` of the current frame.

    A box is kept iff it overlaps the window's interior (a zero-area box strictly
    inside is kept; one outside or only touching an edge is dropped, with its
    label) and at least ``min_visible`` of its area is inside the window (a kept
    zero-area box counts as wholly inside); kept boxes are shifted into the
    window's frame and clipped to it.
    """
    b = as_boxes(boxes)
    lab = as_labels(labels, len(b))
    keep = ((b[:, 0] < left + width) & (b[:, 2] > left) & (b[:, 1] < top + height) & (b[:, 3] > top))
    shifted = b - np.array([left, top, left, top], np.float32)
    inside = clip(shifted, width, height)
    if min_visible > 0:
        area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
        seen = (inside[:, 2] - inside[:, 0]) * (inside[:, 3] - inside[:, 1])
        keep &= (area <= 0) | (seen >= np.float32(min_visible) * area)
    return inside[keep], lab[keep]


def center_window(height: int, width: int, crop_h: int, crop_w: int) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of a centered ``crop_h x crop_w`` window (shrunk to fit the image)."""
    h, w = min(crop_h, height), min(crop_w, width)
    return (height - h) // 2, (width - w) // 2, h, w


# --- read-time geometry: one sample's crop window, output size and flip -------------------------

ATTEMPTS = 10  # torchvision's RandomResizedCrop tries 10 windows before its fallback
_STREAM = 0x67656F  # "geo": these draws never share a stream with another use of (seed, epoch, index)


def _pair(name: str, v: object) -> tuple[int, int] | None:
    """``v`` as (h, w): an int is a square; both positive ints. ValueError otherwise."""
    if v is None:
        return None
    hw = (v, v) if isinstance(v, (int, np.integer)) else tuple(v)  # type: ignore[arg-type]
    if len(hw) != 2 or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x > 0 for x in hw):
        raise ValueError(f"{name} must be a positive int or (height, width), not {v!r}")
    return int(hw[0]), int(hw[1])


def _range(name: str, v: object, lo: float, hi: float) -> tuple[float, float]:
    """``v`` as a (min, max) pair of numbers with ``lo < min <= max <= hi``."""
    try:
        a, b = (float(x) for x in v)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (min, max) pair of numbers, not {v!r}") from None
    if not lo < a <= b <= hi:
        raise ValueError(f"{name} must be (min, max) with {lo} < min <= max <= {hi}, not {v!r}")
    return a, b


@dataclass(frozen=True)
class Recipe:
    """Read-time geometry, torchvision's names and rules; at most one of the three sizes.

    ``random_resized_crop=(h, w)``: torchvision's ``RandomResizedCrop`` (a window of
    ``crop_scale`` of the area and an aspect ratio in ``crop_ratio``, log-uniform; 10
    tries, then the whole image clamped to ``crop_ratio``, centered). ``short_side=S``:
    the image resized so its short side is S (the long side rounded, as
    ``ResizeSpec(short_side=S)``), then, with ``center_crop=(h, w)``, the centered
    window of that size (``center_crop`` alone crops the stored image; a smaller image
    is stretched to it). ``resize=(h, w)``: the whole image squashed to (h, w).
    ``flip_p``: the chance of a horizontal flip. ``min_visible``: a box keeps less of
    its area than this inside the window is dropped (0: a box is dropped only when
    nothing of it is inside). Sizes given as one int are squares.
    """

    resize: tuple[int, int] | None = None
    random_resized_crop: tuple[int, int] | None = None
    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.0
    short_side: int | None = None
    center_crop: tuple[int, int] | None = None
    min_visible: float = 0.0

    def __post_init__(self) -> None:
        for name in ("resize", "random_resized_crop", "center_crop"):
            object.__setattr__(self, name, _pair(name, getattr(self, name)))
        object.__setattr__(self, "crop_scale", _range("crop_scale", self.crop_scale, 0.0, 1.0))
        object.__setattr__(self, "crop_ratio", _range("crop_ratio", self.crop_ratio, 0.0, math.inf))
        for name in ("flip_p", "min_visible"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or not 0 <= v <= 1:
                raise ValueError(f"{name} must be a number from 0 to 1, not {v!r}")
            object.__setattr__(self, name, float(v))
        if self.short_side is not None:
            object.__setattr__(self, "short_side", _pair("short_side", self.short_side)[0])  # type: ignore[index]
        self._check_combination()

    def _check_combination(self) -> None:
        given = [n for n, v in (("resize", self.resize), ("random_resized_crop", self.random_resized_crop),
                                ("short_side/center_crop", self.short_side or self.center_crop)) if v]
        if len(given) > 1:
            raise ValueError(f"give one of resize, random_resized_crop or short_side/center_crop, not {given}")
        if self.random_resized_crop is None and (self.crop_scale, self.crop_ratio) != ((0.08, 1.0), (3 / 4, 4 / 3)):
            raise ValueError("crop_scale and crop_ratio shape random_resized_crop: give random_resized_crop=SIZE too")
        if self.short_side and self.center_crop and max(self.center_crop) > self.short_side:
            raise ValueError(f"center_crop={self.center_crop} is larger than short_side={self.short_side}: "
                             f"every image would be stretched; make the crop at most the short side")

    @property
    def size(self) -> tuple[int, int] | None:
        """(h, w) of every output, or None when it follows each image's size."""
        return self.random_resized_crop or self.center_crop or self.resize

    @property
    def random(self) -> bool:
        return self.random_resized_crop is not None or 0 < self.flip_p < 1

    @property
    def active(self) -> bool:
        """Whether it does anything besides a squash resize (which the plain resize path does)."""
        return bool(self.random_resized_crop or self.short_side or self.center_crop or self.flip_p)


class Plan(NamedTuple):
    """One sample's geometry: the window ``(top, left, height, width)`` of the stored
    ``stored_h x stored_w`` image (whole pixels) resized to ``out_h x out_w``, then mirrored
    left-right when ``flip``."""

    top: int
    left: int
    height: int
    width: int
    out_h: int
    out_w: int
    flip: bool
    stored_h: int
    stored_w: int

    @property
    def whole(self) -> bool:
        """The window is the whole stored image (nothing is cropped, no box dropped)."""
        return (self.top, self.left, self.height, self.width) == (0, 0, self.stored_h, self.stored_w)


def random_resized_window(h: int, w: int, u: Sequence[float], scale: tuple[float, float] = (0.08, 1.0),
                          ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params`` on an ``h x w`` image, with its draws
    given: ``u`` holds 4 uniforms in [0, 1) per try (area, log-ratio, top, left), 10 tries.
    Returns ``(top, left, height, width)``; when no try fits, the whole image clamped to
    ``ratio``, centered."""
    area, lr0, lr1 = h * w, math.log(ratio[0]), math.log(ratio[1])
    for k in range(ATTEMPTS):
        ua, ur, ut, ul = u[4 * k:4 * k + 4]
        target = area * (scale[0] + (scale[1] - scale[0]) * ua)
        aspect = math.exp(lr0 + (lr1 - lr0) * ur)
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return min(int(ut * (h - ch + 1)), h - ch), min(int(ul * (w - cw + 1)), w - cw), ch, cw
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        cw, ch = int(round(h * ratio[1])), h
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def short_side_size(h: int, w: int, short_side: int) -> tuple[int, int]:
    """(h, w) with the short side ``short_side`` and the aspect kept (the long side rounded)."""
    s = short_side / min(h, w)
    return max(1, round(h * s)), max(1, round(w * s))


def center_crop_window(h: int, w: int, crop_hw: tuple[int, int],
                       short_side: int | None = None) -> tuple[int, int, int, int]:
    """The window of an ``h x w`` image that a short-side resize to ``short_side`` (None: no
    resize) and a centered ``crop_hw`` crop keep, in the image's own whole pixels (edges
    rounded to the nearest); shrunk to the image where the crop is larger."""
    if short_side is None:
        return center_window(h, w, *crop_hw)
    nh, nw = short_side_size(h, w, short_side)
    t, left, ch, cw = center_window(nh, nw, *crop_hw)
    top, bottom = round(t * h / nh), round((t + ch) * h / nh)
    x0, x1 = round(left * w / nw), round((left + cw) * w / nw)
    return top, x0, max(1, bottom - top), max(1, x1 - x0)


def draws(seed: int, epoch: int, index: int, n: int) -> np.ndarray:
    """``n`` uniforms in [0, 1) of sample ``index`` in ``epoch``: a generator of its own,
    seeded by ``(seed, epoch, index)`` alone (numpy's SeedSequence spawn keys)."""
    ss = np.random.SeedSequence(seed, spawn_key=(_STREAM, epoch, index))
    return np.random.Generator(np.random.PCG64(ss)).random(n)


def plan(recipe: Recipe, h: int, w: int, seed: int = 0, epoch: int = 0, index: int = 0) -> Plan:
    """Sample ``index``'s plan for a stored ``h x w`` image in ``epoch``: a pure function
    of its arguments. The flip takes the first draw, the crop the next 40, so one recipe's
    flips do not change when the crop is switched on or off."""
    if h <= 0 or w <= 0:
        raise ValueError(f"cannot plan the geometry of an image of {w}x{h} pixels")
    u = draws(seed, epoch, index, 1 + 4 * ATTEMPTS) if recipe.random else None
    flip = recipe.flip_p >= 1 or (u is not None and bool(u[0] < recipe.flip_p))
    if recipe.random_resized_crop is not None:
        window = random_resized_window(h, w, u[1:], recipe.crop_scale, recipe.crop_ratio)  # type: ignore[index]
        out = recipe.random_resized_crop
    elif recipe.center_crop is not None:
        window, out = center_crop_window(h, w, recipe.center_crop, recipe.short_side), recipe.center_crop
    else:
        window = (0, 0, h, w)
        out = recipe.resize or (short_side_size(h, w, recipe.short_side) if recipe.short_side else (h, w))
    return Plan(*window, *out, flip, h, w)


def plan_boxes(boxes: np.ndarray, labels: np.ndarray, p: Plan,
               min_visible: float = 0.0) -> tuple[np.ndarray, np.ndarray, int]:
    """Boxes (stored-image pixels) and labels moved by ``p`` into the output image:
    ``hflip(resize(crop(...)))`` by those functions' rules (:func:`crop` with
    ``min_visible``), in one pass (a sample's few boxes cost a few numpy calls, not forty).
    Returns ``(boxes, labels, dropped)``; a plan that keeps the whole image drops none."""
    b = as_boxes(boxes)
    lab = as_labels(labels, len(b))
    n = len(b)
    if n == 0:
        return b, lab, 0
    if not p.whole:
        keep = (b[:, 0] < p.left + p.width) & (b[:, 2] > p.left) & (b[:, 1] < p.top + p.height) & (b[:, 3] > p.top)
        lim = np.array([p.width, p.height, p.width, p.height], np.float32)
        inside = np.minimum(np.maximum(b - np.array([p.left, p.top, p.left, p.top], np.float32), 0), lim)
        if min_visible > 0:
            area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
            seen = (inside[:, 2] - inside[:, 0]) * (inside[:, 3] - inside[:, 1])
            keep &= (area <= 0) | (seen >= np.float32(min_visible) * area)
        b, lab = inside[keep], lab[keep]
    if (p.height, p.width) != (p.out_h, p.out_w):  # as resize(): x * w1 / w0 in float64
        b = (b.astype(np.float64) * np.array([p.out_w, p.out_h] * 2, np.float64)
             / np.array([p.width, p.height] * 2, np.float64)).astype(np.float32)
    if p.flip:
        b[:, [0, 2]] = np.float32(p.out_w) - b[:, [2, 0]]
    return b, lab, n - len(b)
