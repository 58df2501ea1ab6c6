"""``packio show``: look at samples as stored and as read, boxes and labels drawn on them.

One picture answers "are my boxes right, are my labels right, what does ``resize=`` do":
each sample is drawn as stored (decoded, no resize) and, with ``resize=``, as the
dataset hands it out. Boxes carry their class names; the image's label and key go under
each tile. Any format and any URL: the samples come through ``open_dataset``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from packio.api import open_dataset
from packio.errors import PackioError

__all__ = ["show", "render"]

MAX_SAMPLES = 64  # one picture; more is a contact sheet nobody reads
CAPTION = 40  # pixels under each tile: key, label, size
BACKGROUND = (255, 255, 255)
TEXT = (0, 0, 0)
# distinct, saturated BGR colours per box class (never pure red: red is a common object colour in tests)
PALETTE = [(0, 200, 0), (255, 128, 0), (0, 200, 255), (255, 0, 255), (128, 0, 255), (0, 255, 255),
           (255, 255, 0), (0, 128, 128)]


def _indices(n: int, indices: Sequence[int] | None, count: int) -> list[int]:
    if not indices:
        return sorted({int(i) for i in np.linspace(0, n - 1, num=min(count, n))}) if n else []
    if len(indices) > MAX_SAMPLES:
        raise PackioError(f"show draws at most {MAX_SAMPLES} samples; give fewer indices")
    bad = [i for i in indices if not -n <= int(i) < n]
    if bad:
        raise PackioError(f"sample index {bad[0]} out of range: the dataset holds {n} samples (0 to {n - 1})")
    return [int(i) % n for i in indices]


def _hwc(image: Any) -> np.ndarray:
    """A CHW uint8 tensor/array as a contiguous HWC BGR array for OpenCV."""
    arr = np.asarray(image.numpy() if hasattr(image, "numpy") else image)
    arr = np.ascontiguousarray(arr.transpose(1, 2, 0)) if arr.ndim == 3 and arr.shape[0] in (1, 3) else arr
    if arr.ndim == 2 or arr.shape[2] == 1:
        arr = np.repeat(arr.reshape(arr.shape[0], arr.shape[1], 1), 3, axis=2)
    return np.ascontiguousarray(arr[:, :, ::-1])


def _name(classes: list[str], label: int) -> str:
    return classes[label] if 0 <= label < len(classes) else f"{label} (no class)"


def _text(img: np.ndarray, text: str, org: tuple[int, int], color: tuple[int, int, int], scale: float = 0.4) -> None:
    import cv2

    # OpenCV's fonts draw ASCII only, and a lone surrogate (a name's non-UTF-8 byte) crashed it: escaped
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    cv2.putText(img, text, org, cv2.FONT_HERSHEY_SIMPLEX, scale, color, 1, cv2.LINE_AA)


def _tile(item: dict, classes: tuple[list[str], list[str]], cell: int, what: str) -> np.ndarray:
    """One sample drawn into a ``cell`` x ``cell + CAPTION`` tile; ``classes``: (image classes, box classes)."""
    import cv2

    img = _hwc(item["image"])
    h, w = img.shape[:2]
    s = cell / max(h, w)  # small images are enlarged too: boxes stay visible
    th, tw = max(1, round(h * s)), max(1, round(w * s))
    tile = np.full((cell + CAPTION, cell, 3), BACKGROUND, np.uint8)
    tile[:th, :tw] = cv2.resize(img, (tw, th), interpolation=cv2.INTER_AREA if s < 1 else cv2.INTER_NEAREST)
    boxes = np.asarray(item.get("boxes", np.zeros((0, 4))), np.float64).reshape(-1, 4) * s
    for (x0, y0, x1, y1), lab in zip(boxes, np.asarray(item.get("box_labels", [])).tolist()):
        color = PALETTE[lab % len(PALETTE)] if lab >= 0 else (128, 128, 128)
        p0, p1 = (int(round(x0)), int(round(y0))), (max(int(round(x1)) - 1, 0), max(int(round(y1)) - 1, 0))
        cv2.rectangle(tile[:th, :tw], p0, p1, color, 2)
        _text(tile[:th, :tw], _name(classes[1], lab), (p0[0] + 3, max(p0[1] - 4, 12)), color)
    label = int(item.get("label", -1))
    _text(tile, str(item.get("key", ""))[-38:], (3, cell + 13), TEXT)
    _text(tile, f"{what} {w}x{h}  label: {_name(classes[0], label) if label >= 0 else 'none'}", (3, cell + 30), TEXT)
    return tile


def render(path: str | Path, indices: Sequence[int] | None = None, *, resize: int | tuple[int, int] | None = None,
           count: int = 8, cell: int = 256, columns: int = 4, **open_args: Any) -> np.ndarray:
    """The grid :func:`show` writes, as an ``[H, W, 3]`` RGB ``uint8`` array."""
    stored = open_dataset(path, **open_args)
    read = open_dataset(path, resize=resize, **open_args) if resize is not None else None
    picked = _indices(len(stored), indices, count)
    if not picked:
        raise PackioError(f"{path} holds no samples to show")
    names = (list(stored.classes), list(stored.box_classes))
    tiles = []
    for i in picked:
        tiles.append(_tile(stored[i], names, cell, "stored"))
        if read is not None:
            tiles.append(_tile(read[i], names, cell, f"read resize={resize}:"))
    columns = max(1, columns - columns % 2) if read is not None else max(1, columns)  # pairs stay on one row
    columns = min(columns, len(tiles))
    rows = -(-len(tiles) // columns)
    th, tw = tiles[0].shape[:2]
    grid = np.full((rows * th, columns * tw, 3), 200, np.uint8)
    for k, tile in enumerate(tiles):
        r, c = divmod(k, columns)
        grid[r * th:(r + 1) * th, c * tw:(c + 1) * tw] = tile
    return np.ascontiguousarray(grid[:, :, ::-1])


def show(path: str | Path, indices: Sequence[int] | None = None, out: str | Path = "grid.png", *,
         resize: int | tuple[int, int] | None = None, count: int = 8, cell: int = 256, columns: int = 4,
         **open_args: Any) -> Path:
    """Draw samples of a packed dataset (any format, or a URL) into a PNG and return its path.

    ``indices``: which samples (default: ``count`` spread over the dataset). Each is drawn
    as stored; with ``resize=`` (as the datasets take it: ``224`` squashes to 224x224,
    ``(h, w)`` to that shape, aspect not kept) also as read. Boxes carry their class
    names, the key, size and image label go under each tile. ``open_args`` go to
    :func:`packio.open_dataset` (``cache_dir``, ``storage_options``, ...).
    """
    import cv2

    out = Path(out)
    if out.suffix.lower() not in (".png", ".jpg", ".jpeg"):
        raise PackioError(f"show writes PNG or JPEG: name the output like {out.with_suffix('.png')}")
    ok, data = cv2.imencode(out.suffix.lower(), render(path, indices, resize=resize, count=count, cell=cell,
                                                       columns=columns, **open_args)[:, :, ::-1])
    if not ok:
        raise PackioError(f"could not encode {out}")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data.tobytes())
        os.replace(tmp, out)  # never a half-written picture under the final name
    finally:
        tmp.unlink(missing_ok=True)
    return out
