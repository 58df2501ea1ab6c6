"""Open a packed dataset at a URL.

Tar shards (the streaming format) are read through :class:`RemoteTarReader`:

- map-style access reads one sample as one range request (image and JSON members
  together) unless its shard is already cached; a batch's ranges go out concurrently;
- streaming (``PackedIterableDataset`` hands the reader its sequence through
  :meth:`RemoteTarReader.plan`) downloads whole shards into the cache, prefetches the
  next ``prefetch`` shards on a thread while the current one is read, and unpins a
  shard once the sequence is past its last sample (then it may be evicted).

Every other format (and multi-part datasets) is downloaded whole into the cache
once, checked, and opened with the local reader: the simplest correct thing for
files that are read at random offsets (LMDB pages, HDF5 chunks, memory maps).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from packio import limits
from packio.errors import (BucketNotFoundError, CorruptSampleError, DatasetReplacedError, FormatError, RemoteError,
                           RemoteNotFoundError)
from packio.formats.base import Reader
from packio.formats.tar import INDEX, TarReader
from packio.manifest import DIGEST, MANIFEST_NAME, Manifest
from packio.remote.cache import Cache, FileInfo, Pin, open_cached
from packio.remote.store import Retry, Store
from packio.sample import Sample, checksum

__all__ = ["RemoteTarReader", "open_url", "settings"]

log = logging.getLogger("packio")
SINGLE_FILE = (".h5", ".hdf5")
_MERGE_GAP = 4096  # read an image and its JSON member as one range when this close


def open_url(url: str, *, cache_dir: str | Path | None = None, cache_limit: int | str | None = None,
             storage_options: dict[str, Any] | None = None, prefetch: int = 2, retries: int = 10,
             timeout: float = 10.0, retry_seconds: float = 30.0) -> Reader:
    """A reader for the packed dataset at ``url`` (any fsspec URL).

    ``cache_dir``: where files are cached (default ``$PACKIO_CACHE_DIR`` or
    ``~/.cache/packio``); ``cache_limit``: bytes or ``"20GB"`` (default
    ``$PACKIO_CACHE_LIMIT``, else unlimited), least recently used entries not in
    use are evicted; ``storage_options``: passed to the fsspec filesystem (never
    stored); ``prefetch``: shards fetched ahead while streaming; ``retries``:
    attempts per request on transient errors (exponential backoff), all of them within
    ``retry_seconds``; ``timeout``: seconds to connect, and that a read may stall.
    """
    cache, retry = settings(cache_dir, cache_limit, retries, timeout, retry_seconds)
    url = url.rstrip("/")
    parent, _, name = url.rpartition("/")
    if Path(name).suffix.lower() in SINGLE_FILE:
        return _open_single(Store(parent, storage_options, retry), name, cache)
    store = Store(url, storage_options, retry)
    text, manifest = read_manifest(store)
    files = _listing(manifest, str(store))
    data = data_store(store, text)
    vdir = cache.version_dir(url, version(text))
    if manifest.format == "tar" and "parts" not in manifest.extra:
        return RemoteTarReader.open(data, cache, vdir, manifest, files, prefetch, top=store, version=version(text))
    _pin(vdir, cache.fetch_all(data, files, vdir, text))
    from packio.formats import open_reader

    return open_reader(vdir)


def settings(cache_dir: str | Path | None, cache_limit: int | str | None, retries: int, timeout: float,
             retry_seconds: float) -> tuple[Cache, Retry]:
    """The cache and the retry policy :func:`open_url`'s arguments ask for."""
    if cache_limit is None:
        cache_limit = os.environ.get("PACKIO_CACHE_LIMIT") or None
    retry = Retry(attempts=max(1, int(retries)), timeout=float(timeout), total=float(retry_seconds))
    return Cache(cache_dir, cache_limit), retry


