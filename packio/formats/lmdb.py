"""LMDB: one key per sample (``%010d`` of its index); the value is a 4-byte
little-endian record length, the msgpack record, then the payload bytes."""

from __future__ import annotations

import errno
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from packio import limits
from packio.errors import CorruptSampleError, FormatError
from packio.formats.base import (FormatSpec, Reader, WriteOptions, Writer, decode_stored, pack_record,
                                 payload_bytes, unpack_record)
from packio.sample import Sample

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
        self._env = lmdb.open(str(path), map_size=self._map_size, subdir=True, sync=False,
                              metasync=False, readahead=False, meminit=False, max_dbs=0)
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0

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
        lock = self.path / "lock.mdb"
        if lock.exists():
            lock.unlink()
        return {"key_format": "%010d", "value_layout": "u32le record length | msgpack record | payload"}

    def abort(self) -> None:
        self._env.close()


_ENVS: dict[str, list] = {}  # realpath -> [environment, readers using it]
_ENVS_PID: list[int] = [0]


def _shared_env(path: Path) -> lmdb.Environment:
    """One environment per path per process, shared by its readers: py-lmdb refuses
    to open a path twice in a process, and a forked child inherits the parent's open
    ones, which it must close before opening its own."""
    if _ENVS_PID[0] != os.getpid():
        for env, _ in _ENVS.values():
            env.close()
        _ENVS.clear()
        _ENVS_PID[0] = os.getpid()
    key = os.path.realpath(path)
    if key not in _ENVS:
        # lock=False: readers never write; readahead stays on (shared/PERF-NOTES.md:
        # LMDB lost 32-41% cold with readahead=False on this kind of machine).
        sys.audit("open", key, "r", 0)  # a C-level open, made visible to audit hooks (file-open counting)
        _ENVS[key] = [lmdb.open(key, readonly=True, lock=False, subdir=True, readahead=True,
                                meminit=False, max_readers=2048), 0]
    _ENVS[key][1] += 1
    return _ENVS[key][0]


def _release_env(path: Path) -> None:
    entry = _ENVS.get(os.path.realpath(path))
    if entry is not None and _ENVS_PID[0] == os.getpid():
        entry[1] -= 1
        if entry[1] <= 0:
            entry[0].close()
            del _ENVS[os.path.realpath(path)]


def _maps_of(fd: int) -> list[tuple[int, int]]:
    """(start, length) of this process's memory maps of the file open as ``fd``, from its
    start (/proc/self/maps; empty where there is none)."""
    st = os.fstat(fd)
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                span, _, offset, dev, inode = line.split(None, 5)[:5]
                major, minor = (int(x, 16) for x in dev.split(":"))
                if int(inode) == st.st_ino and os.makedev(major, minor) == st.st_dev and int(offset, 16) == 0:
                    a, b = (int(x, 16) for x in span.split("-"))
                    out.append((a, b - a))
    except (OSError, ValueError):
        pass
    return out


class LMDBReader(Reader):
    """Reads through LMDB's memory map, where a page past the end of data.mdb would kill
    the process with SIGBUS. So the file must hold every page its meta page counts
    (checked with ``fstat`` before each read: this catches a file truncated under an open
    reader), and a value must lie inside those pages before its bytes are touched (a
    crafted node may claim any size). Residual risk: a truncation landing between that
    check and the copy of the value, microseconds later, still faults."""

    COUNT_FILE = "data.mdb"
    MIN_SAMPLE_BYTES = 16  # a 10-byte key and an 8-byte node header at the least

    def _open(self) -> None:
        data = self.path / "data.mdb"
        limits.file_size(data, lambda m: FormatError(f"{m}; this LMDB dataset is incomplete"))  # never blocks
        try:
            env = _shared_env(self.path)
            self._h_txn = env.begin(buffers=True)
        except lmdb.Error as exc:
            raise FormatError(f"{self.path}: cannot open as LMDB ({exc}); is it a packio LMDB dataset?") from None
        info, st = env.info(), env.stat()  # both from the meta pages, which LMDB read with pread
        need = (info["last_pgno"] + 1) * st["psize"]
        self._h_guard = limits.MapGuard()
        fd = self._h_guard.add(data, need)
        self._h_maps = [(a, min(n, need)) for a, n in _maps_of(fd)]
        entries = st["entries"]
        if entries != self.manifest.count:
            raise FormatError(f"{self.path}: LMDB holds {entries} entries but the manifest says "
                              f"{self.manifest.count}; the dataset is damaged, re-pack it")

    def _check_inside(self, value: memoryview, i: int) -> None:
        if not self._h_maps or not len(value):
            return
        at = np.frombuffer(value, np.uint8).__array_interface__["data"][0]
        if not any(a <= at and at + len(value) <= a + n for a, n in self._h_maps):
            raise CorruptSampleError(f"#{i}", f"{self.path}/data.mdb: the value's {len(value)} bytes lie outside "
                                              f"the file's pages (a damaged LMDB page); re-pack the dataset")

    def _drop_handles(self) -> None:
        txn = self.__dict__.pop("_h_txn", None)
        guard = self.__dict__.pop("_h_guard", None)
        if guard is not None:
            guard.close()
        if txn is not None and self._pid == os.getpid():
            txn.abort()
            _release_env(self.path)

    def read(self, i: int) -> Sample:
        i = self.check_index(i)
        self._ensure_open()
        self._h_guard.check()
        value = self._h_txn.get(_key(i))
        if value is None:
            raise CorruptSampleError(f"#{i}", "missing from the LMDB file")
        self._check_inside(value, i)
        if len(value) < 4:
            raise CorruptSampleError(f"#{i}", "value too short")
        (n,) = _LEN.unpack_from(value)
        if 4 + n > len(value):
            raise CorruptSampleError(f"#{i}", "record length runs past the value")
        rec = unpack_record(value[4:4 + n], f"#{i}")
        return decode_stored(rec, bytes(value[4 + n:]), f"#{i}")


FORMAT = FormatSpec(name="lmdb", suffixes=(".lmdb",), writer=LMDBWriter, reader=LMDBReader, payload="encoded")
