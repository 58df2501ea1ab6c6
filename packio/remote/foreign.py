"""Tar shards written by other tools (``webdataset.TarWriter``, ``tar``) at a URL, with no
``packio.json``: ``https://host/path/shard-{000000..000099}.tar`` or one ``.tar`` URL.

A foreign shard says nothing of what it holds until it is read, and an exact resume
(and an even split over ranks) needs every shard's sample count. So at open every
shard is downloaded once into the cache (a HEAD first gives its size, which bounds the
download, and its ETag / modification time, which name the cache version), scanned
for its members as local foreign shards are, and digested. A server that gives neither
ETag nor modification time has every shard downloaded at each open to learn its digest,
which then names the cache version (packio cannot otherwise tell a replaced shard of the
same size from an unchanged one). Reading then goes through
:class:`~packio.remote.reader.RemoteTarReader` over shards read whole (prefetched,
pinned while in use); a shard evicted and fetched again must match the digest taken at
open, and when it does not, its size and ETag / modification time tell a replaced
shard (``DatasetReplacedError``) from a corrupt transfer.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from packio.errors import FormatError, RemoteNotFoundError
from packio.formats.tar import expand_pattern, gather, scan_shard
from packio.manifest import Manifest, file_digest
from packio.remote.cache import Cache, FileInfo
from packio.remote.reader import RemoteTarReader, identity, safe_rel, settings, version
from packio.remote.shards import RemoteShards
from packio.remote.store import Store, redact

__all__ = ["ShardsWatch", "open_foreign"]

_THREADS = 8  # concurrent HEADs / downloads at open


def _split(pattern: str) -> tuple[str, list[str]]:
    """The folder URL before the first brace, and the shard names below it."""
    if "?" in pattern or "#" in pattern:
        raise FormatError(f"{redact(pattern)}: a shard pattern with a query string or fragment; packio "
                          f"cannot tell which shard it belongs to (give credentials through storage_options)")
    prefix, names = expand_pattern(pattern)
    u = urlsplit(prefix)
    if not u.netloc or pattern.split("{", 1)[0].count("/") < 3:
        raise FormatError(f"{redact(pattern)}: braces may name shards only after the host "
                          f"(scheme://host/folder/shard-{{000000..000099}}.tar)")
    bad = next((n for n in names if not safe_rel(n)), None)
    if bad is not None:
        raise FormatError(f"{redact(pattern)}: names {redact(bad)!r}, not a plain path below the pattern's "
                          f"folder; refusing it")
    return prefix.rstrip("/"), names


def _scan(store: Store, cache: Cache, vdir: Path, name: str, k: int, size: int, digest: str | None
          ) -> tuple[tuple[np.ndarray, list[str], list[int]], str]:
    """Download one shard into the cache (pinned meanwhile), scan it, digest it."""
    pin = cache.fetch(store, name, vdir, (size, digest))
    try:
        try:
            return scan_shard(vdir / name, k, strict=False), file_digest(vdir / name)
        except FormatError as exc:  # name the URL, not the cache file
            raise FormatError(str(exc).replace(str(vdir / name), store.url_of(name))) from None
    finally:
        pin.release()


def open_foreign(pattern: str, *, cache_dir: str | Path | None = None, cache_limit: int | str | None = None,
                 storage_options: dict[str, Any] | None = None, prefetch: int = 2, retries: int = 10,
                 timeout: float = 10.0, retry_seconds: float = 30.0) -> RemoteTarReader:
    """A reader for the foreign shards ``pattern`` names (see the module's docstring);
    the options are :func:`packio.remote.reader.open_url`'s."""
    cache, retry = settings(cache_dir, cache_limit, retries, timeout, retry_seconds)
    base, names = _split(pattern)
    store = Store(base, storage_options, retry)
    with ThreadPoolExecutor(min(_THREADS, len(names)), thread_name_prefix="packio-fetch") as pool:
        ids = list(pool.map(lambda n: identity(store, cache, n), names))
        vdir = cache.version_dir(redact(pattern), version(json.dumps([names, [i[:2] for i in ids]]).encode()))
        scans = list(pool.map(lambda k: _scan(store, cache, vdir, names[k], k, *ids[k][::2]), range(len(names))))
    index, foreign, classes = gather([s for s, _ in scans])
    files: dict[str, FileInfo] = {n: (ids[k][0], scans[k][1]) for k, n in enumerate(names)}
    manifest = Manifest(format="tar", count=len(index), classes=classes,
                        source={"path": redact(pattern), "foreign": True}, extra={"shards": names})
    watch = ShardsWatch(store, cache, names, [i[:2] for i in ids])
    source = RemoteShards(store, cache, vdir, names, files, watch, prefetch, ranges=False)
    return RemoteTarReader(vdir, manifest, index, source, foreign=foreign, name=redact(pattern))


class ShardsWatch:
    """Whether each shard at the URL still has the size and ETag / modification time
    (or content digest) it had when the shards were opened."""

    def __init__(self, store: Store, cache: Cache, names: list[str], ids: list[tuple[int, list[str]]]) -> None:
        self.store, self.cache, self.names, self.ids = store, cache, names, ids

    def replaced(self) -> str | None:
        for name, was in zip(self.names, self.ids):
            try:
                now = identity(self.store, self.cache, name)[:2]
            except RemoteNotFoundError:
                now = None
            if now != tuple(was):
                return (f"{self.store.url_of(name)} was replaced or removed after these shards were opened (its "
                        f"size or ETag changed); open them again")
        return None
