"""The Writer / Reader pair every format implements, and shared helpers."""

from __future__ import annotations

import functools
import json
import os
import struct
from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import msgpack
import numpy as np

from packio import limits
from packio.errors import CorruptSampleError, DatasetReplacedError, FormatError, PackioError
from packio.formats.spill import SpilledColumn
from packio.manifest import MANIFEST_NAME, Manifest, describe_files, manifest_id
from packio.sample import Sample, sample_from_record

__all__ = ["MAX_RECORD_BYTES", "NATIVE_ERRORS", "fixed_image_shape", "WriteOptions", "pack_record", "unpack_record", "decode_stored",
           "file_starts_with", "payload_bytes", "inside", "contained", "Writer", "Reader", "RecordFile",
           "RecordBlob", "FormatSpec", "StoredBatch"]

def inside(root: Path, rel: str | Path) -> Path:
    """``root / rel`` with symlinks resolved; a FormatError when that lies outside
    ``root`` (a dataset is a closed world: nothing it names may reach other files)."""
    try:
        base = root.resolve()
        p = (root / rel).resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise FormatError(f"{root}: cannot resolve {str(rel)!r} ({exc})") from None
    if p != base and base not in p.parents:
        raise FormatError(f"{root}: {str(rel)!r} leads outside the dataset (to {p}); refusing to read it. "
                          f"A packed dataset must not hold symlinks to other places; re-pack it")
    return p


def contained(root: Path, rel: str, checked: set[str]) -> Path:
    """``root/rel`` for a file read per sample: its folder is resolved once (remembered in
    ``checked``), the file itself only when it is a symlink; outside ``root``: FormatError."""
    folder = rel.rpartition("/")[0]
    if folder not in checked:
        inside(root, folder)
        checked.add(folder)
    path = root / rel
    return inside(root, rel) if os.path.islink(path) else path


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


# What a damaged or hostile file makes numpy, h5py, the OS or struct raise. Not IndexError
# or TypeError: those stay the caller's (a bad index), the readers check the file's own.
NATIVE_ERRORS = (OSError, ValueError, KeyError, RuntimeError, MemoryError, OverflowError, EOFError, struct.error)


def _guarded(fn: Callable[..., Any], opening: bool) -> Callable[..., Any]:
    """Turn a native error escaping a reader method into a packio error naming the file
    (and the sample, when there is one index)."""

    @functools.wraps(fn)
    def wrapper(self: "Reader", *args: Any) -> Any:
        try:
            return fn(self, *args)
        except PackioError:
            raise
        except NATIVE_ERRORS as exc:
            why = f"{type(exc).__name__}: {exc}"
            if opening:
                raise FormatError(f"{self.path}: cannot open ({why}); the dataset is damaged, re-pack it") from None
            where = f"#{args[0]}" if args and isinstance(args[0], (int, np.integer)) else "(batch)"
            raise CorruptSampleError(where, f"{self.path}: {why}") from None

    return wrapper


