"""Open a packed dataset at a URL.

Tar shards (the streaming format) are read by :class:`RemoteTarReader`: a
:class:`~packio.formats.tar.TarReader` over :class:`~packio.remote.shards.RemoteShards`
(map-style: single members by concurrent range reads, each record checked against
the index's digest and each payload against its record's checksum; streaming: whole
shards through the cache, prefetched). The manifest's digest, taken at open, is
watched: a dataset replaced at the URL is a ``DatasetReplacedError``.

Every other format (and multi-part datasets) is downloaded whole into the cache
once, checked, and opened with the local reader: the simplest correct thing for
files that are read at random offsets (LMDB pages, HDF5 chunks, memory maps).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from packio import limits
from packio.errors import BucketNotFoundError, FormatError, RemoteError, RemoteNotFoundError
from packio.formats import open_reader
from packio.formats.reader import Reader
from packio.formats.tar import DIGESTS, INDEX, TarReader
from packio.manifest import DIGEST, MANIFEST_NAME, Manifest
from packio.remote.cache import Cache, FileInfo, Pin
from packio.remote.shards import RemoteShards
from packio.remote.store import Retry, Store

__all__ = ["ManifestWatch", "RemoteTarReader", "data_store", "describe_packed", "identity", "listing", "open_url",
           "read_manifest", "safe_rel", "settings", "version"]

SINGLE_FILE = (".h5", ".hdf5")


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
    files = listing(manifest, str(store))
    data = data_store(store, text)
    vdir = cache.version_dir(url, version(text))
    if manifest.format == "tar" and "parts" not in manifest.extra:
        return RemoteTarReader.open(data, cache, vdir, manifest, files, prefetch, ManifestWatch(store, version(text)))
    _pin(vdir, cache.fetch_all(data, files, vdir, text))
    return open_reader(vdir)


def describe_packed(url: str, **kwargs: Any) -> tuple[Manifest, int, str]:
    """A packed dataset's manifest, the bytes it lists, and the URL its files lie under,
    from the manifest alone (an HDF5 file: cached whole, as :func:`open_url` does)."""
    url = url.rstrip("/")
    if Path(url.rpartition("/")[2]).suffix.lower() in SINGLE_FILE:
        reader = open_url(url, **kwargs)
        return reader.manifest, reader.path.stat().st_size, url
    store = Store(url, kwargs.get("storage_options"))
    text, m = read_manifest(store)
    return m, sum(f.get("bytes") or 0 for f in m.files.values() if isinstance(f, dict)), data_store(store, text).url


def settings(cache_dir: str | Path | None, cache_limit: int | str | None, retries: int, timeout: float,
             retry_seconds: float) -> tuple[Cache, Retry]:
    """The cache and the retry policy :func:`open_url`'s arguments ask for."""
    if cache_limit is None:
        cache_limit = os.environ.get("PACKIO_CACHE_LIMIT") or None
    retry = Retry(attempts=max(1, int(retries)), timeout=float(timeout), total=float(retry_seconds))
    return Cache(cache_dir, cache_limit), retry


def version(text: bytes) -> str:
    """The name of one upload of a dataset: a digest of its manifest's bytes (or of what else
    names it: a single file's identity, foreign shards' names and identities)."""
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
    size, ident, digest = identity(store, cache, name)
    vdir = cache.version_dir(store.url_of(name), version(repr((size, ident)).encode()))
    _pin(vdir, cache.fetch_all(store, {name: (size, digest)}, vdir, None, threads=1))
    return open_reader(vdir / name)


def safe_rel(rel: Any) -> bool:
    """A plain relative path (:func:`packio.limits.plain_rel`, not the manifest), also once
    percent-decoded (``%2e%2e/`` is ``../`` to a server)."""
    from urllib.parse import unquote

    if not isinstance(rel, str):
        return False
    decoded = unquote(rel)
    return all(limits.plain_rel(r) and r != MANIFEST_NAME for r in (rel, decoded)) and "%" not in decoded


