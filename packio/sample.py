"""The one sample schema shared by every format, and its stored record.

A stored sample is a *payload* (encoded image bytes, or a ``uint8`` HWC array for
pre-resized raw formats) plus a *record*: a small dict of plain JSON/msgpack types
(never pickle) that every format stores next to the payload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from packio import limits
from packio.errors import CorruptSampleError

__all__ = ["ENCODINGS", "EXTENSIONS", "checksum", "is_coord", "Sample", "sample_from_record", "text_key",
           "unstorable"]

ENCODINGS = ("jpeg", "png", "bmp", "webp", "raw")
EXTENSIONS = {"jpeg": "jpg", "png": "png", "bmp": "bmp", "webp": "webp", "raw": "npy"}


def checksum(payload: bytes | memoryview | np.ndarray) -> str:
    """Hex xxh3-64 of the payload bytes (for arrays: their C-order bytes).

    xxh3 rather than blake2b: this guards against corruption, not tampering, and
    blake2b hashing was a fifth of the packing time in a profile."""
    import xxhash

    if isinstance(payload, np.ndarray):
        payload = np.ascontiguousarray(payload).data
    return xxhash.xxh3_64_hexdigest(payload)


def text_key(name: str) -> str:
    """A name as a stored key: text. Bytes that are not UTF-8 (which Python keeps as lone
    surrogates: a tar member's name, a hostile record's key) become ``\\xNN`` escapes, as
    no codec, printer or C library takes a lone surrogate."""
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:  # a byte kept by surrogateescape: \xNN; any other lone surrogate: \uNNNN
        return "".join(c if not 0xD800 <= ord(c) <= 0xDFFF else f"\\x{ord(c) - 0xDC00:02x}"
                       if ord(c) >= 0xDC80 else f"\\u{ord(c):04x}" for c in name)


@dataclass
class Sample:
    """One image with its annotations.

    ``boxes`` are ``float32[N, 4]`` in ``xmin, ymin, xmax, ymax`` pixels of the
    stored image; ``box_labels`` are class indices into the manifest's ``classes``.
    ``label`` is the image's class index, ``-1`` when it has none.
    """

    key: str
    payload: bytes | np.ndarray
    encoding: str
    label: int = -1
    boxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.float32))
    box_labels: np.ndarray = field(default_factory=lambda: np.zeros((0,), np.int64))
    width: int = 0
    height: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    checksum: str = ""

    def record(self) -> dict[str, Any]:
        """The stored record: plain types only, valid as JSON and msgpack."""
        rec: dict[str, Any] = {
            "key": self.key,
            "encoding": self.encoding,
            "label": int(self.label),
            "boxes": np.asarray(self.boxes, np.float32).reshape(-1, 4).tolist(),
            "box_labels": [int(v) for v in self.box_labels],
            "width": int(self.width),
            "height": int(self.height),
            "checksum": self.checksum or checksum(self.payload),
        }
        if self.meta:
            rec["meta"] = self.meta
        return rec


def _fail(rec: Any, reason: str) -> CorruptSampleError:
    key = rec.get("key", "?") if isinstance(rec, dict) else "?"
    return CorruptSampleError(str(key), f"bad record: {reason}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_F32_MAX = float(np.finfo(np.float32).max)


def is_coord(v: Any) -> bool:
    """A number a float32 box can hold: finite, not overflowing to inf."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) <= _F32_MAX


def _check_boxes(rec: dict[str, Any], boxes: Any, box_labels: Any) -> None:
    """Raise unless ``boxes`` is a list of [x0, y0, x1, y1] float32-range numbers and
    ``box_labels`` a list of as many -1-or-int64 indices. ``type(v) is int`` (not
    isinstance): a bool is no coordinate, and decoded records hold plain ints and floats."""
    if type(boxes) is not list or type(box_labels) is not list:
        raise _fail(rec, "'boxes' / 'box_labels' are not lists")
    if len(boxes) != len(box_labels):
        raise _fail(rec, f"{len(boxes)} boxes but {len(box_labels)} box labels")
    if len(boxes) > limits.MAX_BOXES:
        raise _fail(rec, f"{len(boxes)} boxes, over packio's limit of {limits.MAX_BOXES}")
    top, hi = _F32_MAX, limits.INT64_MAX
    for b in boxes:
        if type(b) is not list or len(b) != 4:
            raise _fail(rec, f"box {b!r} is not four finite float32 numbers")
        for v in b:  # a plain loop: a generator per box cost as much as the rest of the record
            # -top <= v <= top is False for nan and inf as well
            if not ((type(v) is float or type(v) is int) and -top <= v <= top) and not is_coord(v):
                raise _fail(rec, f"box {b!r} is not four finite float32 numbers")
    for v in box_labels:
        if (type(v) is not int and not _is_int(v)) or not -1 <= v <= hi:
            raise _fail(rec, "'box_labels' holds something other than -1 or an int64 class index")


