"""The Reader contract. Callers (the read pipeline, verify, pack, the CLI) use only the
public names: ``len``, ``manifest``, ``path``, ``check_index(es)``, ``read``,
``read_batch``, ``key``, ``columns``, ``units``, ``plan``, ``fetch_all``, ``close`` and the
declared capabilities ``reads_batches`` / ``streams``. A format implements the hooks (``_open``,
``_load`` always; ``_load_key``, ``_load_batch``, ``_load_records``, ``_load_columns``,
``_drop_handles``, ``_stored_id``, ``units``, ``check_stored`` and the class methods where
it knows better): the public
methods, written out once here and never wrapped, turn a hook's native errors into packio
errors. Replacement is all or nothing: once a call finds the dataset replaced, it and
every later one raise ``DatasetReplacedError``; ``read_batch`` never puts that (or a
``RemoteError``) in a sample's place, nor reads again sample by sample.
"""

from __future__ import annotations

import os
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, final

import numpy as np

from packio import limits
from packio.errors import CorruptSampleError, DatasetReplacedError, FormatError, PackioError, RemoteError
from packio.formats.columns import LabelColumns
from packio.manifest import MANIFEST_NAME, Manifest, manifest_id
from packio.sample import Sample

__all__ = ["NATIVE_ERRORS", "Reader", "StoredBatch", "contained", "file_identity", "folder_identity", "inside"]

# What a damaged or hostile file makes numpy, h5py, the OS or struct raise. Not IndexError
# or TypeError: those stay the caller's (a bad index), the readers check the file's own.
NATIVE_ERRORS = (OSError, ValueError, KeyError, RuntimeError, MemoryError, OverflowError, EOFError, struct.error)
PASS_THROUGH = (DatasetReplacedError, RemoteError)  # never one sample's damage: a batch never holds them


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


def folder_identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one version of a file from another without reading it: device, inode,
    size, modification time (ns)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


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

    def rows(self) -> list[Sample | PackioError]:
        """The samples; a pixel block as one raw :class:`Sample` per row (a view of the
        block, without the records' checksums)."""
        if self.samples is not None:
            return self.samples
        px, ends = self.pixels, np.cumsum(self.counts)  # type: ignore[arg-type]
        h, w = px.shape[1:3]  # type: ignore[union-attr]
        return [Sample(key, px[j], "raw", int(self.labels[j]), self.boxes[e - n:e],  # type: ignore[index]
                       self.box_labels[e - n:e], w, h)  # type: ignore[index]
                for j, (key, n, e) in enumerate(zip(self.keys, self.counts.tolist(), ends.tolist()))]  # type: ignore


