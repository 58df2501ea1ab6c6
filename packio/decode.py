"""CPU image decode and resize.

JPEG goes through ``simplejpeg`` (a wheel that bundles libjpeg-turbo), or through
PyTurboJPEG when asked and its system library is found; everything else, and any
JPEG those reject, through OpenCV, then PIL as the last fallback.
"""

from __future__ import annotations

import ctypes
import functools
import io
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import numpy as np

from packio import geometry as geo
from packio import limits

__all__ = ["MAX_PIXELS", "OUT_SLACK", "out_offset", "pixel_room", "sniff", "image_size", "check_pixels", "jpeg_segments", "exif_orientation", "stored_hw", "available_backends",
           "CorruptImageError", "decode", "check_decode", "output_problem", "ResizeSpec", "resize", "apply_spec",
           "encode", "dct_factor", "turbojpeg3", "decode_window", "Placed", "place"]

MAX_PIXELS = limits.MAX_PIXELS  # the default; packio.limits.MAX_PIXELS is read at call time

# libjpeg-turbo's SIMD colour conversion writes its output with non-temporal stores
# (``movntdq``, past the caches) when the output is 32-byte aligned (AVX2; 16 for SSE2),
# and with plain stores otherwise. Measured here (tools/read_cpu.py's 64 px JPEGs,
# same instructions counted by valgrind either way): a 64 px decode costs 12 us into
# memory at 16 mod 32 and 23-32 us into 32-aligned memory (torch's 64-aligned batch
# buffers, and half of numpy's 16-aligned arrays); 224 px: 107 against 158 us. So an
# image is decoded into memory that starts 16 bytes past a 32-byte boundary.
OUT_SLACK = 32  # bytes allocated beyond the pixels, to place them at 16 mod 32


def out_offset(address: int) -> int:
    """Bytes to skip from ``address`` so the pixels start at 16 mod 32 (see ``OUT_SLACK``)."""
    return (16 - address) % 32


_addressof, _c_char = ctypes.addressof, ctypes.c_char


def pixel_room(h: int, w: int) -> np.ndarray:
    """A fresh ``uint8[h, w, 3]`` for an image to be decoded into, placed at 16 mod 32
    (``OUT_SLACK``): libjpeg-turbo then writes it through the caches."""
    n = h * w * 3
    raw = np.empty(n + OUT_SLACK, np.uint8)
    at = out_offset(_addressof(_c_char.from_buffer(raw)))
    return raw[at:at + n].reshape(h, w, 3)


def sniff(data: bytes | memoryview) -> str | None:
    """Image encoding from the first bytes (never from the file name)."""
    head = bytes(data[:12])
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if head[:2] == b"BM":
        return "bmp"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    return None


def image_size(data: bytes | memoryview, encoding: str) -> tuple[int, int]:
    """(width, height) from the header alone. Raises ValueError when unreadable.

    PNG and BMP keep their size at fixed places (read here: cheap enough for every
    read of the bmp format); WebP goes through PIL, whose global pixel limit is left
    as the user set it (PIL raises its DecompressionBombError past twice that)."""
    if encoding == "jpeg":
        import simplejpeg

        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
        return int(w), int(h)
    head = bytes(data[:32])
    if encoding == "png":
        if len(head) < 24 or head[12:16] != b"IHDR":
            raise ValueError("PNG without an IHDR header")
        return struct.unpack(">II", head[16:24])
    if encoding == "bmp":
        if len(head) < 26:
            raise ValueError("BMP header is truncated")
        if struct.unpack_from("<I", head, 14)[0] == 12:  # OS/2 BITMAPCOREHEADER
            return struct.unpack_from("<HH", head, 18)
        w, h = struct.unpack_from("<ii", head, 18)
        return w, abs(h)  # a negative height means rows stored top-down
    from PIL import Image

    try:
        with Image.open(io.BytesIO(bytes(data))) as im:
            return im.size
    except Exception as exc:  # PIL raises many types on garbage, and DecompressionBombError
        raise ValueError(f"unreadable {encoding} header ({exc})") from None