def version(text: bytes) -> str:
    """The name of one upload of a dataset: a digest of its manifest's bytes."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(text)[:16]


def read_manifest(store: Store) -> tuple[bytes, Manifest]:
    """The manifest at ``store`` (bytes, parsed), at most ``limits.MAX_MANIFEST_BYTES``."""
    try:
        text = store.read(MANIFEST_NAME, limits.MAX_MANIFEST_BYTES)
    except BucketNotFoundError:
        raise
    except RemoteNotFoundError:
        raise FormatError(f"{store}: no {MANIFEST_NAME} there: not a packed dataset, or its upload did not "
                          f"finish (the manifest is uploaded last); pack it with 'packio convert SRC {store}'"
                          ) from None
    return text, Manifest.from_json(text, store.url_of(MANIFEST_NAME))


def data_store(store: Store, text: bytes) -> Store:
    """Where the files of the upload whose manifest is ``text`` live: under ``v-VERSION/``
    (how packio uploads, so a replacement never overwrites a file a reader may still
    read), or beside the manifest (a dataset folder served as it is)."""
    sub = f"v-{version(text)}"
    if store.exists(f"{sub}/{MANIFEST_NAME}"):
        return Store(f"{store.url}/{sub}", store.options, store.retry)
    return store


_PINNED: dict[Path, Pin] = {}  # datasets cached whole stay pinned while this process lives: one pin each


def _pin(vdir: Path, pin: Pin) -> None:
    old = _PINNED.get(vdir)
    if old is not None and old.pid == os.getpid():
        pin.release()  # already pinned by this process
    else:
        _PINNED[vdir] = pin


def identity(store: Store, cache: Cache, name: str) -> tuple[int, list[str], str | None]:
    """An object's size (it bounds the download: an endless body would fill the disk), what
    tells one upload of it from another (ETag, version id, modification time) and, where
    the server gives none of those, its content digest (:meth:`Cache.content_identity`),
    which the cached copy must then have (not a later upload's bytes)."""
    info = store.info(name)
    size = info.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise RemoteError(f"{store.url_of(name)}: the server gives no size for it; packio needs one to bound "
                          f"its download (serve it with a Content-Length)")
    ident = [str(info.get(k)) for k in ("ETag", "etag", "VersionId", "LastModified", "last_modified", "mtime")
             if info.get(k)]
    if ident:
        return size, ident, None
    digest = cache.content_identity(store, name, size)  # a same-size replacement would look unchanged
    return size, [digest], digest.removeprefix("xxh3:")


def _open_single(store: Store, name: str, cache: Cache) -> Reader:
    """One-file datasets (HDF5): cached whole, versioned by the object's :func:`identity`,
    checked against its size when opened."""
    import xxhash

    from packio.formats import open_reader

    size, ident, digest = identity(store, cache, name)
    vdir = cache.version_dir(store.url_of(name), xxhash.xxh3_128_hexdigest(repr((size, ident)).encode())[:16])
    _pin(vdir, cache.fetch_all(store, {name: (size, digest)}, vdir, None, threads=1))
    return open_reader(vdir / name)


def _plain(rel: str) -> bool:
    if not rel or rel.startswith("/") or "\\" in rel or "\0" in rel:
        return False
    return all(p and not p.startswith(".") for p in rel.split("/")) and rel != MANIFEST_NAME


def _safe_rel(rel: Any) -> bool:
    """A plain relative path, also once percent-decoded (``%2e%2e/`` is ``../`` to a server)."""
    from urllib.parse import unquote

    return isinstance(rel, str) and _plain(rel) and _plain(unquote(rel)) and "%" not in unquote(rel)


def _listing(manifest: Manifest, url: str) -> dict[str, FileInfo]:
    """The manifest's files (size, xxh3-128), checked: a stranger's manifest names no
    path outside the dataset."""
    out: dict[str, FileInfo] = {}
    for rel, meta in manifest.files.items():
        if not _safe_rel(rel) or not isinstance(meta, dict):
            raise FormatError(f"{url}: the manifest lists {rel!r}, which is not a plain relative file path; "
                              f"refusing this dataset")
        size, digest = meta.get("bytes"), meta.get(DIGEST)
        if not (size is None or (isinstance(size, int) and size >= 0)) or not (
                digest is None or (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{32}", digest))):
            raise FormatError(f"{url}: the manifest's entry for {rel!r} has a bad size or checksum")
        out[rel] = (size, digest)
    return out


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
    """Downloads the plan's shards in order, at most ``ahead`` past the one being read."""

    IDLE = 600.0  # seconds without progress before it gives up (an abandoned iteration)

    def __init__(self, reader: "RemoteTarReader", plan: _Plan, ahead: int) -> None:
        super().__init__(name="packio-prefetch", daemon=True)
        self.reader, self.plan, self.order = reader, plan, plan.order
        self.limit = ahead
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
            if self.reader.__dict__.get("_h_plan") is not self.plan or self.plan.behind(shard):
                continue  # the reading got there first
            try:
                self.reader._local(shard, fetch=True, ahead=True)
            except Exception as exc:  # the reader meets the same error when it gets there, and raises it
                log.debug("packio: prefetch of shard %d failed: %s", shard, exc)


class RemoteTarReader(TarReader):
    """A :class:`TarReader` whose shards live at a URL and come through the cache."""

    max_open = 64  # shards kept pinned and open for map-style reads

    def __init__(self, store: Store, cache: Cache, vdir: Path, manifest: Manifest, files: dict[str, FileInfo],
                 index: np.ndarray, prefetch: int = 2) -> None:
        names = manifest.extra.get("shards")
        if not isinstance(names, list) or not all(isinstance(n, str) and n in files for n in names):
            raise FormatError(f"{store}: the manifest's shard list is missing or names unlisted files; "
                              f"re-pack the dataset")
        super().__init__(vdir, manifest, shards=[vdir / n for n in names], index=index)
        sizes = np.asarray([files[n][0] if files[n][0] is not None else -1 for n in names], np.int64)
        if len(index) and (sizes >= 0).all():
            end = sizes[index[:, 0]]
            bad = (index[:, 1] < 0) | (index[:, 2] < 0) | (index[:, 1] + index[:, 2] > end) | (
                (index[:, 3] >= 0) & (index[:, 3] + index[:, 4] > end)) | (index[:, 4] < 0)
            if bad.any():
                raise FormatError(f"{store}: {INDEX} points past the end of its shards; re-pack the dataset")
        self.store, self.cache, self.vdir, self.files, self.names = store, cache, vdir, files, names
        self.prefetch = max(0, int(prefetch))
        self.top, self.version = store, ""  # where the manifest lives, and which upload this is

    @classmethod
    def open(cls, store: Store, cache: Cache, vdir: Path, manifest: Manifest, files: dict[str, FileInfo],
             prefetch: int, top: Store, version: str) -> "RemoteTarReader":
        if INDEX not in files:
            raise FormatError(f"{store}: the manifest does not list {INDEX}; re-pack the dataset")
        pin = cache.fetch(store, INDEX, vdir, files[INDEX])
        try:
            index = limits.load_npy(vdir / INDEX, "<i8", (manifest.count, 5))
        finally:
            pin.release()
        reader = cls(store, cache, vdir, manifest, files, index, prefetch)
        reader.top, reader.version = top, version
        return reader

    def __str__(self) -> str:
        return str(self.top)

    def replaced(self) -> bool:
        """Whether the manifest at the URL is no longer the one this reader opened."""
        try:
            return version(read_manifest(self.top)[0]) != self.version
        except FormatError:
            return True  # gone

    def _check_replaced(self, what: str) -> None:
        if self.version and self.replaced():
            raise DatasetReplacedError(f"{self}: the dataset was replaced at this URL while it was being read "
                                       f"({what}); open it again to read the new one")

    def _stored_id(self) -> str:
        """The cache folder is named by this manifest's digest: it holds this dataset and
        no other. (A dataset replaced at the URL shows up as shards failing their checksum.)"""
        return self.manifest.id

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

    # -- per-process handles ----------------------------------------------------------------

    def _open(self) -> None:
        super()._open()
        self._h_pins: OrderedDict[int, Pin] = OrderedDict()
        self._h_lock = threading.Lock()
        self._h_ranges: dict[tuple[int, int, int], bytes] = {}
        self._h_plan: _Plan | None = None
        self._h_prefetcher: _Prefetcher | None = None

    def _drop_handles(self) -> None:
        owner = self._pid == os.getpid()  # False after fork: the parent's locks stay the parent's
        pf = self.__dict__.pop("_h_prefetcher", None)
        if pf is not None and owner:
            pf.stop()  # a download under way finishes on its own (daemon thread) and unpins itself
        for pin in self.__dict__.pop("_h_pins", {}).values():
            pin.release() if owner else pin.forget()
        for k in ("_h_lock", "_h_ranges", "_h_plan"):
            self.__dict__.pop(k, None)
        super()._drop_handles()

    def _local(self, shard: int, fetch: bool, ahead: bool = False) -> bool:
        """Pin ``shard`` in the cache (downloading it when ``fetch``); False when it is
        not cached and ``fetch`` is off. ``ahead``: a prefetch, dropped if the reading
        has meanwhile gone past the shard."""
        lock, pins = self._h_lock, self._h_pins
        with lock:
            if shard in pins:
                pins.move_to_end(shard)
                return True
        name = self.names[shard]
        if not fetch and not (self.vdir / name).is_file():
            return False
        pin = self.cache.fetch(self.store, name, self.vdir, self.files[name])
        with lock:
            plan = self.__dict__.get("_h_plan")
            late = ahead and plan is not None and plan.behind(shard)
            if shard in pins or self.__dict__.get("_h_pins") is not pins or late:
                pin.release()  # pinned meanwhile, closed, or a late prefetch of a shard already read
                return shard in pins
            pins[shard] = pin
            if plan is None:
                while len(pins) > self.max_open:
                    self._release(next(iter(pins)))
        return True

    def _release(self, shard: int) -> None:
        """Close and unpin one shard (caller holds ``_h_lock``)."""
        opened = self._h_fds.pop(shard, None)  # TarReader keeps (descriptor, size)
        if opened is not None:
            os.close(opened[0])
        pin = self._h_pins.pop(shard, None)
        if pin is not None:
            pin.release()

    def _fd(self, shard: int) -> tuple[int, int]:
        """A cached shard opened without following links, a regular file of the manifest's
        size; anything else (a link, a truncated file) is fetched again."""
        if shard not in self._h_fds:
            name, size = self.names[shard], self.files[self.names[shard]][0]
            for _ in range(2):
                self._local(shard, fetch=True)
                fd = open_cached(self.vdir / name, size)
                if fd is not None:
                    self._h_fds[shard] = (fd, size if size is not None else os.fstat(fd).st_size)
                    return self._h_fds[shard]
                with self._h_lock:
                    self._release(shard)
                (self.vdir / name).unlink(missing_ok=True)
            raise RemoteError(f"{self.store.url_of(name)}: its cached copy in {self.vdir} is not a regular file "
                              f"of {size} bytes after fetching it again; is something else writing there?")
        return self._h_fds[shard]

    def _pread(self, shard: int, off: int, size: int, i: int) -> bytes:
        data = self._h_ranges.get((shard, off, size))
        if data is None:
            return super()._pread(shard, off, size, i)
        if len(data) != size:
            raise CorruptSampleError(f"#{i}", f"a range of {self.store.url_of(self.names[shard])} came back short")
        return data

    # -- reading ----------------------------------------------------------------------------

    def plan(self, seq: np.ndarray) -> None:
        """Streaming: this process will read ``seq`` in order. Shards are then fetched
        whole, ``prefetch`` ahead, and released after their last sample."""
        self._ensure_open()
        if self._h_prefetcher is not None:
            self._h_prefetcher.stop()
        seq = np.asarray(seq, np.int64)
        plan = _Plan(self.index[seq, 0] if len(seq) else np.zeros(0, np.int64), len(self.shards))
        self._h_plan = plan
        self._h_prefetcher = None
        if self.prefetch and len(plan.order) > 1:
            self._h_prefetcher = _Prefetcher(self, plan, self.prefetch)
            self._h_prefetcher.start()

    def _advance(self, n: int) -> None:
        plan = self._h_plan
        if plan is None:
            return
        with self._h_lock:
            plan.start = start = plan.pos
            plan.pos += n
            for shard in [s for s in self._h_pins if plan.last[s] < start]:
                self._release(shard)
        if self._h_prefetcher is not None:
            k = int(np.searchsorted(plan.first, plan.pos - 1, side="right")) - 1
            self._h_prefetcher.allow(k + self.prefetch)

    def _fetch_batch(self, indices: list[int]) -> None:
        """Streaming: a batch that spans several missing shards (a shuffle window early
        in an epoch) fetches them concurrently rather than one after another."""
        if self._h_plan is None:
            return
        with self._h_lock:
            missing = sorted({int(s) for s in self.index[indices, 0]} - set(self._h_pins))
        if len(missing) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(4, len(missing)), thread_name_prefix="packio-fetch") as pool:
                list(pool.map(lambda shard: self._local(shard, fetch=True), missing))

    def _stash(self, indices: list[int]) -> None:
        """Map-style: fetch the members of uncached shards by concurrent range reads."""
        if self._h_plan is not None:
            return
        rel: list[str] = []
        spans: list[tuple[int, int]] = []
        keys: list[list[tuple[int, int, int, int]]] = []  # per range: (shard, offset, size, where in the range)
        for i in indices:
            shard, ioff, isize, joff, jsize = (int(v) for v in self.index[i])
            if shard in self._h_fds or self._local(shard, fetch=False):
                continue
            name = self.names[shard]
            if joff >= 0 and 0 <= joff - (ioff + isize) <= _MERGE_GAP:
                rel.append(name)
                spans.append((ioff, joff + jsize))
                keys.append([(shard, ioff, isize, 0), (shard, joff, jsize, joff - ioff)])
                continue
            for off, size in ((ioff, isize), (joff, jsize)) if joff >= 0 else ((ioff, isize),):
                rel.append(name)
                spans.append((off, off + size))
                keys.append([(shard, off, size, 0)])
        blobs = self.store.cat_ranges(rel, [a for a, _ in spans], [b for _, b in spans])
        for blob, parts in zip(blobs, keys):
            for shard, off, size, at in parts:
                self._h_ranges[(shard, off, size)] = blob[at:at + size]

    def _checked(self, i: int) -> Sample:
        """One sample, its payload checked against its record's checksum: a mismatch is
        a replaced dataset (the manifest at the URL changed) or a corrupt sample."""
        try:
            s = TarReader.read(self, i)
        except CorruptSampleError:
            if any(k[0] == int(self.index[i, 0]) for k in self._h_ranges):  # read by range
                self._check_replaced("a range read no longer matches the index")
            raise
        if s.checksum and checksum(s.payload) != s.checksum:
            self._check_replaced("a sample's checksum differs")
            raise CorruptSampleError(f"#{i}", f"checksum mismatch in {self.store.url_of(self.names[int(self.index[i, 0])])}")
        return s

    def _read_all(self, idx: list[int]) -> list[Sample]:
        try:
            self._fetch_batch(idx)
            self._stash(idx)
            return [self._checked(i) for i in idx]
        except RemoteNotFoundError:
            self._check_replaced("one of its files is gone")
            raise
        finally:
            self._h_ranges.clear()
            if self._h_plan is None and self.cache.limit is not None:
                self._unpin_all()

    def _unpin_all(self) -> None:
        """Map-style reads under a cache limit: the cached shards a batch used are unpinned
        after it (held until the next batch, up to ``max_open`` of them would keep the
        cache from evicting anything while this process lives)."""
        with self._h_lock:
            for shard in list(self._h_pins):
                self._release(shard)

    def read(self, i: int) -> Sample:
        i = self.check_index(i)
        self._ensure_open()
        self._advance(1)
        return self._read_all([i])[0]

    def read_many(self, indices: list[int]) -> list[Sample]:
        self._ensure_open()
        idx = [self.check_index(i) for i in indices]
        self._advance(len(idx))
        return self._read_all(idx)
