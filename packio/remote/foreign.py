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
:class:`~packio.remote.reader.RemoteTarReader` (whole shards, prefetched, pinned while
in use); a shard evicted and fetched again must match the digest taken at open.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from packio.errors import FormatError
from packio.formats.tar import TarReader, expand_pattern, gather, scan_shard
from packio.manifest import Manifest, file_digest
from packio.remote.cache import Cache, FileInfo
from packio.remote.reader import RemoteTarReader, _safe_rel, identity, settings
from packio.remote.store import Store, redact
from packio.sample import Sample

__all__ = ["ForeignTarReader", "open_foreign"]

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
    bad = next((n for n in names if not _safe_rel(n)), None)
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
                 timeout: float = 10.0, retry_seconds: float = 30.0) -> "ForeignTarReader":
    """A reader for the foreign shards ``pattern`` names (see the module's docstring);
    the options are :func:`packio.remote.reader.open_url`'s."""
    import xxhash

    cache, retry = settings(cache_dir, cache_limit, retries, timeout, retry_seconds)
    base, names = _split(pattern)
    store = Store(base, storage_options, retry)
    with ThreadPoolExecutor(min(_THREADS, len(names)), thread_name_prefix="packio-fetch") as pool:
        ids = list(pool.map(lambda n: identity(store, cache, n), names))
        version = xxhash.xxh3_128_hexdigest(json.dumps([names, [i[:2] for i in ids]]).encode())[:16]
        vdir = cache.version_dir(redact(pattern), version)
        scans = list(pool.map(lambda k: _scan(store, cache, vdir, names[k], k, *ids[k][::2]), range(len(names))))
    index, foreign, classes = gather([s for s, _ in scans])
    files: dict[str, FileInfo] = {n: (ids[k][0], scans[k][1]) for k, n in enumerate(names)}
    manifest = Manifest(format="tar", count=len(index), classes=classes,
                        source={"path": redact(pattern), "foreign": True}, extra={"shards": names})
    reader = ForeignTarReader(store, cache, vdir, manifest, files, index, prefetch)
    reader.foreign, reader.pattern = foreign, redact(pattern)
    return reader


class ForeignTarReader(RemoteTarReader):
    """Foreign shards at a URL: read whole through the cache, each checked against the
    digest taken at open (no single-member range reads: nothing could check them)."""

    pattern = ""

    def __str__(self) -> str:
        return self.pattern

    def _stash(self, indices: list[int]) -> None:
        return  # map-style reads fetch (and check) whole shards

    def _checked(self, i: int) -> Sample:
        return TarReader.read(self, i)  # the shard's digest checked its bytes; a stranger's json has no checksum