def check_pixels(w: int, h: int, max_pixels: int | None = None) -> None:
    """ValueError when an image of w x h would be empty or over the pixel limit."""
    limit = limits.MAX_PIXELS if max_pixels is None else max_pixels
    if w <= 0 or h <= 0 or w * h > limit:
        raise ValueError(f"image of {w}x{h} pixels is empty or over packio's limit of {limit} "
                         f"(packio.limits.MAX_PIXELS)")


def jpeg_segments(data: bytes | memoryview) -> Iterator[tuple[int, int, int]]:
    """``(marker, offset, length)`` of each header segment of a JPEG, in order, up to its
    first scan; stops quietly at anything that is not a well-formed segment. ``offset`` is
    where the segment's 0xFF is; ``length`` its length field. Bounded by ``len(data)``."""
    b = memoryview(data).cast("B")
    n = len(b)
    if n < 4 or b[0] != 0xFF or b[1] != 0xD8:
        return
    i = 2
    while i + 4 <= n:
        if b[i] != 0xFF:
            return
        marker = b[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        if marker in (0xDA, 0xD9):  # start of scan / end of image: no header segments after
            return
        length = (b[i + 2] << 8) | b[i + 3]
        if length < 2:
            return
        yield marker, i, length
        i += 2 + length


def _jpeg_has_exif(data: bytes | memoryview) -> bool:
    """Whether a JPEG's header segments (before its scan data) hold an APP1 Exif block."""
    return any(m == 0xE1 and bytes(data[i + 4:i + 10]) == b"Exif\0\0" for m, i, _ in jpeg_segments(data))


def exif_orientation(data: bytes | memoryview) -> int:
    """The EXIF orientation (1..8) of an encoded image; 1 when it has none or it is unreadable.

    A JPEG without an Exif segment (most of them) costs one walk over its header
    segments, no PIL parse."""
    enc = sniff(data)
    if enc not in ("jpeg", "png", "webp") or (enc == "jpeg" and not _jpeg_has_exif(data)):
        return 1
    from PIL import Image

    try:
        with Image.open(io.BytesIO(bytes(data))) as im:
            o = im.getexif().get(0x0112, 1)
    except Exception:  # a broken EXIF block is no reason to refuse the pixels
        return 1
    return o if isinstance(o, int) and 1 <= o <= 8 else 1


def stored_hw(payload: bytes | memoryview | np.ndarray, encoding: str, width: int, height: int) -> tuple[int, int]:
    """(h, w) of a stored image: from its record, else its array, else its header.

    Boxes scale from this size, never from a decoded shape: a read-time decode may
    use DCT downscaling (``decode(min_size=...)``). Raises ValueError when unreadable."""
    if width > 0 and height > 0:
        return height, width
    if isinstance(payload, np.ndarray):
        return int(payload.shape[0]), int(payload.shape[1])
    w, h = image_size(bytes(payload), sniff(payload) or encoding)
    return h, w


@functools.lru_cache(maxsize=1)
def _cv2() -> Any:
    """OpenCV, with its own thread pool turned off on first use in each process.

    packio parallelises over processes and its own decode threads; OpenCV's pool
    on top oversubscribes the cores, and a process forked after that pool started
    can deadlock in OpenCV (seen here: a DataLoader/Pool worker hanging in
    cv2.setNumThreads). This is the one process-wide setting packio changes, and
    only when it first decodes or resizes."""
    import cv2

    cv2.setNumThreads(1)
    return cv2


@functools.lru_cache(maxsize=1)
def _turbojpeg() -> Any:
    """PyTurboJPEG handle, or None when the package or its system library is absent."""
    try:
        from turbojpeg import TurboJPEG

        return TurboJPEG()
    except Exception:  # ImportError, or OSError/RuntimeError when the .so is missing
        return None


def available_backends() -> list[str]:
    out = ["simplejpeg", "cv2", "pil"]
    if _turbojpeg() is not None:
        out.insert(1, "turbojpeg")
    return out


def _as_rgb3(img: np.ndarray) -> np.ndarray:
    if img.ndim == 2:
        img = img[:, :, None]
    if img.shape[2] == 1:
        return np.repeat(img, 3, axis=2)
    if img.shape[2] == 4:
        return np.ascontiguousarray(img[:, :, :3])
    return img


def _cv2_decode(data: bytes | memoryview, apply_exif: bool, out: np.ndarray | None = None) -> np.ndarray:
    """RGB pixels by OpenCV; into ``out`` when the image has its shape (the BGR→RGB pass writes there)."""
    cv2 = _cv2()

    flags = cv2.IMREAD_COLOR if apply_exif else cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION
    img = cv2.imdecode(np.frombuffer(data, np.uint8), flags)
    if img is None:
        raise ValueError("OpenCV could not decode the image")
    if out is not None and out.shape == img.shape and out.flags.c_contiguous:
        return cv2.cvtColor(img, cv2.COLOR_BGR2RGB, dst=out)
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


def _pil_decode(data: bytes | memoryview, apply_exif: bool) -> np.ndarray:
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(bytes(data))) as im:
        if apply_exif:
            im = ImageOps.exif_transpose(im)
        return np.asarray(im.convert("RGB"))


