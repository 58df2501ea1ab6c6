"""Tar shards at a URL as a :class:`~packio.formats.tar.ShardSource`: what makes a
:class:`~packio.formats.tar.TarReader` a remote one.

- map-style (no plan): the members of a batch's samples whose shards are not cached
  come by concurrent range reads (an image and its JSON member as one range when
  close); a cached shard is read from the cache;
- streaming (:meth:`RemoteShards.plan`): shards are fetched whole into the cache,
  ``prefetch`` ahead on a thread while the current one is read, and unpinned once the
  sequence is past their last sample (then they may be evicted).

A *watch* (any object with ``replaced() -> str | None``) says whether the dataset at
the URL is still the one opened; a failed fetch, a missing object or a sample that
fails its checks is then a ``DatasetReplacedError``, not a remote or corrupt-sample one.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

from packio.errors import (CorruptSampleError, DatasetReplacedError, RemoteError, RemoteTimeoutError,
                           RemoteUnreachableError)
from packio.formats.tar import ShardSource, read_span
from packio.remote.cache import Cache, FileInfo, Pin, open_cached
from packio.remote.store import Store

__all__ = ["RemoteShards"]

log = logging.getLogger("packio")
MERGE_GAP = 4096  # read an image and its JSON member as one range when this close
_PER_PROCESS = ("_pins", "_fds", "_lock", "_ranges", "_plan", "_prefetcher")


class _Plan:
    """One process's streaming sequence, reduced to shards: the order they are first
    needed in, where each is first and last needed, and how far reading has got."""

    def __init__(self, shard_of: np.ndarray, nshards: int) -> None:
        n = len(shard_of)
        uniq, first = np.unique(shard_of, return_index=True)
        by_first = np.argsort(first)
        self.order = uniq[by_first].tolist()
        self.first = first[by_first]
        self.last = np.full(nshards, -1, np.int64)
        if n:
            u, rev_first = np.unique(shard_of[::-1], return_index=True)
            self.last[u] = n - 1 - rev_first
        self.pos = 0  # samples read so far
        self.start = 0  # where the batch being read starts

    def behind(self, shard: int) -> bool:
        """True once the reading is past this shard's last sample (or it is not in the plan)."""
        return bool(self.last[shard] < self.start)


class _Prefetcher(threading.Thread):
    """Calls ``fetch(shard)`` for the plan's shards in order, at most ``ahead`` past the
    one being read."""

    IDLE = 600.0  # seconds without progress before it gives up (an abandoned iteration)

    def __init__(self, fetch: Callable[[int], None], order: list[int], ahead: int) -> None:
        super().__init__(name="packio-prefetch", daemon=True)
        self.fetch, self.order, self.limit = fetch, order, ahead
        self.stopped = False
        self.cond = threading.Condition()

    def allow(self, k: int) -> None:
        with self.cond:
            if k > self.limit:
                self.limit = k
                self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()

    def run(self) -> None:
        for k, shard in enumerate(self.order):
            with self.cond:
                if not self.cond.wait_for(lambda k=k: self.stopped or k <= self.limit, timeout=self.IDLE):
                    return
                if self.stopped:
                    return
            try:
                self.fetch(shard)
            except Exception as exc:  # the reader meets the same error when it gets there, and raises it
                log.debug("packio: prefetch of shard %d failed: %s", shard, exc)


