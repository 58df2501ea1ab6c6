"""LMDB: one key per sample (``%010d`` of its index); the value is a 4-byte
little-endian record length, the msgpack record, then the payload bytes."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from packio import limits
from packio.errors import CorruptSampleError, FormatError
from packio.formats.base import FormatSpec, WriteOptions, Writer, decode_stored, pack_record, payload_bytes, unpack_record
from packio.formats.parts import part_paths, samples_text
from packio.formats.reader import Reader, inside
from packio.manifest import Manifest
from packio.sample import Sample, sample_from_record

__all__ = ["LMDBWriter", "LMDBReader", "FORMAT"]

_LEN = struct.Struct("<I")
_TXN_SAMPLES = 2048
_TXN_BYTES = 256 << 20


def _key(i: int) -> bytes:
    return b"%010d" % i


class LMDBWriter(Writer):
    def __init__(self, path: Path, options: WriteOptions) -> None:
        super().__init__(path, options)
        path.mkdir(parents=True)
        self._map_size = 1 << 30  # virtual only: data.mdb grows with what is written; doubled when full
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        try:  # a disk too full for LMDB's lock and meta pages fails here
            self._env = lmdb.open(os.fsencode(path), map_size=self._map_size, subdir=True, sync=False,
                                  metasync=False, readahead=False, meminit=False, max_dbs=0)
        except lmdb.Error as exc:
            raise self._write_error(exc) from None
        self._data_fd = os.open(path / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)  # finds LMDB's map of it

    def add(self, sample: Sample) -> None:
        rec = pack_record(sample.record())
        value = b"".join((_LEN.pack(len(rec)), rec, payload_bytes(sample)))
        self._pending.append((_key(self.count), value))
        self._pending_bytes += len(value)
        self.count += 1
        if len(self._pending) >= _TXN_SAMPLES or self._pending_bytes >= _TXN_BYTES:
            self._flush()

    def _flush(self) -> None:
        while self._pending:
            try:
                with self._env.begin(write=True) as txn:
                    for k, v in self._pending:
                        txn.put(k, v, append=True)
                break
            except lmdb.MapFullError:
                # Grow geometrically: no hard-coded map size, no copy of the data.
                self._map_size = max(self._map_size * 2, self._map_size + 2 * self._pending_bytes)
                self._env.set_mapsize(self._map_size)
            except lmdb.Error as exc:
                raise self._write_error(exc) from None
        self._pending, self._pending_bytes = [], 0
        _drop_mapped_pages(self._data_fd, self.path / "data.mdb")

    def _write_error(self, exc: lmdb.Error) -> OSError:
        """lmdb.Error carries no errno, and LMDB reports a short write on a full disk as
        EIO: name the full disk when that is what the free space says."""
        full = shutil.disk_usage(self.path).free < max(self._pending_bytes, 1 << 20)
        return OSError(errno.ENOSPC if full else errno.EIO, f"LMDB write failed ({exc})")

    def close(self) -> dict[str, Any]:
        self._flush()
        try:
            self._env.sync(True)
        except lmdb.Error as exc:
            raise self._write_error(exc) from None
        self._env.close()
        os.close(self._data_fd)
        lock = self.path / "lock.mdb"
        if lock.exists():
            lock.unlink()
        return {"key_format": "%010d", "value_layout": "u32le record length | msgpack record | payload"}

    def abort(self) -> None:
        self._env.close()
        os.close(self._data_fd)


def _drop_mapped_pages(fd: int, path: Path) -> None:
    """Unmap from this process the pages of data.mdb that LMDB's map faulted in. Each
    commit reads a few pages through the map, and the kernel maps the written pages
    around them too (fault-around): ~65 B per sample written, held as RSS until close
    (measured at 100k). The writer writes with pwrite, never through the read-only map,
    so dropping the pages loses nothing; a later read faults them back from the cache."""
    madvise = getattr(ctypes.CDLL(None), "madvise", None)
    if madvise is None:
        return
    for start, length in _maps_of(fd, path):
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_DONTNEED)


_MADV_DONTNEED = 4


_ENVS: dict[tuple[str, str], list] = {}  # (realpath, dataset id) -> [environment, readers using it]
_ENVS_PID: list[int] = [0]


def _shared_env(path: Path, ident: str) -> lmdb.Environment:
    """One environment per dataset per process, shared by its readers: py-lmdb refuses
    to open a path twice in a process, and a forked child inherits the parent's open
    ones, which it must close before opening its own. Keyed by the dataset's id too:
    a dataset replaced at the same path must not be served the old one's environment."""
    if _ENVS_PID[0] != os.getpid():
        for env, _ in _ENVS.values():
            env.close()
        _ENVS.clear()
        _ENVS_PID[0] = os.getpid()
    key = (os.path.realpath(path), ident)
    if key not in _ENVS:
        # lock=False: readers never write; readahead stays on (shared/PERF-NOTES.md:
        # LMDB lost 32-41% cold with readahead=False on this kind of machine).
        _ENVS[key] = [lmdb.open(os.fsencode(key[0]), readonly=True, lock=False, subdir=True, readahead=True,
                                meminit=False, max_readers=2048), 0]
    _ENVS[key][1] += 1
    return _ENVS[key][0]


