"""Bounds on what a file may claim, checked before anything is allocated, read or mapped.

Every count, offset, size, shape and nesting depth a reader takes from a file is
checked here against the real size of the file it points into, or against one of
the limits below. The limits are module attributes, read at call time: raise one
(``packio.limits.MAX_PIXELS = ...``) if real data needs more.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from math import prod
from pathlib import Path
from typing import Any, Callable

import numpy as np

from packio.errors import FormatError, PackioError

__all__ = ["MAX_PIXELS", "MAX_JPEG_SIDE", "MAX_INPUT_BYTES", "MAX_PAYLOAD_BYTES", "MAX_RECORD_BYTES", "MAX_BOXES",
           "MAX_MANIFEST_BYTES", "MAX_JSON_DEPTH", "MAX_CLASSES", "MAX_SHARDS", "MAX_PATTERN_CHARS",
           "open_regular", "read_regular", "read_head",
           "file_size", "check_span", "check_count", "json_depth", "loads_json", "load_npy", "MapGuard", "plain_rel"]

MAX_PIXELS = 178_956_970  # one image, decoded or resized (PIL's decompression-bomb error limit)
MAX_JPEG_SIDE = 65_500  # libjpeg-turbo cannot encode a wider or taller JPEG
MAX_INPUT_BYTES = 1 << 30  # one source image file
MAX_PAYLOAD_BYTES = 1 << 30  # one stored image
MAX_RECORD_BYTES = 1 << 24  # one stored record (msgpack, or JSON in tar shards): ~100 bytes plus its boxes
MAX_BOXES = 1 << 20  # boxes per sample (msgpack's array limit on reading)
MAX_MANIFEST_BYTES = 256 << 20  # packio.json, or HDF5's manifest attribute
MAX_JSON_DEPTH = 32  # nesting of any JSON packio parses
MAX_CLASSES = 1 << 20  # class indices a label may take in foreign tar shards
MAX_SHARDS = 100_000  # shards one brace pattern may name (counted before it is expanded)
MAX_PATTERN_CHARS = 4096  # length of one brace pattern
INT64_MAX = (1 << 63) - 1

Error = Callable[[str], PackioError]


def open_regular(path: str | Path, error: Error = FormatError) -> int:
    """A read-only descriptor of a regular file. A FIFO, socket, device or folder is
    refused without blocking (``O_NONBLOCK``: opening a FIFO otherwise waits for a writer).
    The flag stays: it means nothing for a regular file (open(2)), and clearing it cost two
    ``fcntl`` calls per image file the bmp format opens."""
    return _open_regular(path, error)[0]


def _open_regular(path: str | Path, error: Error) -> tuple[int, int]:
    """:func:`open_regular`'s descriptor and the file's size (from its one ``fstat``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        check_descriptors(exc, path)
        raise error(f"{path}: cannot open ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: not a regular file (a FIFO, device, socket or folder); "
                        f"packio reads regular files only: replace it with the real file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def check_descriptors(exc: OSError, path: str | Path) -> None:
    """Raise the error that says so when ``exc`` means this process (or the system)
    has no descriptor left: the file itself is fine, so no format error."""
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        raise PackioError(f"{path}: cannot open: too many open files in this process ({exc.strerror}); raise "
                          f"the limit ('ulimit -n', RLIMIT_NOFILE) or open fewer datasets at once") from None


def read_regular(path: str | Path, max_bytes: int, error: Error = FormatError) -> bytes:
    """The whole of a regular file, refused before reading when it exceeds ``max_bytes``."""
    fd, size = _open_regular(path, error)
    try:
        if size > max_bytes:
            raise error(f"{path}: {size} bytes, over packio's limit of {max_bytes} for this file")
        data = os.read(fd, size + 1)
        # Asked for one byte more than the file holds, a read that returns ``size`` bytes met
        # its end (no second read to see it); a shorter one (NFS, a signal) is continued.
        while len(data) < size and (more := os.read(fd, size + 1 - len(data))):
            data += more
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > size:
        raise error(f"{path}: grew while being read; read it again when nothing writes to it")
    return data


def read_head(path: str | Path, n: int, error: Error = FormatError) -> bytes:
    """The first ``n`` bytes of a regular file (an HDF5 signature, an image header)."""
    fd = open_regular(path, error)
    try:
        return os.pread(fd, n, 0)
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None
    finally:
        os.close(fd)


def file_size(path: str | Path, error: Error = FormatError) -> int:
    """Size of a regular file, by ``stat`` (which never blocks)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: not a regular file (a FIFO, device, socket or folder); packio reads regular files only")
    return st.st_size


def plain_rel(rel: str) -> bool:
    """A relative path a stranger's file names that stays below its folder: no '..', no
    absolute, empty or hidden part, no backslash or NUL."""
    return bool(rel) and "\0" not in rel and "\\" not in rel and all(
        p and not p.startswith(".") for p in rel.split("/"))


def check_span(offset: int, size: int, limit: int, what: str, error: Error = FormatError) -> None:
    """``[offset, offset + size)`` must lie inside ``[0, limit)``."""
    if not (0 <= offset and 0 <= size and offset + size <= limit):
        raise error(f"{what}: bytes {offset}..{offset + size} lie outside the {limit} bytes available")


def check_count(count: int, path: Path, min_bytes: int, error: Error = FormatError) -> None:
    """A manifest's sample count must fit in the file that holds ``min_bytes`` per sample."""
    size = file_size(path, error)
    if count * min_bytes > size:
        raise error(f"{path}: the manifest says {count} samples, but this {size}-byte file holds at most "
                    f"{size // min_bytes}; the manifest is damaged, re-pack the dataset")


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_DEPTH_STEP = np.zeros(256, np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1


def json_depth(data: bytes) -> int:
    """Deepest nesting of ``[``/``{`` in JSON text, ignoring brackets inside strings."""
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH:
        return data.count(b"[") + data.count(b"{")  # an upper bound: enough when it is small
    steps = _DEPTH_STEP[np.frombuffer(_STRINGS.sub(b'""', data), np.uint8)]
    steps = steps[steps != 0].astype(np.int64)
    return int(np.cumsum(steps).max(initial=0))


def loads_json(data: bytes | str, where: str, max_bytes: int, error: Error = FormatError) -> Any:
    """``json.loads`` with a size and a nesting limit (deep nesting would raise
    RecursionError inside the parser, or later in whoever walks the result)."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    if len(data) > max_bytes:
        raise error(f"{where}: {len(data)} bytes of JSON, over packio's limit of {max_bytes}")
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise error(f"{where}: JSON nested {depth} deep, over packio's limit of {MAX_JSON_DEPTH}")
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise error(f"{where}: not valid JSON ({exc})") from None


def load_npy(path: Path, dtype: str, shape: tuple[int | None, ...], *, mmap: bool = False,
             error: Error = FormatError) -> np.ndarray:
    """Load a ``.npy`` written by packio, its header checked first: ``dtype`` (a numpy
    dtype string, or ``"U"`` for any unicode width) and ``shape`` (``None`` = any
    length) must match, and the header's byte count must equal the file's size."""
    fd = open_regular(path, error)
    with os.fdopen(fd, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read_header is None:
                raise ValueError(f".npy version {version} is not 1.0 or 2.0")
            got_shape, fortran, got = read_header(f)
        except Exception as exc:  # numpy raises ValueError, SyntaxError, ... on a bad header
            raise error(f"{path}: not a valid .npy header ({exc}); re-pack the dataset") from None
        want = f"{dtype} of shape ({', '.join('N' if d is None else str(d) for d in shape)})"
        ok_dtype = got.kind == "U" if dtype == "U" else got == np.dtype(dtype)
        if (not ok_dtype or fortran or len(got_shape) != len(shape)
                or any(d is not None and d != g for d, g in zip(shape, got_shape))):
            raise error(f"{path}: holds {got} of shape {got_shape}, which does not match the manifest "
                        f"(expected {want}); re-pack the dataset")
        start, size = f.tell(), os.fstat(fd).st_size
        nbytes = prod(got_shape) * got.itemsize
        if start + nbytes != size:
            raise error(f"{path}: its header claims {nbytes} bytes of data, the file holds {size - start}; "
                        f"the file is damaged or truncated, re-pack the dataset")
        if mmap and nbytes:
            return np.memmap(f, dtype=got, mode="r", offset=start, shape=got_shape)
        out = np.empty(got_shape, got)  # writable (torch.from_numpy warns on read-only arrays)
        if nbytes and f.readinto(memoryview(out.reshape(-1).view(np.uint8))) != nbytes:
            raise error(f"{path}: truncated while being read")
        return out


class MapGuard:
    """Checks that memory-mapped files still hold the bytes their maps cover.

    Touching a mapped page past the end of a file kills the process with SIGBUS;
    no Python handler can recover from that. Readers call :meth:`check` (one
    ``lseek`` to the end of each file: the guard's own descriptors, read by nothing else) before each read through a map: a file truncated under an
    open reader then raises. Residual risk: a truncation landing between the check
    and the copy that follows it (microseconds) still faults."""

    def __init__(self) -> None:
        self._files: list[tuple[int, int, str]] = []

    def add(self, path: Path, need: int, error: Error = FormatError) -> int:
        fd = open_regular(path, error)
        self._files.append((fd, need, str(path)))
        self.check(error)
        return fd

    def check(self, error: Error = FormatError) -> None:
        for fd, need, path in self._files:
            size = os.lseek(fd, 0, os.SEEK_END)  # the size, as fstat's: 1.2k instructions against 6.4k
            if size < need:
                raise error(f"{path}: {size} bytes, but the dataset needs {need}: the file was truncated "
                            f"(perhaps while open); restore or re-pack it")

    def close(self) -> None:
        for fd, _, _ in self._files:
            try:
                os.close(fd)
            except OSError:
                pass
        self._files = []
