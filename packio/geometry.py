"""Box geometry: the one set of rules for pack time, read time and (via its torch twin) the GPU.

Boxes are ``float32[N, 4]`` ``xmin, ymin, xmax, ymax`` in continuous pixel
coordinates: pixel column ``i`` spans ``[i, i + 1)``, so an image of width ``W``
spans ``[0, W]``. Box labels (``int64[N]``) travel with the boxes.

One rule everywhere: scale, flip and orient never drop a box; ``crop`` drops
exactly the boxes that do not overlap the window's interior, with their labels.
Every function is pure: inputs are never modified.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ORIENTATIONS", "as_boxes", "as_labels", "scale", "resize", "hflip", "vflip", "transpose",
           "upright_size", "orient", "inverse_orientation", "orient_image", "clip", "crop", "center_window"]

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


def crop(boxes: np.ndarray, labels: np.ndarray, top: int, left: int, height: int,
         width: int) -> tuple[np.ndarray, np.ndarray]:
    """Boxes and labels inside the window ``(top, left, height, width)`` of the current frame.

    A box is kept iff it overlaps the window's interior (a zero-area box strictly
    inside is kept; one outside or only touching an edge is dropped, with its
    label); kept boxes are shifted into the window's frame and clipped to it.
    """
    b = as_boxes(boxes)
    lab = as_labels(labels, len(b))
    keep = ((b[:, 0] < left + width) & (b[:, 2] > left) & (b[:, 1] < top + height) & (b[:, 3] > top))
    b = b[keep] - np.array([left, top, left, top], np.float32)
    return clip(b, width, height), lab[keep]


def center_window(height: int, width: int, crop_h: int, crop_w: int) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of a centered ``crop_h x crop_w`` window (shrunk to fit the image)."""
    h, w = min(crop_h, height), min(crop_w, width)
    return (height - h) // 2, (width - w) // 2, h, w