class CorruptImageError(ValueError):
    """The image decodes only with warnings (libjpeg's "Corrupt JPEG data": garbage
    entropy data, a truncated scan): the pixels are partly made up."""


def _simplejpeg(data: bytes | memoryview, strict: bool, kw: dict[str, Any]) -> np.ndarray:
    import simplejpeg

    try:
        return simplejpeg.decode_jpeg(data, strict=True, **kw)
    except ValueError as exc:
        if not strict:
            raise
        try:  # decodes when lenient: libjpeg only warned, which strict treats as damage
            simplejpeg.decode_jpeg(data, strict=False, **kw)
        except ValueError:
            raise exc from None  # a hard failure: the next backend may read it
        raise CorruptImageError(f"corrupt JPEG data ({exc})") from None


JPEG_ONLY = ("simplejpeg", "turbojpeg")  # backends that read JPEG alone


def decode(data: bytes | memoryview, *, backend: str = "auto", min_size: tuple[int, int] | None = None,
           apply_exif: bool = False, strict: bool = False, max_pixels: int | None = None,
           out: np.ndarray | None = None) -> np.ndarray:
    """Decode to ``uint8[H, W, 3]`` RGB (grayscale and CMYK become RGB).

    ``min_size=(h, w)`` lets libjpeg-turbo decode at 1/2, 1/4 or 1/8 scale when the
    result still covers it (other DCT scales are slower than a full decode).
    ``apply_exif`` rotates by the EXIF orientation (OpenCV / PIL path).
    The header's size is checked against ``max_pixels`` (default
    ``packio.limits.MAX_PIXELS``) before anything is decoded. ``strict``: a JPEG that
    libjpeg decodes only with warnings raises ``CorruptImageError`` instead of
    falling back to a lenient decoder (which would return made-up pixels).
    ``out``: a C-contiguous ``uint8[h, w, 3]`` array to decode into; the result is ``out``
    itself when the image has its shape, else an array of its own. A JPEG goes straight
    into ``out`` with no separate header check when ``out`` is within ``max_pixels``
    (simplejpeg refuses an image larger than ``out``, so ``out`` bounds it); a larger
    ``out`` does not lift the limit: the header is checked first.
    Raises ``ValueError`` when no backend can decode the bytes.
    """
    if out is not None and out.dtype == np.uint8 and data[:3] == b"\xff\xd8\xff" \
            and backend in ("auto", "simplejpeg") and min_size is None and not apply_exif:
        # a JPEG (sniff's test, without its copy); simplejpeg writes bytes into any buffer,
        # so an ``out`` of another dtype would come back as those bytes reinterpreted
        if out.size // 3 > (limits.MAX_PIXELS if max_pixels is None else max_pixels):
            check_pixels(*image_size(data, "jpeg"), max_pixels)  # ``out`` allows more than the limit
        got = _simplejpeg_into(data, strict, out)
        if got is not None:
            return got
    enc = sniff(data)
    if enc not in ("jpeg", "png", "bmp", "webp"):
        raise ValueError(f"not a JPEG, PNG, BMP or WebP image ({enc or 'unknown type'})")
    check_pixels(*image_size(data, enc), max_pixels)
    order = [backend] if backend != "auto" else ["simplejpeg", "cv2", "pil"]
    if enc != "jpeg" and backend in ("auto", *JPEG_ONLY):
        order = ["cv2", "pil"]  # a JPEG-only backend asked for: PNG / WebP / BMP samples still need a reader
    if apply_exif and enc == "jpeg" and backend == "auto":
        order = ["cv2", "pil"]  # simplejpeg does not read EXIF orientation
        if strict:
            _simplejpeg(data, True, {"min_factor": 8})  # the lenient decoders below cannot tell damage
    img = _first_decoded(data, order, min_size, apply_exif, strict, out)
    if out is None or img is out or img.shape != out.shape:
        return img
    np.copyto(out, img)
    return out


