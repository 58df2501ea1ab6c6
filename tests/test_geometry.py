"""packio.geometry against ground truth: masks drawn where a box says, PIL's own EXIF transpose."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from packio import geometry as geo


def _mask_box(mask: np.ndarray) -> list[float]:
    """Tight continuous xyxy box of the True pixels."""
    ys, xs = np.nonzero(mask)
    return [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]


def _with_orientation(img: np.ndarray, orientation: int) -> Image.Image:
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(img).save(buf, "PNG", exif=exif)
    return Image.open(io.BytesIO(buf.getvalue()))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_matches_pil_exif_transpose(orientation: int) -> None:
    h, w = 7, 11
    box = [2, 1, 6, 3]  # x0, y0, x1, y1 in the stored image
    img = np.zeros((h, w, 3), np.uint8)
    img[box[1]:box[3], box[0]:box[2]] = 255
    img[0, 0] = (0, 0, 255)  # a marker corner, so flips that keep the box's place still show
    upright = np.asarray(ImageOps.exif_transpose(_with_orientation(img, orientation)))
    assert np.array_equal(geo.orient_image(img, orientation), upright)
    assert geo.upright_size(orientation, w, h) == (upright.shape[1], upright.shape[0])
    got = geo.orient(np.array([box], np.float32), orientation, w, h)
    assert got.tolist() == [_mask_box(upright[..., 0] == 255)]
    back = geo.orient(got, geo.inverse_orientation(orientation), upright.shape[1], upright.shape[0])
    assert back.tolist() == [box]


def test_crop_rule_keeps_exactly_boxes_overlapping_the_interior() -> None:
    boxes = np.array([
        [2, 2, 4, 4],      # inside
        [0, 0, 10, 10],    # covers the window: clipped to it
        [5, 5, 5, 5],      # zero area, strictly inside: kept
        [0, 0, 1, 1],      # outside
        [1, 2, 2, 4],      # touches the left edge only: dropped
        [2, 6, 3, 9],      # touches the bottom edge only: dropped
        [1, 1, 1, 8],      # zero width on the left edge: dropped
        [5.5, 1, 7.5, 3],  # sticks out right: clipped
    ], np.float32)
    labels = np.arange(len(boxes), dtype=np.int64)
    b, lab = geo.crop(boxes, labels, top=1, left=2, height=5, width=4)  # window x [2,6], y [1,6]
    assert lab.tolist() == [0, 1, 2, 7]
    assert b.tolist() == [[0, 1, 2, 3], [0, 0, 4, 5], [3, 4, 3, 4], [3.5, 0, 4, 2]]
    assert b.dtype == np.float32 and lab.dtype == np.int64


def test_inputs_never_modified_and_shapes_checked() -> None:
    boxes = np.array([[1, 2, 3, 4]], np.float32)
    keep = boxes.copy()
    geo.scale(boxes, 2, 3)
    geo.hflip(boxes, 10)
    geo.vflip(boxes, 10)
    geo.orient(boxes, 6, 10, 20)
    geo.clip(boxes, 2, 2)
    geo.crop(boxes, [0], 0, 0, 2, 2)
    assert np.array_equal(boxes, keep)
    assert geo.scale(boxes, 2, 3).tolist() == [[2, 6, 6, 12]]
    assert geo.resize(boxes, (10, 20), (5, 40)).tolist() == [[2, 1, 6, 2]]
    assert geo.hflip(boxes, 10).tolist() == [[7, 2, 9, 4]]
    assert geo.vflip(boxes, 10).tolist() == [[1, 6, 3, 8]]
    assert geo.clip([[-1, 2, 30, 4]], 10, 3).tolist() == [[0, 2, 10, 3]]
    assert geo.as_boxes([]).shape == (0, 4)
    assert geo.crop(np.zeros((0, 4)), [], 0, 0, 3, 3)[0].shape == (0, 4)
    with pytest.raises(ValueError, match="1 boxes but 2 box labels"):
        geo.crop(boxes, [0, 1], 0, 0, 2, 2)
    with pytest.raises(ValueError, match="orientation"):
        geo.orient(boxes, 9, 10, 10)
    assert geo.center_window(10, 20, 4, 30) == (3, 0, 4, 20)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 12), st.integers(1, 12),
       st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12), st.integers(0, 12), st.integers(0, 12)),
                max_size=4),
       st.integers(0, 11), st.integers(0, 11), st.integers(1, 12), st.integers(1, 12))
def test_pixels_and_boxes_move_together(orientation: int, w: int, h: int, raw: list, top: int, left: int,
                                        ch: int, cw: int) -> None:
    """Any orientation then any crop: each kept box is the bounding box of its own mask's pixels,
    and a box is dropped exactly when its mask has no pixel left (positive-area boxes)."""
    boxes = np.array([[min(a, c) % (w + 1), min(b, d) % (h + 1), max(a, c) % (w + 1), max(b, d) % (h + 1)]
                      for a, b, c, d in raw], np.float32).reshape(-1, 4)
    boxes[:, 2:] = np.maximum(boxes[:, 2:], boxes[:, :2])
    area = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    boxes, labels = boxes[area], np.flatnonzero(area)
    masks = np.zeros((len(boxes), h, w), bool)
    for k, (x0, y0, x1, y1) in enumerate(boxes.astype(int)):
        masks[k, y0:y1, x0:x1] = True
    up = np.stack([geo.orient_image(m, orientation) for m in masks]) if len(masks) else masks
    ob = geo.orient(boxes, orientation, w, h)
    uw, uh = geo.upright_size(orientation, w, h)
    top, left = min(top, uh - 1), min(left, uw - 1)
    ch, cw = min(ch, uh - top), min(cw, uw - left)
    b, lab = geo.crop(ob, labels, top, left, ch, cw)
    window = up[:, top:top + ch, left:left + cw]
    visible = [k for k in range(len(boxes)) if window[k].any()]
    assert lab.tolist() == [int(labels[k]) for k in visible]
    for got, k in zip(b.tolist(), visible):
        assert got == _mask_box(window[k])