class Reader(ABC):
    """Random access to stored samples. Handles open lazily, once per process, so a
    reader can be pickled into DataLoader workers (fork, spawn, forkserver)."""

    COUNT_FILE: ClassVar[str | None] = None  # file (relative; "" = the path itself) whose size bounds the count
    MIN_SAMPLE_BYTES: ClassVar[int] = 8  # bytes every sample takes in COUNT_FILE at the least
    # The manifest is packio.json in the dataset's folder (its id read from the first bytes);
    # False: the format keeps it elsewhere and read_manifest finds it (HDF5: inside the file).
    MANIFEST_BESIDE: ClassVar[bool] = True
    # Capabilities. reads_batches: read_batch does better than one read per sample (a pixel
    # block, concurrent range reads); else the read pipeline calls read(i) on its decode
    # threads. streams: plan() matters (remote shards fetched whole, in order, prefetched).
    reads_batches: ClassVar[bool] = False
    streams: ClassVar[bool] = False

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self._pid: int | None = None
        self._gone: str | None = None  # why the dataset counts as replaced, once any call found it so
        if self.COUNT_FILE is not None:  # before anything is sized by the count (units, samplers)
            limits.check_count(manifest.count, path / self.COUNT_FILE if self.COUNT_FILE else path,
                               self.MIN_SAMPLE_BYTES)

    # -- what callers use ------------------------------------------------------------------

    def __len__(self) -> int:
        return self.manifest.count

    @final
    def read(self, i: int) -> Sample:
        """Stored sample ``i``; one bad sample is a ``CorruptSampleError``."""
        i = self.check_index(i)
        return self._door(self._load, i, i)

    @final
    def read_batch(self, indices: Any, threads: Any = None) -> StoredBatch:
        """The stored samples of a batch, a bad one its error in its place (never a
        replaced dataset or a remote failure: those raise); fixed-shape raw formats give
        one pixel block. ``threads``: anything with ``size()`` and ``map(fn, n)`` (the read
        pipeline's decode threads) that a reader may share a copy with."""
        idx = self.check_indices(indices)
        return self._door(self._load_batch, None, idx, threads)

    @final
    def key(self, i: int) -> str:
        """Sample ``i``'s key (formats keeping records apart from images read the record only)."""
        i = self.check_index(i)
        return self._door(self._load_key, i, i)

    @final
    def columns(self) -> LabelColumns:
        """Every sample's label (-1: none) and box count, without decoding an image: from the
        format's label columns, else its records alone. Read once per process."""
        if "_h_labels" not in self.__dict__:
            self._h_labels = self._door(self._load_columns, None)
        return self._h_labels

    def units(self) -> list[range]:
        """Contiguous index ranges read as a unit by streaming (shards, blocks)."""
        n, step = len(self), 512
        return [range(s, min(s + step, n)) for s in range(0, n, step)]

    def plan(self, seq: np.ndarray) -> None:
        """This process will read ``seq`` in this order (a streaming reader fetches ahead);
        called whatever the reader, a no-op unless it ``streams``."""

    def fetch_all(self) -> dict[str, str]:
        """Fetch every file of a dataset that lives elsewhere (verify); what went wrong
        with each file that failed. Local datasets: nothing to fetch."""
        return {}

    def check_stored(self) -> list[str]:
        """Problems in stored data that ``manifest.files`` does not cover (for verify)."""
        return []

    def close(self) -> None:
        if self._pid == os.getpid():
            self._drop_handles()
        self._pid = None

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

    # -- class methods a format may implement --------------------------------------------------

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
    def describe(cls, where: str, manifest: Manifest) -> list[str]:
        """Lines for ``packio info`` / the convert summary: how to open the dataset whose
        files lie at ``where`` (a folder, a file, or the URL they are served at) with the
        neighbours' tools (h5py, numpy, lmdb, webdataset, tar)."""
        return []

    # -- hooks a format implements (called only from this class's public methods) -----------

    @abstractmethod
    def _open(self) -> None:
        """Open this process's handles."""

    @abstractmethod
    def _load(self, i: int) -> Sample:
        """Stored sample ``i`` (a checked index; handles open)."""

    def _load_key(self, i: int) -> str:
        return self._load(i).key

    def _load_batch(self, idx: np.ndarray, threads: Any) -> StoredBatch:
        """The batch sample by sample (each bad one its error, in its place)."""
        return StoredBatch(idx, samples=self._each(idx, self._load))

    def _load_columns(self) -> LabelColumns:
        """Labels and box counts from ``_load_records``, a block at a time."""
        n = len(self)
        labels, boxes = np.empty(n, np.int64), np.empty(n, np.int64)
        for a in range(0, n, 4096):
            for i, s in enumerate(self._load_records(np.arange(a, min(a + 4096, n))), a):
                labels[i], boxes[i] = s.label, len(s.boxes)
        return LabelColumns(labels, boxes)

    def _load_records(self, idx: np.ndarray) -> list[Sample]:
        """Samples ``idx`` for their labels and boxes: a format that keeps records apart from
        the images reads the records alone (``payload`` then ``b""``)."""
        return [self._load(i) for i in idx.tolist()]

    def _drop_handles(self) -> None:
        """Forget this process's handles (and, after fork, the parent's)."""

    def _stored_id(self) -> str:
        """The id of the dataset now at ``self.path``: from the first bytes of the folder's
        manifest, or (``MANIFEST_BESIDE`` off) through ``read_manifest``. Unreadable: the
        dataset was replaced or removed."""
        try:
            if self.MANIFEST_BESIDE:
                return manifest_id(inside(self.path, MANIFEST_NAME))
            return type(self).read_manifest(self.path).id
        except (OSError, FormatError):
            raise self._replaced() from None

    # -- shared machinery ------------------------------------------------------------------------

    def _door(self, hook: Callable[..., Any], i: int | None, *args: Any) -> Any:
        """``hook(*args)`` once this process's handles are open; a native error becomes a
        packio error naming the file (and sample ``i``), a replaced dataset sticks."""
        try:
            self._ensure_open()
            return hook(*args)
        except DatasetReplacedError as exc:
            raise self._stick(exc) from None
        except PackioError:
            raise
        except NATIVE_ERRORS as exc:
            raise self._damage(exc, i) from None

    def _each(self, idx: np.ndarray, load: Callable[[int], Sample]) -> list[Sample | PackioError]:
        """``load(i)`` for each index, a packio error (one bad sample) in its place; a
        replaced dataset or a remote failure is no sample's damage: it raises."""
        out: list[Sample | PackioError] = []
        for i in idx.tolist():
            try:
                out.append(load(i))
            except PASS_THROUGH:
                raise
            except PackioError as exc:
                out.append(exc)
            except NATIVE_ERRORS as exc:
                out.append(self._damage(exc, i))
        return out

    def _damage(self, exc: BaseException, i: int | None) -> CorruptSampleError:
        return CorruptSampleError("(batch)" if i is None else f"#{i}", f"{self.path}: {type(exc).__name__}: {exc}")

    def _stick(self, exc: DatasetReplacedError) -> DatasetReplacedError:
        """Remember that the dataset was found replaced: every later call raises too."""
        self._gone = str(exc)
        return DatasetReplacedError(self._gone)

    def _ensure_open(self) -> None:
        if self._gone is not None:
            raise DatasetReplacedError(self._gone)
        if self._pid != os.getpid():
            if self._pid is not None:
                self._drop_handles()
            self._check_id()  # before: a replaced dataset is this clear error, not some mismatch found on opening
            try:
                self._open()
            except PackioError:
                raise
            except NATIVE_ERRORS as exc:
                raise FormatError(f"{self.path}: cannot open ({type(exc).__name__}: {exc}); the dataset is "
                                  f"damaged, re-pack it") from None
            self._pid = os.getpid()
            try:
                self._h_root = folder_identity(self.path)
                self._check_id()  # after: the handles belong to the dataset this reader describes
            except BaseException:
                self.close()
                raise
        else:
            self._check_moved()

    def _check_id(self, at_path: bool = False) -> None:
        """Raise unless the dataset at ``self.path`` is this one (or this one grown by appends);
        ``at_path``: read its id from the path, never through open handles (HDF5's)."""
        if self.manifest.source.get("foreign"):
            return
        if at_path and not self.MANIFEST_BESIDE:
            try:
                stored = type(self).read_manifest(self.path).id
            except (OSError, FormatError):
                raise self._replaced() from None
        else:
            stored = self._stored_id()
        if stored != self.manifest.id and not self._extended():
            raise self._replaced()

    def _check_moved(self) -> None:
        """Each call once open: one stat of the dataset's folder (or file). Handles kept open
        (memory maps) would serve a dataset that ``convert --overwrite`` swapped away for ever;
        another folder at the path must hold this dataset (a cache's copy fetched again)."""
        try:
            now: tuple[int, int] | None = folder_identity(self.path)
        except OSError:
            now = None  # removed: the id says whether that is a replacement (a remote reader's cache folder is not)
        if now != self._h_root:
            try:
                self._check_id(at_path=True)
            except DatasetReplacedError as exc:  # sticky from any door (plan, images, check_stored too)
                raise self._stick(exc) from None
            self._h_root = now

    def _extended(self) -> bool:
        """Whether the dataset now at ``self.path`` is this one grown by appends (which
        leave every file of the versions they name in ``extra["versions"]`` untouched)."""
        try:
            versions = type(self).read_manifest(self.path).extra.get("versions")
        except (OSError, FormatError):
            return False
        return isinstance(versions, list) and self.manifest.id in versions

    def _replaced(self) -> DatasetReplacedError:
        return DatasetReplacedError(f"{self.path} was replaced or removed (another 'packio convert --overwrite'?) "
                                    f"after this reader opened it; open the dataset again")

    def _check_root(self) -> None:
        """For files opened lazily by path: raise when the folder the handles came from
        is no longer the one at ``self.path`` (records of one dataset, images of another)."""
        try:
            same = folder_identity(self.path) == self._h_root
        except OSError:
            same = False
        if not same:
            raise self._replaced()

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_h_")}
        state["_pid"] = None
        return state