def _release_env(path: Path, ident: str) -> None:
    key = (os.path.realpath(path), ident)
    entry = _ENVS.get(key)
    if entry is not None and _ENVS_PID[0] == os.getpid():
        entry[1] -= 1
        if entry[1] <= 0:
            entry[0].close()
            del _ENVS[key]


def _maps_of(fd: int, path: Path) -> list[tuple[int, int]]:
    """(start, length) of this process's memory maps of the file open as ``fd``, from its
    start (/proc/self/maps; empty where there is none). Matched by device and inode, or
    by path (overlayfs shows the underlying file's device there)."""
    st = os.fstat(fd)
    real = os.path.realpath(path)
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) < 6 or int(fields[2], 16) != 0:
                    continue
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                if ((int(fields[4]) == st.st_ino and os.makedev(major, minor) == st.st_dev)
                        or fields[5].rstrip("\n") == real):
                    a, b = (int(x, 16) for x in fields[0].split("-"))
                    out.append((a, b - a))
    except (OSError, ValueError):
        pass
    return out


_NODE = struct.Struct("<HHHH")  # MDB_node: mn_lo, mn_hi (data size), mn_flags, mn_ksize; then the key
_F_BIGDATA = 0x01  # the data sits on overflow pages: the node holds their first page number
_PAGE_HEADER = 16


def _address(buf: memoryview) -> int:
    return np.frombuffer(buf, np.uint8).__array_interface__["data"][0]