_NO_BOXES = np.zeros((0, 4), np.float32)
_NO_BOX_LABELS = np.zeros(0, np.int64)


def sample_from_record(rec: Any, payload: bytes | np.ndarray) -> Sample:
    """Validate a stored record (from an untrusted file) and build the Sample.

    Written for speed (it runs once per sample read, and cost more than the JPEG decode
    of a 64 px image): plain ``type`` checks first (the slower ``isinstance`` only for
    what fails them), one pass over the boxes, no numpy call for a sample without boxes."""
    if type(rec) is not dict and not isinstance(rec, dict):
        raise _fail(rec, f"expected a map, found {type(rec).__name__}")
    get = rec.get
    key, encoding, label, w, h = get("key"), get("encoding"), get("label"), get("width"), get("height")
    if type(key) is not str and not isinstance(key, str):
        raise _fail(rec, "'key' is not a string")
    if encoding not in ENCODINGS:
        raise _fail(rec, f"unknown encoding {encoding!r}")
    if type(label) is not int or type(w) is not int or type(h) is not int:
        for name, v in (("label", label), ("width", w), ("height", h)):
            if not _is_int(v):
                raise _fail(rec, f"{name!r} is not an integer")
    if not -1 <= label <= limits.INT64_MAX:
        raise _fail(rec, f"label {label} is neither -1 (none) nor a class index in int64")
    if not (0 <= w < 1 << 31 and 0 <= h < 1 << 31):
        raise _fail(rec, f"size {w}x{h} is negative or out of range")
    boxes, box_labels = get("boxes"), get("box_labels")
    _check_boxes(rec, boxes, box_labels)
    meta, digest = get("meta", {}), get("checksum", "")
    if type(meta) is not dict and not isinstance(meta, dict):
        raise _fail(rec, "'meta' is not a map")
    if type(digest) is not str and not isinstance(digest, str):
        raise _fail(rec, "'checksum' is not a string")
    if boxes:
        arr, labels = np.array(boxes, np.float32), np.array(box_labels, np.int64)
    else:  # fresh arrays: a batch handed out never shares memory with another
        arr, labels = _NO_BOXES.copy(), _NO_BOX_LABELS.copy()
    return Sample(key, payload, encoding, label, arr, labels, w, h, meta, digest)


def unstorable(sample: Sample) -> tuple[str, str] | None:
    """(reason, detail) when a sample would pack but not read back (the readers would
    refuse it), else None. The converter skips and counts such samples by reason."""
    if len(sample.boxes) > limits.MAX_BOXES:
        return "too many boxes", f"{len(sample.boxes)}, packio's limit is {limits.MAX_BOXES}"
    size = sample.payload.nbytes if isinstance(sample.payload, np.ndarray) else len(sample.payload)
    if size > limits.MAX_PAYLOAD_BYTES:
        return "image data too large", f"{size} bytes, packio's limit is {limits.MAX_PAYLOAD_BYTES}"
    try:
        rec = sample.record()
        sample_from_record(rec, sample.payload)
    except (CorruptSampleError, OverflowError, ValueError) as exc:
        return "annotations out of range", str(getattr(exc, "reason", exc)).removeprefix("bad record: ")
    import json

    import msgpack

    # Both codecs: tar keeps records as JSON, and a dataset should convert to every format.
    try:
        size = max(len(msgpack.packb(rec, use_bin_type=True)), len(json.dumps(rec, separators=(",", ":")).encode()))
    except UnicodeEncodeError as exc:  # a lone surrogate in a source record's text (its meta)
        return "record text is not UTF-8", str(exc)
    if size > limits.MAX_RECORD_BYTES:
        return "record too large", f"{size} bytes, packio's limit is {limits.MAX_RECORD_BYTES}"
    return None