class RemoteShards(ShardSource):
    """Shards ``names`` at ``store`` (sizes and checksums in ``files``), cached in
    ``vdir``. ``ranges``: map-style reads fetch single members by range (their records
    and payloads then checked as read); off for shards another tool wrote (read whole,
    each checked against the digest taken at open)."""

    max_open = 64  # shards kept pinned and open for map-style reads

    def __init__(self, store: Store, cache: Cache, vdir: Path, names: list[str], files: dict[str, FileInfo],
                 watch: Any, prefetch: int = 2, ranges: bool = True) -> None:
        super().__init__(names)
        self.store, self.cache, self.vdir, self.files, self.watch = store, cache, vdir, files, watch
        self.prefetch = max(0, int(prefetch))
        self.ranges = self.checks_samples = ranges
        self._pid: int | None = None
        self._reset()

    def _reset(self) -> None:
        self._pins: OrderedDict[int, Pin] = OrderedDict()
        self._fds: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._ranges: dict[tuple[int, int, int], bytes] = {}
        self._plan: _Plan | None = None
        self._prefetcher: _Prefetcher | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in _PER_PROCESS} | {"_pid": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def open(self) -> None:
        self._reset()
        self._pid = os.getpid()

    def close(self) -> None:
        owner = self._pid == os.getpid()  # False after fork: the parent's locks stay the parent's
        if self._prefetcher is not None and owner:
            self._prefetcher.stop()  # a download under way finishes on its own (daemon thread) and unpins itself
        for pin in self._pins.values():
            pin.release() if owner else pin.forget()
        for fd, _ in self._fds.values():
            os.close(fd)
        self._reset()  # a lock held by a parent's thread at fork stays behind
        self._pid = None

    def replaced(self) -> str | None:
        return self.watch.replaced()

    def read(self, shard: int, off: int, size: int, i: int) -> bytes:
        data = self._ranges.get((shard, off, size))
        if data is None:
            return read_span(*self._fd(shard), off, size, i, self.names[shard])
        if len(data) != size:
            raise CorruptSampleError(f"#{i}", f"a range of {self.store.url_of(self.names[shard])} came back short")
        return data

    def stage(self, rows: np.ndarray) -> None:
        self._advance(len(rows))
        if self._plan is not None:
            self._fetch_missing(rows[:, 0])
        elif self.ranges:
            self._stash(rows)

    def unstage(self) -> None:
        self._ranges.clear()
        if self._plan is None and self.cache.limit is not None:
            # map-style reads under a cache limit: the shards a batch used are unpinned after it
            # (held until the next batch, up to max_open of them kept the cache from evicting)
            with self._lock:
                for shard in list(self._pins):
                    self._release(shard)

    def plan(self, shards: np.ndarray) -> None:
        """Streaming: this process reads samples of these shards, in this order. Shards
        are then fetched whole, ``prefetch`` ahead, and released after their last sample."""
        if self._prefetcher is not None:
            self._prefetcher.stop()
        plan = _Plan(np.asarray(shards, np.int64), len(self.names))
        self._plan, self._prefetcher = plan, None
        if self.prefetch and len(plan.order) > 1:
            self._prefetcher = _Prefetcher(partial(self._fetch_ahead, plan), plan.order, self.prefetch)
            self._prefetcher.start()

    def fetch_all(self) -> dict[str, str]:
        """Download (and check) every file of the dataset into the cache; what went wrong
        with each file that could not be fetched or failed its check."""
        problems = {}
        for name, info in self.files.items():
            try:
                self.cache.fetch(self.store, name, self.vdir, info).release()
            except RemoteError as exc:
                problems[name] = str(exc)
        return problems

    # -- internals -----------------------------------------------------------------------------

    def _watched(self, fn: Callable[[], Any]) -> Any:
        """``fn()``; a remote failure other than the server's silence (an object gone, a
        download failing its checksum) is a replaced dataset when the watch says so."""
        try:
            return fn()
        except (RemoteTimeoutError, RemoteUnreachableError):
            raise
        except RemoteError:
            why = self.watch.replaced()
            if why is not None:
                raise DatasetReplacedError(why) from None
            raise

    def _pin(self, shard: int, fetch: bool, ahead: bool = False) -> bool:
        """Pin ``shard`` in the cache (downloading it when ``fetch``); False when it is
        not cached and ``fetch`` is off. ``ahead``: a prefetch, dropped if the reading
        has meanwhile gone past the shard."""
        lock, pins = self._lock, self._pins
        with lock:
            if shard in pins:
                pins.move_to_end(shard)
                return True
        name = self.names[shard]
        if not fetch and not (self.vdir / name).is_file():
            return False
        pin = self._watched(lambda: self.cache.fetch(self.store, name, self.vdir, self.files[name]))
        with lock:
            plan = self._plan
            late = ahead and plan is not None and plan.behind(shard)
            if shard in pins or self._pins is not pins or late:
                pin.release()  # pinned meanwhile, closed, or a late prefetch of a shard already read
                return shard in pins
            pins[shard] = pin
            if plan is None:
                while len(pins) > self.max_open:
                    self._release(next(iter(pins)))
        return True

    def _fetch_ahead(self, plan: _Plan, shard: int) -> None:
        if self._plan is plan and not plan.behind(shard):  # else the reading got there first
            self._pin(shard, fetch=True, ahead=True)

    def _release(self, shard: int) -> None:
        """Close and unpin one shard (caller holds ``_lock``)."""
        opened = self._fds.pop(shard, None)
        if opened is not None:
            os.close(opened[0])
        pin = self._pins.pop(shard, None)
        if pin is not None:
            pin.release()

    def _fd(self, shard: int) -> tuple[int, int]:
        """A cached shard opened without following links, a regular file of the manifest's
        size; anything else (a link, a truncated file) is fetched again."""
        if shard in self._fds:
            return self._fds[shard]
        name, size = self.names[shard], self.files[self.names[shard]][0]
        for _ in range(2):
            self._pin(shard, fetch=True)
            fd = open_cached(self.vdir / name, size)
            if fd is not None:
                self._fds[shard] = (fd, size if size is not None else os.fstat(fd).st_size)
                return self._fds[shard]
            with self._lock:
                self._release(shard)
            (self.vdir / name).unlink(missing_ok=True)
        raise RemoteError(f"{self.store.url_of(name)}: its cached copy in {self.vdir} is not a regular file "
                          f"of {size} bytes after fetching it again; is something else writing there?")

    def _advance(self, n: int) -> None:
        plan = self._plan
        if plan is None:
            return
        with self._lock:
            plan.start = start = plan.pos
            plan.pos += n
            for shard in [s for s in self._pins if plan.last[s] < start]:
                self._release(shard)
        if self._prefetcher is not None:
            k = int(np.searchsorted(plan.first, plan.pos - 1, side="right")) - 1
            self._prefetcher.allow(k + self.prefetch)

    def _fetch_missing(self, shards: np.ndarray) -> None:
        """Streaming: a batch that spans several missing shards (a shuffle window early
        in an epoch) fetches them concurrently rather than one after another."""
        with self._lock:
            missing = sorted({int(s) for s in shards} - set(self._pins))
        if len(missing) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(4, len(missing)), thread_name_prefix="packio-fetch") as pool:
                list(pool.map(lambda shard: self._pin(shard, fetch=True), missing))

    def _stash(self, rows: np.ndarray) -> None:
        """Map-style: fetch the members of uncached shards by concurrent range reads."""
        rel: list[str] = []
        spans: list[tuple[int, int]] = []
        keys: list[list[tuple[int, int, int, int]]] = []  # per range: (shard, offset, size, where in the range)
        for shard, ioff, isize, joff, jsize in rows[:, :5].tolist():
            if shard in self._fds or self._pin(shard, fetch=False):
                continue
            name = self.names[shard]
            if joff >= 0 and 0 <= joff - (ioff + isize) <= MERGE_GAP:
                rel.append(name)
                spans.append((ioff, joff + jsize))
                keys.append([(shard, ioff, isize, 0), (shard, joff, jsize, joff - ioff)])
                continue
            for off, size in ((ioff, isize), (joff, jsize)) if joff >= 0 else ((ioff, isize),):
                rel.append(name)
                spans.append((off, off + size))
                keys.append([(shard, off, size, 0)])
        blobs = self._watched(lambda: self.store.cat_ranges(rel, [a for a, _ in spans], [b for _, b in spans]))
        for blob, parts in zip(blobs, keys):
            for shard, off, size, at in parts:
                self._ranges[(shard, off, size)] = blob[at:at + size]