def listing(manifest: Manifest, url: str) -> dict[str, FileInfo]:
    """The manifest's files (size, xxh3-128), checked: a stranger's manifest names no
    path outside the dataset."""
    out: dict[str, FileInfo] = {}
    for rel, meta in manifest.files.items():
        if not safe_rel(rel) or not isinstance(meta, dict):
            raise FormatError(f"{url}: the manifest lists {rel!r}, which is not a plain relative file path; "
                              f"refusing this dataset")
        size, digest = meta.get("bytes"), meta.get(DIGEST)
        if not (size is None or (isinstance(size, int) and size >= 0)) or not (
                digest is None or (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{32}", digest))):
            raise FormatError(f"{url}: the manifest's entry for {rel!r} has a bad size or checksum")
        out[rel] = (size, digest)
    return out


def _fetch_npy(store: Store, cache: Cache, vdir: Path, files: dict[str, FileInfo], name: str,
               shape: tuple[int, ...]) -> np.ndarray:
    """A small int64 array of the dataset, fetched (checked against the manifest) and loaded."""
    pin = cache.fetch(store, name, vdir, files[name])
    try:
        return limits.load_npy(vdir / name, "<i8", shape)
    finally:
        pin.release()


class ManifestWatch:
    """Whether the manifest at ``top`` is still the upload a reader opened (``version``)."""

    def __init__(self, top: Store, version: str) -> None:
        self.top, self.version = top, version

    def replaced(self) -> str | None:
        try:
            same = version(read_manifest(self.top)[0]) == self.version
        except FormatError:
            same = False  # gone
        return None if same else (f"{self.top}: the dataset was replaced at this URL while it was being read; "
                                  f"open it again to read the new one")


class RemoteTarReader(TarReader):
    """A :class:`TarReader` whose shards live at a URL: over :class:`RemoteShards`."""

    reads_batches = True  # a batch's members come by concurrent range reads
    streams = True  # plan(): shards fetched whole, in order, prefetched

    def __init__(self, vdir: Path, manifest: Manifest, index: np.ndarray, source: RemoteShards,
                 foreign: dict[int, tuple[str, int]] | None = None, name: str = "") -> None:
        super().__init__(vdir, manifest, index=index, foreign=foreign, source=source)
        self.source: RemoteShards = source
        self.name = name or str(source.store)
        self.files_at = source.store.url  # where the dataset's files lie (for packio info)

    @classmethod
    def open(cls, store: Store, cache: Cache, vdir: Path, manifest: Manifest, files: dict[str, FileInfo],
             prefetch: int, watch: ManifestWatch) -> "RemoteTarReader":
        names = manifest.extra.get("shards")
        if not isinstance(names, list) or not all(isinstance(n, str) and n in files for n in names):
            raise FormatError(f"{store}: the manifest's shard list is missing or names unlisted files; "
                              f"re-pack the dataset")
        if INDEX not in files:
            raise FormatError(f"{store}: the manifest does not list {INDEX}; re-pack the dataset")
        index = _fetch_npy(store, cache, vdir, files, INDEX, (manifest.count, 5))
        digests = _fetch_npy(store, cache, vdir, files, DIGESTS, (manifest.count,)) if DIGESTS in files else None
        sizes = np.asarray([files[n][0] if files[n][0] is not None else -1 for n in names], np.int64)
        if len(index) and (sizes >= 0).all() and len(index[:, 0]) and 0 <= index[:, 0].min() \
                and index[:, 0].max() < len(names):
            end = sizes[index[:, 0]]
            bad = (index[:, 1] < 0) | (index[:, 2] < 0) | (index[:, 1] + index[:, 2] > end) | (
                (index[:, 3] >= 0) & (index[:, 3] + index[:, 4] > end)) | (index[:, 4] < 0)
            if bad.any():
                raise FormatError(f"{store}: {INDEX} points past the end of its shards; re-pack the dataset")
        reader = cls(vdir, manifest, index, RemoteShards(store, cache, vdir, names, files, watch, prefetch))
        reader.digests = digests  # packed before packio kept them: each payload against its record only
        return reader

    def __str__(self) -> str:
        return self.name

    def plan(self, seq: np.ndarray) -> None:
        """Streaming: the source is told the shard of each sample ``seq`` reads, in order."""
        self._ensure_open()
        seq = np.asarray(seq, np.int64)
        self.source.plan(self.index[seq, 0] if len(seq) else np.zeros(0, np.int64))

    def fetch_all(self) -> dict[str, str]:
        return self.source.fetch_all()

    def _stored_id(self) -> str:
        """The cache folder is named by this manifest's digest: it holds this dataset and
        no other (a dataset replaced at the URL is the watch's to find)."""
        return self.manifest.id