def _simplejpeg_into(data: bytes | memoryview, strict: bool, out: np.ndarray) -> np.ndarray | None:
    """A JPEG decoded into ``out``: ``out`` itself, or a copy of the smaller image simplejpeg
    put at its start; None when simplejpeg cannot (an image larger than ``out``, a JPEG it
    does not read), for the checked path to decide."""
    try:
        img = _simplejpeg(data, strict, {"buffer": out})
    except CorruptImageError:
        raise
    except ValueError:
        return None
    return out if img.shape == out.shape else img.copy()


def _first_decoded(data: bytes | memoryview, order: list[str], min_size: tuple[int, int] | None,
                   apply_exif: bool, strict: bool, out: np.ndarray | None) -> np.ndarray:
    """The pixels from the first backend in ``order`` that decodes ``data`` (header checked)."""
    errors: list[str] = []
    for name in order:
        try:
            if name == "simplejpeg":
                kw: dict[str, Any] = {}
                if min_size is not None:
                    kw = {"min_height": min_size[0], "min_width": min_size[1], "min_factor": 2}
                return _simplejpeg(data, strict, kw)
            if name == "turbojpeg":
                tj = _turbojpeg()
                if tj is None:
                    raise ValueError("PyTurboJPEG's system library libturbojpeg was not found")
                from turbojpeg import TJPF_RGB

                return _as_rgb3(tj.decode(bytes(data), pixel_format=TJPF_RGB))
            if name == "cv2":
                return _cv2_decode(data, apply_exif, out)
            if name == "pil":
                return _pil_decode(data, apply_exif)
            raise ValueError(f"unknown decode backend {name!r}; use one of {available_backends()}")
        except CorruptImageError:
            raise
        except Exception as exc:  # try the next backend, report all if none works
            errors.append(f"{name}: {exc}")
    raise ValueError("; ".join(errors) or "cannot decode")


def check_decode(data: bytes | memoryview) -> None:
    """Decode the whole image, strictly; raise ValueError (``CorruptImageError`` for
    libjpeg's warnings) when it is damaged. A JPEG is decoded at 1/8 scale: all of
    its entropy-coded data is still read, which is where damage shows. That saves
    little (0.8-1.0x a full decode in tools/convert.py check): the entropy
    decoding is most of the cost."""
    if sniff(data) == "jpeg":
        try:
            _simplejpeg(data, True, {"min_factor": 8})
            return
        except CorruptImageError:
            raise
        except ValueError:
            pass  # a JPEG simplejpeg cannot read (e.g. 12-bit): the full decoders below
    decode(data, strict=True)


def output_problem(spec: "ResizeSpec", h: int, w: int, encoding: str, max_pixels: int | None = None) -> str | None:
    """Why resizing an h x w image by ``spec`` and encoding it as ``encoding`` would
    blow up (checked before any pixel is allocated), or None."""
    limit = limits.MAX_PIXELS if max_pixels is None else max_pixels
    th, tw = spec.target(h, w)
    if th * tw > limit:
        return f"resize target {tw}x{th} is over packio's limit of {limit} pixels"
    oh, ow = spec.crop or (th, tw)
    if encoding == "jpeg" and max(oh, ow) > limits.MAX_JPEG_SIDE:
        return f"output {ow}x{oh} is over JPEG's limit of {limits.MAX_JPEG_SIDE} pixels a side"
    return None