class LMDBReader(Reader):
    """Reads through LMDB's memory map, where a page past the end of data.mdb kills the
    process with SIGBUS. So:

    - the file must hold every page its meta page counts (``fstat`` before each read,
      which also catches a file truncated under an open reader);
    - a value must lie inside those pages before anything touches it: a crafted node
      may claim any size, and py-lmdb touches every page of a value as it returns it.
      The cursor is placed on the key (LMDB reads the node's header and key, nothing
      of the value); the header, 8 bytes before the key, gives the value's place and
      size, which are checked against the file before the value is asked for.

    Residual risk (documented in the README): LMDB itself trusts offsets inside a
    page, so a crafted node pointer in one of the file's last pages can still make
    it read past the end; and a truncation landing between the check and the copy.
    Where /proc/self/maps is absent, only the file-size check runs."""

    COUNT_FILE = "data.mdb"
    MIN_SAMPLE_BYTES = 16  # a 10-byte key and an 8-byte node header at the least

    @classmethod
    def describe(cls, where: str, manifest: Manifest) -> list[str]:
        value = "u32le length | msgpack record | image bytes"
        if "parts" not in manifest.extra:
            return [f"lmdb:     lmdb.open({where!r}, readonly=True, lock=False): key %010d → {value}"]
        parts = part_paths(where, manifest)
        lines = [f"lmdb:     {len(parts)} parts, one LMDB environment each; in each, key %010d from 0 → {value}:"]
        lines += [f"          lmdb.open({folder!r}, readonly=True, lock=False)  # {samples_text(a, n)}"
                  for folder, a, n in parts[:20]]
        return lines + ([f"          ... {len(parts) - 20} more, the same way: see 'packio info --json' for every "
                         "part"] if len(parts) > 20 else [])

    def _open(self) -> None:
        data = inside(self.path, "data.mdb")
        limits.file_size(data, lambda m: FormatError(f"{m}; this LMDB dataset is incomplete"))  # never blocks
        try:
            env = _shared_env(self.path, self.manifest.id)
            self._h_txn = env.begin(buffers=True)
            info, st = env.info(), env.stat()  # both from the meta pages, which LMDB read with pread
        except lmdb.Error as exc:
            raise FormatError(f"{self.path}: cannot open as LMDB ({exc}); is it a packio LMDB dataset?") from None
        self._h_need, self._h_psize = (info["last_pgno"] + 1) * st["psize"], st["psize"]
        self._h_guard = limits.MapGuard()
        fd = self._h_guard.add(data, self._h_need)
        self._h_maps = _maps_of(fd, data)
        self._h_cursor = self._h_txn.cursor()
        entries = st["entries"]
        if entries != self.manifest.count:
            raise FormatError(f"{self.path}: LMDB holds {entries} entries but the manifest says "
                              f"{self.manifest.count}; the dataset is damaged, re-pack it")

    def _get(self, i: int) -> memoryview | None:
        """Sample i's value, its place checked against the file before it is touched."""
        self._h_guard.check()
        if not self._h_maps:
            try:
                return self._h_txn.get(_key(i))
            except lmdb.Error as exc:
                raise self._damaged(i, exc) from None
        cur = self._h_cursor
        try:
            if not cur.set_key(_key(i)):
                return None
        except lmdb.Error as exc:  # a damaged page on the way to the key
            raise self._damaged(i, exc) from None
        key = cur.key()
        at = _address(key)
        start = None
        for a, n in self._h_maps:  # a plain loop: a generator here cost as much as the msgpack parse
            if a <= at < a + n:
                start = a
                break
        lo, hi, flags, ksize = _NODE.unpack(ctypes.string_at(at - _NODE.size, _NODE.size))  # LMDB read these
        size = lo | hi << 16
        if start is None or ksize != len(key) or flags & ~_F_BIGDATA:
            raise CorruptSampleError(f"#{i}", f"{self.path}/data.mdb: a damaged LMDB node; re-pack the dataset")
        if flags & _F_BIGDATA:
            (pgno,) = struct.unpack("<Q", ctypes.string_at(at + ksize, 8))  # LMDB copied these too
            first = start + pgno * self._h_psize + _PAGE_HEADER
        else:
            first = at + ksize
        if not start <= first <= first + size <= start + self._h_need:
            raise CorruptSampleError(f"#{i}", f"{self.path}/data.mdb: the value's {size} bytes lie outside the "
                                              f"file's pages (a damaged LMDB node); re-pack the dataset")
        return cur.value()

    def _damaged(self, i: int, exc: lmdb.Error) -> CorruptSampleError:
        """The error for sample i, after dropping the handles: LMDB marks a transaction
        bad after an error, and every later read in it would fail too (MDB_BAD_TXN),
        so the next read opens a fresh one."""
        self._drop_handles()
        self._pid = None
        return CorruptSampleError(f"#{i}", f"{self.path}/data.mdb: {exc}; re-pack the dataset")

    def _drop_handles(self) -> None:
        self.__dict__.pop("_h_cursor", None)
        txn = self.__dict__.pop("_h_txn", None)
        guard = self.__dict__.pop("_h_guard", None)
        if guard is not None:
            guard.close()
        if txn is not None and self._pid == os.getpid():
            txn.abort()
            _release_env(self.path, self.manifest.id)

    def _split(self, i: int) -> tuple[memoryview, int]:
        """Sample i's value (in the map, not copied) and its record's length."""
        value = self._get(i)
        if value is None:
            raise CorruptSampleError(f"#{i}", "missing from the LMDB file")
        if len(value) < 4:
            raise CorruptSampleError(f"#{i}", "value too short")
        (n,) = _LEN.unpack_from(value)
        if 4 + n > len(value):
            raise CorruptSampleError(f"#{i}", "record length runs past the value")
        return value, n

    def _load(self, i: int) -> Sample:
        value, n = self._split(i)
        rec = unpack_record(value[4:4 + n], f"#{i}")
        return decode_stored(rec, bytes(value[4 + n:]), f"#{i}")

    def _record(self, i: int) -> Any:
        value, n = self._split(i)
        return unpack_record(value[4:4 + n], f"#{i}")

    def _load_records(self, idx: np.ndarray) -> list[Sample]:
        """The records alone: the image bytes behind each are neither copied nor decoded."""
        return [sample_from_record(self._record(i), b"") for i in idx.tolist()]

    def _load_key(self, i: int) -> str:
        """The record's key alone: the payload behind it is neither copied nor decoded
        (an append checks every stored key)."""
        rec = self._record(i)
        return rec["key"] if isinstance(rec, dict) and isinstance(rec.get("key"), str) else self._load(i).key


FORMAT = FormatSpec(name="lmdb", suffixes=(".lmdb",), writer=LMDBWriter, reader=LMDBReader,
                    dataset_prefix="LMDB")
