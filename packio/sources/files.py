"""Reading one source image file, and placing its CSV boxes in the stored frame."""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

import numpy as np

from packio import geometry as geo

if TYPE_CHECKING:
    from packio.sources.listing import SourceItem

__all__ = ["read_image_file", "boxes_to_stored_frame"]


def read_image_file(path: str, max_bytes: int) -> tuple[bytes | None, str, str]:
    """(data, "", "") or (None, skip reason, detail). Never blocks on a FIFO, sniffs the
    first bytes before reading the rest (a huge file that is no image is not read), and
    refuses a file over ``max_bytes`` before reading it (an 8 GiB sparse .jpg)."""
    from packio.decode import sniff

    try:
        with open(path, "rb", opener=_nonblocking) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None, "not a regular file", ""
            if st.st_size == 0:
                return None, "empty file", ""
            head = f.read(64)
            enc = sniff(head)
            if enc is None:
                return None, "not an image", ""
            if enc == "gif":
                return None, "unsupported image type (gif)", ""
            if st.st_size > max_bytes:
                return None, "file too large", f"{st.st_size} bytes, limit {max_bytes}"
            data = head + f.read(st.st_size + 1 - len(head))
    except OSError as exc:
        return None, "unreadable file", exc.strerror or str(exc)
    if len(data) != st.st_size:
        return None, "file changed while being read", ""
    return data, "", ""


def _nonblocking(path: str, flags: int) -> int:
    fd = os.open(path, flags | os.O_NONBLOCK)
    os.set_blocking(fd, True)  # blocking reads again (regular files ignore it; a FIFO is refused)
    return fd


def _fits(frame: tuple[int, int], size: tuple[int, int]) -> bool:
    """Is ``frame`` (w, h) ``size`` (w, h) resized, to within a pixel of rounding?"""
    (fw, fh), (w, h) = frame, size
    return abs(fh - fw * h / w) <= 1 or abs(fw - fh * w / h) <= 1


def boxes_to_stored_frame(item: SourceItem, width: int, height: int,
                          orientation: int) -> tuple[np.ndarray, list[str]] | str:
    """The item's CSV boxes in the frame of the image as stored (``width x height``
    before its EXIF ``orientation``), and notes; or why they cannot be placed.

    The rule: a CSV box is in the *upright* frame (what viewers, browsers, annotation
    tools and ``PIL.ImageOps.exif_transpose`` show) unless the CSV's width/height
    say otherwise: equal to the stored size (and not to the upright one) → the
    stored frame; the same shape at another size → a resized copy of that frame,
    scaled back; another shape → the image is skipped (its boxes would be wrong).
    """
    boxes = np.asarray(item.boxes, np.float32).reshape(-1, 4)
    if not len(boxes):
        return boxes, []
    upright = geo.upright_size(orientation, width, height)
    frames = item.frames or [(0, 0)] * len(boxes)
    out, notes = np.empty_like(boxes), set()
    for k, (box, frame) in enumerate(zip(boxes, frames)):
        if frame == (0, 0) or frame == upright:
            src, in_upright = upright, True
        elif frame == (width, height):
            src, in_upright = frame, False
            notes.add("CSV boxes in the stored (not EXIF-upright) frame, told by the CSV's width/height")
        elif _fits(frame, upright) or _fits(frame, (width, height)):
            in_upright = _fits(frame, upright)
            src = upright if in_upright else (width, height)
            notes.add("CSV boxes given for a resized copy (width/height), scaled to the image")
        else:
            return (f"CSV width/height {frame[0]}x{frame[1]} fit neither the image ({width}x{height}) "
                    f"nor its EXIF-upright view ({upright[0]}x{upright[1]})")
        b = geo.resize(box[None], (frame[1], frame[0]), (src[1], src[0])) if frame != (0, 0) else box[None]
        if in_upright and orientation != 1:
            b = geo.orient(b, geo.inverse_orientation(orientation), *upright)
        out[k] = b[0]
    return out, sorted(notes)
