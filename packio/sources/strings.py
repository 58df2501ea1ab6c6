"""Many strings as one UTF-8 buffer plus offsets, and numpy hash look-ups over them:
a listing of 10M file names holds a few arrays, not 10M Python objects."""

from __future__ import annotations

from array import array
from typing import Iterator

import numpy as np

__all__ = ["Strings", "StringsBuilder", "lookup", "CHUNK"]

CHUNK = 1 << 16  # strings turned into Python objects at a time, then dropped


class StringsBuilder:
    """Appends strings to one growing buffer; ``build()`` gives the ``Strings``."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._ends = array("q")

    def append(self, s: str) -> None:
        self._buf += s.encode("utf-8", "surrogateescape")
        self._ends.append(len(self._buf))

    def __len__(self) -> int:
        return len(self._ends)

    def build(self) -> "Strings":
        data = np.frombuffer(bytes(self._buf), np.uint8)
        self._buf = bytearray()
        offsets = np.zeros(len(self._ends) + 1, np.int64)
        offsets[1:] = np.frombuffer(self._ends, np.int64) if len(self._ends) else offsets[1:]
        self._ends = array("q")
        return Strings(data, offsets)


class Strings:
    """Read-only strings: string ``i`` is ``data[offsets[i]:offsets[i + 1]]`` (UTF-8)."""

    def __init__(self, data: np.ndarray, offsets: np.ndarray) -> None:
        self.data, self.offsets = data, offsets

    @classmethod
    def of(cls, items: list[str]) -> "Strings":
        b = StringsBuilder()
        for s in items:
            b.append(s)
        return b.build()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.data[a:b].tobytes().decode("utf-8", "surrogateescape")

    def __iter__(self) -> Iterator[str]:
        for k in range(0, len(self), CHUNK):
            offs = self.offsets[k:k + CHUNK + 1].tolist()
            raw = self.data[offs[0]:offs[-1]].tobytes()
            base = offs[0]
            for a, b in zip(offs[:-1], offs[1:]):
                yield raw[a - base:b - base].decode("utf-8", "surrogateescape")

    def slice(self, a: int, b: int) -> "Strings":
        """Strings ``a:b`` as a compact copy (what a Dask part is sent)."""
        lo, hi = int(self.offsets[a]), int(self.offsets[b])
        return Strings(self.data[lo:hi].copy(), self.offsets[a:b + 1] - lo)

    def take(self, idx: np.ndarray) -> "Strings":
        """Strings at ``idx``, in that order."""
        starts, ends = self.offsets[idx], self.offsets[idx + 1]
        lens = ends - starts
        offsets = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        pos = np.repeat(starts - offsets[:-1], lens) + np.arange(int(offsets[-1]), dtype=np.int64)
        return Strings(self.data[pos], offsets)

    def hashes(self) -> np.ndarray:
        """xxh3-64 of every string, ``uint64[n]``."""
        import xxhash

        out = np.empty(len(self), np.uint64)
        view = memoryview(self.data)
        for k in range(0, len(self), CHUNK):
            offs = self.offsets[k:k + CHUNK + 1].tolist()
            out[k:k + len(offs) - 1] = np.fromiter(
                (xxhash.xxh3_64_intdigest(view[a:b]) for a, b in zip(offs[:-1], offs[1:])), np.uint64, len(offs) - 1)
        return out


def lookup(table: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """For each query hash, the index of an equal hash in ``table`` (-1: none). The caller
    checks the strings themselves: equal hashes only say where to look."""
    order = np.argsort(table, kind="stable")
    ordered = table[order]
    pos = np.minimum(np.searchsorted(ordered, queries), max(len(table) - 1, 0))
    if not len(table):
        return np.full(len(queries), -1, np.int64)
    return np.where(ordered[pos] == queries, order[pos], -1)