class Reader(ABC):
    """Random access to stored samples. Handles open lazily, once per process, so a
    reader can be pickled into DataLoader workers (fork or spawn).

    Every subclass's ``_open`` / ``read`` / ``key`` / ``read_many`` / ``read_batch`` is wrapped so
    that native errors become packio errors (see ``_guarded``)."""

    COUNT_FILE: str | None = None  # file (relative; "" = the path itself) whose size bounds the count
    MIN_SAMPLE_BYTES = 8  # bytes every sample takes in COUNT_FILE at the least

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self._pid: int | None = None
        if self.COUNT_FILE is not None:  # before anything is sized by the count (units, samplers)
            limits.check_count(manifest.count, path / self.COUNT_FILE if self.COUNT_FILE else path,
                               self.MIN_SAMPLE_BYTES)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        for name in ("_open", "read", "key", "read_many", "read_batch"):
            if name in cls.__dict__:
                setattr(cls, name, _guarded(cls.__dict__[name], name == "_open"))

    @classmethod
    def read_manifest(cls, path: Path) -> Manifest:
        mpath = path / MANIFEST_NAME
        text = limits.read_regular(inside(path, MANIFEST_NAME), limits.MAX_MANIFEST_BYTES, lambda m: FormatError(
            f"{m}; is this a dataset packed by packio?"))
        return Manifest.from_json(text, str(mpath))

    @classmethod
    def claims(cls, path: str) -> bool:
        """True when ``path`` is this format's data without a packio manifest beside it
        (an HDF5 file, tar shards): :meth:`open_unlisted` opens it."""
        return False

    @classmethod
    def open_unlisted(cls, path: str) -> "Reader":
        raise FormatError(f"{path}: not a packed dataset")

    @classmethod
    def describe(cls, path: Path, manifest: Manifest) -> list[str]:
        """Lines for ``packio info`` / the convert summary: how to open ``path`` with
        the neighbours' tools (h5py, numpy, lmdb, webdataset, tar)."""
        return []

    def __len__(self) -> int:
        return self.manifest.count

    def _ensure_open(self) -> None:
        if self._pid != os.getpid():
            if self._pid is not None:
                self._drop_handles()
            self._check_id()  # before: a replaced dataset is this clear error, not some mismatch found on opening
            self._open()
            self._pid = os.getpid()
            try:
                self._h_root = _identity(self.path)
                self._check_id()  # after: the handles belong to the dataset this reader describes
            except BaseException:
                self.close()
                raise

    def _check_id(self) -> None:
        if not self.manifest.source.get("foreign") and self._stored_id() != self.manifest.id \
                and not self._extended():
            raise self._replaced()

    def _extended(self) -> bool:
        """Whether the dataset now at ``self.path`` is this one grown by appends (which
        leave every file of the versions they name in ``extra["versions"]`` untouched)."""
        try:
            versions = type(self).read_manifest(self.path).extra.get("versions")
        except (OSError, FormatError):
            return False
        return isinstance(versions, list) and self.manifest.id in versions

    def _stored_id(self) -> str:
        """The id of the dataset now at ``self.path`` (from the first bytes of a folder's
        manifest; a format keeping its manifest elsewhere reads it its own way)."""
        try:
            if type(self).read_manifest.__func__ is Reader.read_manifest.__func__:  # type: ignore[attr-defined]
                return manifest_id(inside(self.path, MANIFEST_NAME))
            return self.read_manifest(self.path).id
        except (OSError, FormatError):
            raise self._replaced() from None

    def _replaced(self) -> DatasetReplacedError:
        return DatasetReplacedError(f"{self.path} was replaced or removed (another 'packio convert --overwrite'?) "
                                    f"after this reader opened it; open the dataset again")

    def _check_root(self) -> None:
        """For files opened lazily by path: raise when the folder the handles came from
        is no longer the one at ``self.path`` (records of one dataset, images of another)."""
        try:
            same = _identity(self.path) == self._h_root
        except OSError:
            same = False
        if not same:
            raise self._replaced()

    @abstractmethod
    def _open(self) -> None: ...

    def _drop_handles(self) -> None:
        """Forget handles inherited from another process (after fork)."""

    def close(self) -> None:
        if self._pid == os.getpid():
            self._drop_handles()
        self._pid = None

    @abstractmethod
    def read(self, i: int) -> Sample: ...

    def key(self, i: int) -> str:
        """Sample ``i``'s key; formats keeping records apart from images read the record only."""
        return self.read(i).key

    def read_many(self, indices: list[int]) -> list[Sample]:
        return [self.read(i) for i in indices]

    # -- contract shim (READER-CONTRACT.md; r2-contract declares these per format: drop at merge) --
    @property
    def reads_batches(self) -> bool:
        """True when ``read_batch`` does better than one ``read`` per sample."""
        return type(self).read_many is not Reader.read_many or type(self).read_batch is not Reader.read_batch

    @property
    def streams(self) -> bool:
        """True when the reader wants :meth:`plan` (remote shards, fetched whole)."""
        return type(self).plan is not Reader.plan

    def plan(self, seq: np.ndarray) -> None:
        """Told the sequence this process will read, in order (streaming readers prefetch it)."""

    def fetch_all(self) -> dict[str, str]:
        """For verify: every file fetched; the damaged ones, by name."""
        return {}

    def check_stored(self) -> list[str]:
        """Problems in stored data that ``manifest.files`` does not cover (for verify)."""
        return []

    def read_batch(self, indices: Sequence[int], threads: Any = None) -> "StoredBatch":
        """The stored samples of a batch. This default reads them one by one (a bad one
        becomes its error, in its place); fixed-shape raw formats gather one pixel block.
        ``threads``: a :class:`packio.read.decoder.DecodeThreads` a reader may share its copy with."""
        idx = self.check_indices(indices)
        try:
            samples: list[Sample | PackioError] = list(self.read_many(idx.tolist()))
        except PackioError:
            samples = []
            for i in idx.tolist():
                try:
                    samples.append(self.read(i))
                except PackioError as exc:
                    samples.append(exc)
        return StoredBatch(idx, samples=samples)

    def units(self) -> list[range]:
        """Contiguous index ranges read as a unit by streaming (shards, blocks)."""
        n, step = len(self), 512
        return [range(s, min(s + step, n)) for s in range(0, n, step)]

    def check_index(self, i: int) -> int:
        if type(i) is int and 0 <= i < len(self):  # the common case, checked twice per ds[i]
            return i
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"sample index must be an int, got {type(i).__name__}")
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for {n} samples")
        return int(i) % n if n else int(i)

    def check_indices(self, indices: Any) -> np.ndarray:
        """:meth:`check_index` for a batch at once: int64[B], negatives wrapped."""
        idx = np.asarray(indices)
        if (idx.ndim != 1 or (len(idx) and (idx.dtype.kind not in "iu"))
                or (not isinstance(indices, np.ndarray) and bool in set(map(type, indices)))):  # one C loop
            return np.asarray([self.check_index(i) for i in indices], np.int64)  # its TypeError names the culprit
        idx = idx.astype(np.int64, copy=False)
        n = len(self)
        if len(idx) and (int(idx.min()) < -n or int(idx.max()) >= n):
            bad = idx[(idx < -n) | (idx >= n)][0]
            raise IndexError(f"sample index {bad} out of range for {n} samples")
        return np.where(idx < 0, idx + n, idx) if len(idx) and int(idx.min()) < 0 else idx

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_h_")}
        state["_pid"] = None
        return state


@dataclass
class StoredBatch:
    """A batch as stored, before decoding: ``index`` int64[B] and either ``samples``
    (each a :class:`Sample`, or the packio error reading it raised) or, from a
    fixed-shape raw format, ``pixels`` uint8[B, H, W, 3] (a fresh array, never handed
    out twice) with its columns: ``labels`` int64[B], ``boxes`` float32[M, 4] sample
    after sample (``counts`` int64[B] each), ``box_labels`` int64[M], ``keys``."""

    index: np.ndarray
    samples: list[Sample | PackioError] | None = None
    pixels: np.ndarray | None = None
    labels: np.ndarray | None = None
    boxes: np.ndarray | None = None
    counts: np.ndarray | None = None
    box_labels: np.ndarray | None = None
    keys: list[str] | None = None


def _identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


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
