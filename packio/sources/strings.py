"""Many strings as one UTF-8 buffer plus offsets, and numpy hash look-ups over them:
a listing of 10M file names holds a few arrays, not 10M Python objects."""

from __future__ import annotations

from array import array
from typing import Iterator

import numpy as np

__all__ = ["Strings", "StringsBuilder", "HashIndex", "CHUNK", "trim_heap"]

CHUNK = 1 << 16  # strings turned into Python objects at a time, then dropped


class StringsBuilder:
    """Appends strings to one growing buffer; ``build()`` gives the ``Strings``."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._offsets = array("q", [0])

    def append(self, s: str) -> None:
        self._buf += s.encode("utf-8", "surrogateescape")
        self._offsets.append(len(self._buf))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def build(self) -> "Strings":
        """The strings, sharing this builder's buffers (no copy); the builder starts afresh."""
        data = np.frombuffer(self._buf, np.uint8) if self._buf else np.zeros(0, np.uint8)
        out = Strings(data, np.frombuffer(self._offsets, np.int64))
        self._buf, self._offsets = bytearray(), array("q", [0])
        return out


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

    @classmethod
    def concat(cls, parts: list["Strings"]) -> "Strings":
        """The strings of ``parts``, one after another."""
        if not parts:
            return cls.of([])
        ends = np.cumsum([0] + [int(p.offsets[-1]) for p in parts[:-1]])
        return cls(np.concatenate([p.data for p in parts]).astype(np.uint8, copy=False),
                   np.concatenate([parts[0].offsets[:1]] + [p.offsets[1:] + e for p, e in zip(parts, ends)]))

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

    def hashes(self, a: int = 0, b: int | None = None) -> np.ndarray:
        """xxh3-64 of strings ``a:b`` (all by default), ``uint64``."""
        import xxhash

        b = len(self) if b is None else b
        out = np.empty(b - a, np.uint64)
        view = memoryview(self.data)
        for k in range(a, b, CHUNK):
            offs = self.offsets[k:min(k + CHUNK, b) + 1].tolist()
            out[k - a:k - a + len(offs) - 1] = np.fromiter(
                (xxhash.xxh3_64_intdigest(view[x:y]) for x, y in zip(offs[:-1], offs[1:])), np.uint64, len(offs) - 1)
        return out


def trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc; elsewhere nothing). A scan's
    temporaries are arrays of a few MiB, which glibc serves from the heap once a freed one
    raised its mmap threshold; freed, they stayed resident under the later ones (measured:
    ~90 B per sample after a 100k scan, held through the whole write)."""
    import ctypes

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


class HashIndex:
    """Where each hash sits in a table of hashes (kept sorted, with its order)."""

    def __init__(self, table: np.ndarray) -> None:
        order = np.argsort(table, kind="stable")
        self.order = order.astype(np.int32) if len(table) < 1 << 31 else order  # 4 B a key less
        self.sorted = table[order]
        del order

    def lookup(self, queries: np.ndarray) -> np.ndarray:
        """For each query hash, the index of an equal hash in the table (-1: none). The
        caller checks the strings themselves: equal hashes only say where to look."""
        if not len(self.sorted):
            return np.full(len(queries), -1, np.int64)
        pos = np.minimum(np.searchsorted(self.sorted, queries), len(self.sorted) - 1)
        return np.where(self.sorted[pos] == queries, self.order[pos], -1)