@dataclass(frozen=True)
class ResizeSpec:
    """Pre-resize geometry: a fixed ``size=(h, w)``, or ``short_side`` keeping aspect,
    optionally followed by a center crop to ``crop=(h, w)``."""

    size: tuple[int, int] | None = None
    short_side: int | None = None
    crop: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.size is not None and self.short_side is not None:
            raise ValueError("give either a fixed size or a short side, not both")
        for name in ("size", "crop"):  # a list or numpy ints are fine; stored as (h, w) of ints
            object.__setattr__(self, name, _pair(name, getattr(self, name)))
        if self.short_side is not None:
            object.__setattr__(self, "short_side", _positive("short_side", self.short_side))

    @property
    def active(self) -> bool:
        return self.size is not None or self.short_side is not None or self.crop is not None

    @property
    def fixed_shape(self) -> tuple[int, int] | None:
        """(h, w) every output has, or None when it depends on the input."""
        return self.crop or self.size

    def target(self, h: int, w: int) -> tuple[int, int]:
        if self.size is not None:
            return self.size
        if self.short_side is not None:
            return geo.short_side_size(h, w, self.short_side)
        return h, w

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size and list(self.size), "short_side": self.short_side,
                "crop": self.crop and list(self.crop)}


def _positive(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError(f"ResizeSpec {name} must be a positive int, not {v!r}")
    return int(v)


def _pair(name: str, v: Any) -> tuple[int, int] | None:
    """``v`` as (h, w): a tuple or list of two positive ints, or None."""
    if v is None:
        return None
    if isinstance(v, (str, bytes)) or not isinstance(v, (tuple, list)) or len(v) != 2:
        raise ValueError(f"ResizeSpec {name} must be (height, width), two positive ints, not {v!r}")
    return _positive(name, v[0]), _positive(name, v[1])


def resize(img: np.ndarray, hw: tuple[int, int], best: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """Resize to ``hw=(h, w)``.

    Default (read time): halve with a 2x2 box filter while the image is at least
    twice the target, then bilinear: antialiased by powers of two, and several times
    faster than OpenCV's INTER_AREA at non-integer ratios (tools/loader.py levers),
    which would otherwise cost as much as the JPEG decode.
    ``best=True`` (pack time): INTER_AREA when shrinking, INTER_LINEAR when growing.
    ``out``: write the result there (a ``uint8[h, w, 3]`` slot of a batch buffer).
    """
    cv2 = _cv2()

    h, w = hw
    h0, w0 = img.shape[:2]
    if (h0, w0) == (h, w):
        if out is not None:
            np.copyto(out, img)
            return out
        return img
    if best:
        shrink = h * w < h0 * w0
        return cv2.resize(img, (w, h), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
    while h0 >= 2 * h and w0 >= 2 * w:
        img = cv2.resize(img, (w0 // 2, h0 // 2), interpolation=cv2.INTER_AREA)
        h0, w0 = img.shape[:2]
    if out is not None:
        cv2.resize(img, (w, h), dst=out, interpolation=cv2.INTER_LINEAR)
        return out
    return cv2.resize(img, (w, h), interpolation=cv2.INTER_LINEAR)


def apply_spec(img: np.ndarray, boxes: np.ndarray, box_labels: np.ndarray,
               spec: ResizeSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Resize/crop ``img`` by ``spec``; boxes follow by :mod:`packio.geometry`'s rules.

    Returns (image, boxes, box_labels): boxes the center crop leaves no overlap
    with are dropped together with their labels; the others are clipped to it.
    """
    h0, w0 = img.shape[:2]
    th, tw = spec.target(h0, w0)
    out = resize(img, (th, tw), best=True)
    b = geo.resize(boxes, (h0, w0), (th, tw))
    labels = geo.as_labels(box_labels, len(b))
    if spec.crop is not None:
        top, left, ch, cw = geo.center_window(th, tw, *spec.crop)
        out = out[top:top + ch, left:left + cw]
        b, labels = geo.crop(b, labels, top, left, ch, cw)
        if (ch, cw) != spec.crop:  # source smaller than the crop: scale up to it
            out = resize(out, spec.crop, best=True)
            b = geo.resize(b, (ch, cw), spec.crop)
    return np.ascontiguousarray(out), b, labels


def encode(img: np.ndarray, encoding: str, quality: int = 90) -> bytes:
    """Encode RGB ``uint8[H, W, 3]`` as jpeg (simplejpeg), png or bmp (OpenCV)."""
    if encoding == "jpeg":
        import simplejpeg

        return simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=quality, colorsubsampling="420")
    cv2 = _cv2()

    ok, buf = cv2.imencode("." + encoding, cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
    if not ok:
        raise ValueError(f"OpenCV could not encode {encoding}")
    return buf.tobytes()


# --- read-time geometry: a plan's window decoded into its output slot --------------------------

def dct_factor(p: geo.Plan) -> int:
    """The largest DCT downscale (8, 4 or 2; else 1) after which the plan's window still
    covers its output: libjpeg-turbo then does that much of the shrinking while it decodes
    (only these scales are faster than a full decode; tools/w3.py measures the gain)."""
    room = min(p.height / p.out_h, p.width / p.out_w)
    return next((k for k in (8, 4, 2) if k <= room), 1)


def _full(data: bytes | memoryview, p: geo.Plan, backend: str, strict: bool, max_pixels: int | None) -> np.ndarray:
    """The whole image, decoded into memory placed for libjpeg-turbo (see ``OUT_SLACK``)
    when the plan's stored size is a sane claim (the decode checks the header either way)."""
    room = None
    if p.stored_h * p.stored_w <= (limits.MAX_PIXELS if max_pixels is None else max_pixels):
        try:
            room = pixel_room(p.stored_h, p.stored_w)
        except MemoryError:
            pass
    return decode(data, backend=backend, strict=strict, max_pixels=max_pixels, out=room)


def _edges(start: int, length: int, factor: float, size: int) -> tuple[int, int]:
    """A window's [start, start + length) of the stored image in a frame ``factor`` times
    its size (``size`` pixels): edges rounded to the nearest, at least one pixel."""
    a = min(max(0, round(start * factor)), size - 1)
    return a, min(size, max(a + 1, round((start + length) * factor)))


def _fit(view: np.ndarray, p: geo.Plan, out: np.ndarray | None) -> np.ndarray:
    """``view`` resized to the plan's output and mirrored when it says, into ``out`` when
    that is a C-contiguous ``uint8[out_h, out_w, 3]`` array."""
    cv2 = _cv2()
    hw = (p.out_h, p.out_w)
    if out is None or out.shape != (*hw, 3) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        out = pixel_room(*hw)
    if view.shape[:2] == hw and p.flip:
        return cv2.flip(view, 1, dst=out)
    resize(view, hw, out=out)
    if p.flip:
        cv2.flip(out, 1, dst=out)
    return out


# libjpeg-turbo 3's TurboJPEG API decodes a region (``tj3SetCroppingRegion``): the IDCT and
# colour conversion of the window's columns only, and no row below it. Measured (tools/w3.py
# decode, one thread's CPU, RandomResizedCrop 224, busy machine): 1.24x a whole decode + crop on
# ~500x400 synthetic photos, 1.17x on them pre-resized to short side 256, 1.47x (with DCT scaling
# where the window allows) on hymenoptera's real photos (DCT scaling alone: 1.18x there, 1.0x on
# the ~500 px ones); evaluation's center crop (7/8 of each side) gains 0-6 %. The 2.x API
# (Debian 12, Ubuntu 24.04: 2.1.5) has no such call, and no well-kept wheel bundles a 3.x
# libturbojpeg (PyTurboJPEG 2.x is ctypes over the system's; only ``turbojpeg`` 0.0.2, a 2023
# one-author wheel of 3.0 beta, carries one); so it is used where one is
# found (libjpeg-turbo's own packages install to /opt/libjpeg-turbo; Fedora, Arch, Homebrew and
# conda ship 3.x), else the window comes from simplejpeg's whole-image decode. A lossless crop
# first (tjTransform's TJXOPT_CROP, in 2.x too) then a decode of the crop measured 0.61x: the
# transform entropy-decodes the whole image and re-encodes the crop.
_TJ3_PATHS = ("/opt/libjpeg-turbo/lib64/libturbojpeg.so.0", "/opt/libjpeg-turbo/lib/libturbojpeg.so.0",
              "/usr/local/lib/libturbojpeg.so.0", "/usr/local/lib64/libturbojpeg.so.0",
              "/opt/homebrew/opt/jpeg-turbo/lib/libturbojpeg.dylib", "/usr/local/opt/jpeg-turbo/lib/libturbojpeg.dylib")
# iMCU (width, height) per TJSAMP_* (444, 422, 420, gray, 440, 411, 441): a region starts on this grid
_IMCU = {0: (8, 8), 1: (16, 8), 2: (16, 16), 3: (8, 8), 4: (8, 16), 5: (32, 8), 6: (8, 32)}
_TJ_STOPONWARNING, _TJ_SUBSAMP, _TJ_WIDTH, _TJ_HEIGHT, _TJ_PRECISION = 0, 4, 5, 6, 7


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


@functools.lru_cache(maxsize=1)
def turbojpeg3() -> Any:
    """libjpeg-turbo's TurboJPEG 3 library (a ``ctypes.CDLL``), or None where there is none.
    Looked for at ``$PACKIO_LIBTURBOJPEG`` (read on first use), where libjpeg-turbo's own
    packages and Homebrew install it, then the system's ``libturbojpeg``."""
    import ctypes.util

    for path in (os.environ.get("PACKIO_LIBTURBOJPEG"), *_TJ3_PATHS, ctypes.util.find_library("turbojpeg")):
        try:
            lib = ctypes.CDLL(path) if path else None
            lib.tj3SetCroppingRegion  # noqa: B018  (absent from a 2.x library)
        except (OSError, AttributeError):
            continue
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.tj3Init.restype, lib.tj3Init.argtypes = vp, [ctypes.c_int]
        lib.tj3Destroy.argtypes = [vp]
        lib.tj3Set.argtypes, lib.tj3Get.argtypes = [vp, ctypes.c_int, ctypes.c_int], [vp, ctypes.c_int]
        lib.tj3DecompressHeader.argtypes = [vp, ctypes.c_char_p, sz]
        lib.tj3SetCroppingRegion.argtypes = [vp, _Region]
        lib.tj3Decompress8.argtypes = [vp, ctypes.c_char_p, sz, vp, ctypes.c_int, ctypes.c_int]
        return lib
    return None


class _Handle:
    """One thread's TurboJPEG decompressor (a handle is not shared between threads)."""

    def __init__(self, lib: Any) -> None:
        self.lib, self.h = lib, lib.tj3Init(1)  # TJINIT_DECOMPRESS
        if not self.h:
            raise MemoryError("tj3Init failed")

    def __del__(self) -> None:
        try:
            self.lib.tj3Destroy(self.h)
        except Exception:  # at interpreter exit ctypes may be half torn down: the process frees it anyway
            pass


_handles = threading.local()


def _around(a: int, b: int, step: int, size: int) -> tuple[int, int]:
    """[a, b) widened by one iMCU each way (the start on the iMCU grid), within [0, size): the
    chroma upsampling at a region's edges then reads the same neighbours as a whole decode."""
    return max(0, a - step) // step * step, min(size, b + step)


def _region_window(data: bytes | memoryview, p: geo.Plan, strict: bool,
                   max_pixels: int | None) -> np.ndarray | None:
    """The plan's window decoded alone by libjpeg-turbo 3 (pixel for pixel what a whole
    decode holds there), or None where it cannot (no library, a JPEG it does not read, a
    warning when ``strict``): the caller's whole decode then says why."""
    lib = turbojpeg3()
    if lib is None:
        return None
    tj = getattr(_handles, "tj", None)
    if tj is None:
        tj = _handles.tj = _Handle(lib)
    buf = data if isinstance(data, bytes) else bytes(data)  # ctypes passes bytes without a copy
    if lib.tj3DecompressHeader(tj.h, buf, len(buf)) != 0 or lib.tj3Get(tj.h, _TJ_PRECISION) != 8:
        return None
    w, h, step = lib.tj3Get(tj.h, _TJ_WIDTH), lib.tj3Get(tj.h, _TJ_HEIGHT), _IMCU.get(lib.tj3Get(tj.h, _TJ_SUBSAMP))
    check_pixels(w, h, max_pixels)
    if step is None:
        return None
    (y0, y1), (x0, x1) = _edges(p.top, p.height, h / p.stored_h, h), _edges(p.left, p.width, w / p.stored_w, w)
    (ry, ry1), (rx, rx1) = _around(y0, y1, step[1], h), _around(x0, x1, step[0], w)
    room = pixel_room(ry1 - ry, rx1 - rx)
    lib.tj3Set(tj.h, _TJ_STOPONWARNING, int(strict))
    try:
        if lib.tj3SetCroppingRegion(tj.h, _Region(rx, ry, rx1 - rx, ry1 - ry)) != 0 or \
                lib.tj3Decompress8(tj.h, buf, len(buf), room.ctypes.data, room.strides[0], 0) != 0:  # TJPF_RGB
            return None
    finally:
        lib.tj3SetCroppingRegion(tj.h, _Region(0, 0, 0, 0))
    return room[y0 - ry:y1 - ry, x0 - rx:x1 - rx]


def decode_window(data: bytes | memoryview | np.ndarray, p: geo.Plan, out: np.ndarray | None = None, *,
                  backend: str = "auto", strict: bool = False, max_pixels: int | None = None,
                  dct: bool = True, region: bool = True) -> np.ndarray:
    """The plan's window of an encoded image (or of pixels ``uint8[H, W, 3]``), resized to
    the plan's output and mirrored when ``p.flip``: ``uint8[out_h, out_w, 3]``, written
    into ``out`` (and ``out`` returned) when it has that shape.

    A JPEG whose window is at least twice the output (each side) is decoded at a DCT
    scale (``dct_factor``; ``dct=False``: never): the window then moves to that frame
    with its edges rounded to the nearest pixel (half a decoded pixel at most, which is
    under half an output pixel). Otherwise, where libjpeg-turbo 3 is found
    (:func:`turbojpeg3`; ``region=False``: never), only the window is decoded.
    Raises ``ValueError`` as :func:`decode` does."""
    if isinstance(data, np.ndarray):
        img = data
    else:
        k = dct_factor(p) if dct else 1
        if k == 1 and region and backend in ("auto", "turbojpeg") and data[:3] == b"\xff\xd8\xff":
            view = _region_window(data, p, strict, max_pixels)
            if view is not None:
                return _fit(view, p, out)
        if k > 1:
            img = decode(data, backend=backend, min_size=(-(-p.stored_h // k), -(-p.stored_w // k)), strict=strict,
                         max_pixels=max_pixels)
        else:
            img = _full(data, p, backend, strict, max_pixels)
    h, w = img.shape[:2]
    y0, y1 = _edges(p.top, p.height, h / p.stored_h, h)
    x0, x1 = _edges(p.left, p.width, w / p.stored_w, w)
    return _fit(img[y0:y1, x0:x1], p, out)


class Placed(NamedTuple):
    """One sample after read-time geometry."""

    image: np.ndarray  # uint8[out_h, out_w, 3]: ``out`` itself when it had that shape
    boxes: np.ndarray  # float32[N, 4] in the output's pixels
    box_labels: np.ndarray  # int64[N]
    dropped: int  # boxes the crop dropped
    plan: geo.Plan


def place(payload: bytes | memoryview | np.ndarray, encoding: str, width: int, height: int, boxes: np.ndarray,
          box_labels: np.ndarray, recipe: geo.Recipe, seed: int, epoch: int, index: int, *,
          out: np.ndarray | None = None, backend: str = "auto", strict: bool = False,
          max_pixels: int | None = None) -> Placed:
    """One stored sample through ``recipe``: its plan (:func:`packio.geometry.plan` from its
    stored size and ``(seed, epoch, index)``), its window decoded into ``out``
    (:func:`decode_window`) and its boxes moved by the same plan
    (:func:`packio.geometry.plan_boxes`). ``width``/``height``: the stored size its record
    gives (0: read from the payload). Raises ``ValueError`` for an image that does not decode
    or whose size is unreadable."""
    h, w = stored_hw(payload, encoding, width, height)
    p = geo.plan(recipe, h, w, seed, epoch, index)
    img = decode_window(payload, p, out, backend=backend, strict=strict, max_pixels=max_pixels)
    b, lab, dropped = geo.plan_boxes(boxes, box_labels, p, recipe.min_visible)
    return Placed(img, b, lab, dropped, p)
