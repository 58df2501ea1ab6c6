"""One input made into the sample to store: a source image file or a packed sample
becomes a :class:`Packed` (kept as found, or decoded, turned upright, resized and
encoded as the target asks) or a :class:`Skipped` (left out, and why).

Runs in the worker processes; nothing here writes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from packio import decode as dec
from packio import geometry as geo
from packio import limits
from packio.errors import DatasetReplacedError, PackioError, RemoteError
from packio.formats.reader import Reader
from packio.sample import Sample, checksum, text_key, unstorable
from packio.sources import SourceItem, boxes_to_stored_frame, read_image_file

__all__ = ["Prep", "Packed", "Skipped", "Result", "REORIENTED", "ENLARGED", "enlarges", "prepare_file", "prepare_packed"]

REORIENTED = "EXIF-rotated image stored upright (pixels and boxes turned, re-encoded)"
ENLARGED = "image smaller than the resize asks, enlarged (stored with more pixels than it has)"


@dataclass(frozen=True)
class Prep:
    """What each worker needs to turn one input into a stored Sample."""

    payload: str  # target format's payload kind: "encoded", "raw" or "bmp"
    resize: dec.ResizeSpec
    quality: int
    max_pixels: int
    reader: Reader | None = None  # set when the source is a packed dataset
    encode: str = "keep"  # "keep" or the encoding every stored image gets
    shape: tuple[int, int] | None = None  # (h, w) every stored image must have
    check: str = "auto"  # see convert(); "auto": images decoded anyway are decoded strictly


@dataclass(frozen=True)
class Packed:
    """An input made into the sample to store."""

    sample: Sample
    found: str  # the encoding the input had ("raw": pixels)
    kept: bool  # its bytes are stored as found (else decoded, and re-encoded unless stored raw)
    where: str  # the input, for messages
    notes: tuple[str, ...] = ()  # facts for the summary, e.g. REORIENTED

    @property
    def done(self) -> str:
        """What was done to the image, as the manifest counts it: "jpeg kept", "bmp→jpeg"."""
        return f"{self.found} kept" if self.kept else f"{self.found}→{self.sample.encoding}"


@dataclass(frozen=True)
class Skipped:
    """An input left out, and why."""

    reason: str  # what the summary counts, e.g. "corrupt image data"
    where: str  # the input, with the detail


Result = Packed | Skipped


def _native_errors() -> tuple[type[BaseException], ...]:
    """What OpenCV, simplejpeg and numpy raise on an image they cannot handle."""
    return (ValueError, MemoryError, RuntimeError, OverflowError, dec._cv2().error)


def _target_encoding(prep: Prep, found: str) -> str:
    """The stored encoding: the target's only one, else what was asked, else the one found
    (raw pixels into an encoded format: lossless PNG, said in the summary)."""
    if prep.payload in ("raw", "bmp"):
        return prep.payload
    if prep.encode != "keep":
        return prep.encode
    return "png" if found == "raw" else found


def _finish(prep: Prep, s: Sample, where: str, orientation: int | None = None) -> Result:
    """Keep the sample's bytes when the target stores them as they are; otherwise decode,
    resize and encode it as the target asks.

    Stored images are always upright: an EXIF orientation is applied here to the
    pixels and the boxes together (``s.boxes`` are in the frame of ``s.payload`` as
    stored), and the image re-encoded even when it would otherwise be kept as found."""
    if orientation is None:
        orientation = 1 if isinstance(s.payload, np.ndarray) else dec.exif_orientation(s.payload)
    found = s.encoding
    to = _target_encoding(prep, found)
    if orientation == 1 and not prep.resize.active and to == found and (
            prep.shape is None or (s.height, s.width) == prep.shape):
        if prep.check == "decode" and not isinstance(s.payload, np.ndarray):
            try:
                dec.check_decode(s.payload)
            except _native_errors() as exc:
                return Skipped("corrupt image data", f"{where} ({exc})")
        return _storable(Packed(s, found, True, where))
    if isinstance(s.payload, np.ndarray):
        img = s.payload
    else:
        try:  # pixels as stored; the orientation is applied below, with the boxes
            img = dec.decode(s.payload, strict=prep.check != "header", max_pixels=prep.max_pixels)
        except _native_errors() as exc:
            return Skipped("corrupt image data", f"{where} ({exc})")
    if prep.resize.active and (why := dec.output_problem(prep.resize, *img.shape[:2], to, prep.max_pixels)):
        return Skipped("resize target too large", f"{where} ({why})")
    boxes, box_labels = s.boxes, s.box_labels
    try:
        if orientation != 1:
            boxes = geo.orient(boxes, orientation, img.shape[1], img.shape[0])
            img = np.ascontiguousarray(geo.orient_image(img, orientation))
        enlarged = prep.resize.active and enlarges(prep.resize, *img.shape[:2])
        if prep.resize.active:
            img, boxes, box_labels = dec.apply_spec(img, boxes, box_labels, prep.resize)
        if prep.shape is not None and img.shape[:2] != prep.shape:
            return Skipped("image shape differs from the dataset's fixed shape", f"{where} ({img.shape[1]}x{img.shape[0]})")
        # only turned upright (same encoding, no resize): a lossy source is re-encoded at high quality
        quality = max(prep.quality, 95) if to == found and not prep.resize.active else prep.quality
        payload = img if to == "raw" else dec.encode(img, to, quality)
    except _native_errors() as exc:
        return Skipped("cannot resize or encode", f"{where} ({type(exc).__name__}: {exc})")
    meta = dict(s.meta, exif_orientation=orientation) if orientation != 1 else s.meta
    out = Sample(key=s.key, payload=payload, encoding=to, label=s.label, boxes=boxes,
                 box_labels=box_labels, width=img.shape[1], height=img.shape[0], meta=meta)
    out.checksum = checksum(out.payload)
    notes = ((REORIENTED,) if orientation != 1 else ()) + ((ENLARGED,) if enlarged else ())
    return _storable(Packed(out, found, False, where, notes))


def enlarges(spec: dec.ResizeSpec, h: int, w: int) -> bool:
    """Whether ``spec`` scales an ``h``×``w`` image up (before any crop): more pixels, no detail."""
    th, tw = spec.target(h, w)
    return th * tw > h * w


def _storable(p: Packed) -> Result:
    """``p``, or a skip when a reader would refuse what it stores."""
    problem = unstorable(p.sample)
    if problem is not None:
        return Skipped(problem[0], f"{p.where} ({problem[1]})")
    return p


def prepare_file(prep: Prep, item: SourceItem) -> Result:
    data, reason, detail = read_image_file(item.path, limits.MAX_INPUT_BYTES)
    if data is None:
        return Skipped(reason, f"{item.path} ({detail})" if detail else item.path)
    enc = dec.sniff(data)
    try:
        w, h = dec.image_size(data, enc)
    except Exception as exc:  # header parsers raise many types on garbage
        return Skipped("corrupt image header", f"{item.path} ({exc})")
    if w <= 0 or h <= 0 or w * h > prep.max_pixels:
        return Skipped("image too large (decompression bomb guard)", f"{item.path} ({w}x{h})")
    if enc == "jpeg" and b"\xff\xd9" not in data[-4096:]:
        return Skipped("truncated JPEG (no end marker)", item.path)
    orientation = dec.exif_orientation(data)
    placed = boxes_to_stored_frame(item, w, h, orientation)
    if isinstance(placed, str):
        return Skipped("CSV width/height fit neither the image nor its EXIF-upright view", f"{item.path} ({placed})")
    boxes, notes = placed
    s = Sample(key=text_key(item.key), payload=data, encoding=enc, label=item.label, boxes=boxes,
               box_labels=np.asarray(item.box_labels, np.int64), width=w, height=h)
    s.checksum = checksum(data)
    out = _finish(prep, s, item.path, orientation)
    return dataclasses.replace(out, notes=(*out.notes, *filter(None, notes))) if isinstance(out, Packed) else out


def prepare_packed(prep: Prep, index: int) -> Result:
    assert prep.reader is not None
    try:
        s = prep.reader.read(index)
    except (DatasetReplacedError, RemoteError):
        raise  # not one bad sample: the source changed or cannot be read, so the conversion stops, nothing committed
    except PackioError as exc:
        return Skipped("corrupt sample in the source dataset", f"#{index} ({exc})")
    if s.checksum and checksum(s.payload) != s.checksum:  # never launder damage into a fresh checksum
        return Skipped("corrupt sample in the source dataset", f"#{index} {s.key} (checksum mismatch)")
    s.key = text_key(s.key)  # a stranger's record may hold a lone surrogate: stored as \xNN text
    return _finish(prep, s, s.key)
