"""LMDB: one key per sample (``%010d`` of its index); the value is a 4-byte
little-endian record length, the msgpack record, then the payload bytes."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import lmdb

from packio.errors import CorruptSampleError, FormatError
from packio.formats.base import (FormatSpec, Reader, WriteOptions, Writer, decode_stored, inside, pack_record,
                                 payload_bytes, unpack_record)
from packio.manifest import Manifest
from packio.sample import Sample

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
        self._pending, self._pending_bytes = [], 0

    def close(self) -> dict[str, Any]:
        self._flush()
        self._env.sync(True)
        self._env.close()
        lock = self.path / "lock.mdb"
        if lock.exists():
            lock.unlink()
        return {"key_format": "%010d", "value_layout": "u32le record length | msgpack record | payload"}

    def abort(self) -> None:
        self._env.close()


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
        _ENVS[key] = [lmdb.open(key[0], readonly=True, lock=False, subdir=True, readahead=True,
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


class LMDBReader(Reader):
    @classmethod
    def describe(cls, path: Path, manifest: Manifest) -> list[str]:
        return [f"lmdb:     lmdb.open('{path}', readonly=True, lock=False): key %010d → "
                f"u32le length | msgpack record | image bytes"]

    def _open(self) -> None:
        if not inside(self.path, "data.mdb").is_file():
            raise FormatError(f"{self.path}: no data.mdb inside; this LMDB dataset is incomplete")
        try:
            env = _shared_env(self.path, self.manifest.id)
            self._h_txn = env.begin(buffers=True)
        except lmdb.Error as exc:
            raise FormatError(f"{self.path}: cannot open as LMDB ({exc}); is it a packio LMDB dataset?") from None
        entries = env.stat()["entries"]
        if entries != self.manifest.count:
            raise FormatError(f"{self.path}: LMDB holds {entries} entries but the manifest says "
                              f"{self.manifest.count}; the dataset is damaged, re-pack it")

    def _drop_handles(self) -> None:
        txn = self.__dict__.pop("_h_txn", None)
        if txn is not None and self._pid == os.getpid():
            txn.abort()
            _release_env(self.path, self.manifest.id)

    def read(self, i: int) -> Sample:
        i = self.check_index(i)
        self._ensure_open()
        value = self._h_txn.get(_key(i))
        if value is None:
            raise CorruptSampleError(f"#{i}", "missing from the LMDB file")
        if len(value) < 4:
            raise CorruptSampleError(f"#{i}", "value too short")
        (n,) = _LEN.unpack_from(value)
        if 4 + n > len(value):
            raise CorruptSampleError(f"#{i}", "record length runs past the value")
        rec = unpack_record(value[4:4 + n], f"#{i}")
        return decode_stored(rec, bytes(value[4 + n:]), f"#{i}")


FORMAT = FormatSpec(name="lmdb", suffixes=(".lmdb",), writer=LMDBWriter, reader=LMDBReader,
                    dataset_prefix="LMDB")
