"""The writer side every format implements, the one record codec, the registry entry
(:class:`FormatSpec`) and helpers both sides share. The reader side is
:mod:`packio.formats.reader`."""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from packio import limits
from packio.errors import CorruptSampleError, FormatError, PackioError
from packio.formats.reader import Reader, inside
from packio.formats.spill import SpilledColumn
from packio.manifest import MANIFEST_NAME, Manifest, describe_files
from packio.sample import Sample, sample_from_record

__all__ = ["MAX_RECORD_BYTES", "fixed_image_shape", "WriteOptions", "pack_record", "unpack_record", "decode_stored",
           "file_starts_with", "payload_bytes", "Writer", "RecordFile", "RecordBlob", "FormatSpec"]


@dataclass(frozen=True)
class WriteOptions:
    """What a writer needs to know beyond the samples themselves."""

    shard_samples: int = 10_000  # tar: samples per shard (when ``shards`` is 0)
    shard_bytes: int = 1 << 30  # tar: bytes per shard (whichever limit comes first)
    shards: int = 0  # tar: split ``expected`` samples evenly over this many shards
    expected: int = 0  # samples the writer will be given at most (the listing's length)
    fixed_shape: tuple[int, int] | None = None  # (h, w) when every image has it
    first_key: int = 0  # tar: the first sample's member key (a part's place in the whole dataset)


# The one record codec. Every format stores a sample's record (packio.sample.Sample.record)
# as msgpack, except tar shards, whose ``.json`` member is read by WebDataset and other
# tools as is: there the same record is compact JSON, read with the same limits.
MAX_RECORD_BYTES = limits.MAX_RECORD_BYTES  # the default; packio.limits' value is read at call time


def pack_record(rec: dict[str, Any], *, text: bool = False) -> bytes:
    """Encode a record: msgpack, or compact JSON with ``text=True``. The writer keeps the
    readers' size limit: what packs can be read back."""
    blob = json.dumps(rec, separators=(",", ":")).encode() if text else msgpack.packb(rec, use_bin_type=True)
    if len(blob) > limits.MAX_RECORD_BYTES:
        raise CorruptSampleError(str(rec.get("key")), f"record of {len(blob)} bytes exceeds packio's limit of "
                                 f"{limits.MAX_RECORD_BYTES}")
    return blob


def unpack_record(data: bytes | memoryview, where: str, *, text: bool = False) -> Any:
    """Decode a record from an untrusted file: bounded size, element counts (msgpack)
    and nesting; any failure is a ``CorruptSampleError`` naming ``where``."""
    if len(data) > limits.MAX_RECORD_BYTES:
        raise CorruptSampleError(where, f"record of {len(data)} bytes exceeds {limits.MAX_RECORD_BYTES}")
    if text:
        return limits.loads_json(bytes(data), "record", limits.MAX_RECORD_BYTES,
                                 lambda m: CorruptSampleError(where, m))
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=1 << 20,
                               max_str_len=1 << 20, max_array_len=limits.MAX_BOXES, max_map_len=1 << 16)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CorruptSampleError(where, f"record is not valid msgpack ({exc})") from None


def decode_stored(rec: Any, payload: bytes | np.ndarray, where: str) -> Sample:
    """Record + payload → Sample; raw payloads get their shape from the record."""
    sample = sample_from_record(rec, payload)
    if sample.encoding == "raw" and isinstance(payload, (bytes, memoryview)):
        shape = (sample.height, sample.width, 3)
        if len(payload) != shape[0] * shape[1] * 3:
            raise CorruptSampleError(sample.key, f"raw payload of {len(payload)} bytes does not fit {shape}")
        sample.payload = np.frombuffer(payload, np.uint8).reshape(shape)
    return sample


def file_starts_with(path: str | Path, magic: bytes) -> bool:
    """Whether ``path`` is a regular file beginning with ``magic`` (for ``Reader.claims``):
    only those bytes are read, and a FIFO is not opened for blocking."""
    try:
        return limits.read_head(path, len(magic)) == magic
    except PackioError:  # a folder, a FIFO, a missing path, no permission: not this format's file
        return False


def payload_bytes(sample: Sample) -> bytes | memoryview:
    p = sample.payload
    return np.ascontiguousarray(p).data if isinstance(p, np.ndarray) else p


class Writer(ABC):
    """Writes samples to ``path`` (a temporary name; the caller renames it when done)."""

    def __init__(self, path: Path, options: WriteOptions) -> None:
        self.path = path
        self.options = options
        self.count = 0

    @abstractmethod
    def add(self, sample: Sample) -> None: ...

    @abstractmethod
    def close(self) -> dict[str, Any]:
        """Flush and close; returns format-specific facts for ``manifest.extra``."""

    def abort(self) -> None:
        """Release handles after a failure (the caller deletes the temporary path)."""

    def write_manifest(self, manifest: Manifest) -> None:
        manifest.files = describe_files(self.path)
        (self.path / MANIFEST_NAME).write_text(manifest.to_json())


class RecordFile:
    """Records of formats that keep them apart from the payloads: one msgpack blob
    per sample concatenated in ``records.bin`` with ``records.idx.npy`` offsets."""

    BIN, IDX = "records.bin", "records.idx.npy"
    SPILL = 1 << 13  # record ends held before they are appended to the spill file

    def __init__(self, root: Path) -> None:
        self.root = root
        self._out = open(root / self.BIN, "wb")
        self._ends, self._end = array("q"), 0  # ends of the records since the last spill
        self._spill = SpilledColumn(root / ".records.idx.spill", np.int64)  # held, 8 B a sample

    def add(self, rec: dict[str, Any]) -> None:
        blob = pack_record(rec)
        self._out.write(blob)
        self._end += len(blob)
        self._ends.append(self._end)
        if len(self._ends) >= self.SPILL:
            self._spill.append(np.frombuffer(self._ends, np.int64))
            self._ends = array("q")

    def close(self) -> None:
        """``records.idx.npy``: the offsets, from 0 to the end of the last record (np.save's bytes)."""
        self._out.close()
        self._spill.append(np.frombuffer(self._ends, np.int64))
        self._spill.finish(self.root / self.IDX, np.zeros(1, np.int64))

    def abort(self) -> None:
        self._out.close()
        self._spill.discard()

    @classmethod
    def load(cls, root: Path, count: int) -> tuple[np.ndarray, "RecordBlob"]:
        """The offsets (in memory, checked whole) and the blob (read with pread: a map of
        it would kill the process with SIGBUS if the file were truncated while open)."""
        idx = limits.load_npy(inside(root, cls.IDX), "<i8", (count + 1,))
        blob = RecordBlob(inside(root, cls.BIN))
        if count and (idx[0] != 0 or idx[-1] > blob.size or bool(np.any(np.diff(idx) < 0))):
            blob.close()
            raise FormatError(f"{root}: record index does not fit {cls.BIN} ({blob.size} bytes); "
                              f"re-pack the dataset or run 'packio verify'")
        return idx, blob

    @staticmethod
    def get(idx: np.ndarray, blob: "RecordBlob", i: int) -> Any:
        a, b = int(idx[i]), int(idx[i + 1])
        return unpack_record(blob.read(a, b, f"#{i}"), f"#{i}")


class RecordBlob:
    """``records.bin`` read by ``pread`` (a descriptor per process; readers drop it on fork)."""

    def __init__(self, path: Path) -> None:
        self.path, self.fd = path, -1
        self.fd = limits.open_regular(path)
        self.size = os.fstat(self.fd).st_size

    def read(self, a: int, b: int, where: str) -> bytes:
        limits.check_span(a, b - a, self.size, f"{self.path} ({where})", lambda m: CorruptSampleError(where, m))
        if b - a > limits.MAX_RECORD_BYTES:
            raise CorruptSampleError(where, f"record of {b - a} bytes is over packio's limit")
        data = os.pread(self.fd, b - a, a)
        if len(data) != b - a:
            raise CorruptSampleError(where, f"{self.path} is truncated")
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError, TypeError):  # at interpreter exit ``os`` may already be None
            pass


@dataclass(frozen=True)
class FormatSpec:
    """One format: its name, suffixes, writer and reader, kept side by side.
    Registered in ``packio.formats`` (built in, or ``packio.formats.register``),
    it gets everything else from there: ``open_reader`` / ``open_dataset``,
    ``convert``, the CLI, the ``{dataset_prefix}Dataset`` classes and the benchmark."""

    name: str
    suffixes: tuple[str, ...]
    writer: type[Writer]
    reader: type[Reader]
    stores: str = "files"  # "files": encoded images (as found, or re-encoded); "pixels": decoded uint8 HWC
    encoding: str | None = None  # the one encoding every stored file gets ("bmp"); None: the source's, or JPEG
    needs_fixed_shape: bool = False
    raw_when_fixed: bool = False  # store decoded pixels when every image has one pre-resized shape
    dataset_prefix: str = ""  # packio.{prefix}Dataset / {prefix}IterableDataset; default: name.capitalize()
    # Output suffixes that promise one file where this format writes a folder, each with what a
    # folder of that name breaks: convert refuses them and names a suffix of this format instead.
    refused_suffixes: tuple[tuple[str, str], ...] = ()
    folder_holds: str = ""  # what the folder holds, for that message ("shard-NNNNNN.tar files + packio.json")

    @property
    def class_prefix(self) -> str:
        return self.dataset_prefix or self.name.capitalize()

    def __post_init__(self) -> None:
        if self.stores not in ("files", "pixels"):
            raise ValueError(f"format {self.name!r}: stores must be 'files' or 'pixels', not {self.stores!r}")

    @property
    def payload(self) -> str:
        """The payload kind written to ``manifest.image["payload"]`` by default: "raw"
        (decoded pixels), the one fixed encoding ("bmp"), or "encoded"."""
        return "raw" if self.stores == "pixels" else self.encoding or "encoded"

    def payload_for(self, fixed_shape: tuple[int, int] | None) -> str:
        """The payload kind for this conversion: pixels when the format keeps them for
        one fixed shape (HDF5), else :attr:`payload`."""
        return "raw" if self.raw_when_fixed and fixed_shape is not None else self.payload


def fixed_image_shape(manifest: Manifest, where: Path | str) -> tuple[int, int, int]:
    """The manifest's one image shape ``[H, W, 3]`` of a fixed-shape raw format, checked
    against packio's pixel limit before anything is allocated from it."""
    shape = (manifest.image or {}).get("shape")
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and v > 0 for v in shape)
            and shape[2] == 3 and shape[0] * shape[1] <= limits.MAX_PIXELS):
        raise FormatError(f"{where}: the manifest's image shape {shape!r} is not a valid [H, W, 3] within "
                          f"packio's pixel limit; the dataset is damaged")
    return shape[0], shape[1], 3
