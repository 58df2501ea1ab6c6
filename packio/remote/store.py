"""The URL layer: one dataset location behind fsspec, with bounded waits and retries;
what differs per URL scheme comes from the table in :mod:`packio.remote.schemes`.

The filesystem object is made lazily in each process (fsspec's async clients are
not fork-safe: a DataLoader worker must not reuse its parent's), so a ``Store``
pickles into workers as its URL and options only. Every wait is bounded: connect
and read timeouts per request, and all retries of one request together stop after
``Retry.total`` seconds. Every message names the URL without its credentials or
query string (:func:`redact`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from packio.errors import (BucketNotFoundError, RangeNotSupportedError, RemoteAccessError, RemoteError,
                           RemoteNotFoundError, RemoteTimeoutError, RemoteUnreachableError, redact)
from packio.remote.schemes import CHUNK, read_upto, refused, scheme_of

__all__ = ["Retry", "Store", "redact"]

log = logging.getLogger("packio")
T = TypeVar("T")
EXTRA = "pip install 'packio[remote]'"

@dataclass(frozen=True)
class Retry:
    """Exponential backoff with jitter: at most ``attempts`` tries and ``total`` seconds
    for one request, tries included; waits of ``base`` · 2^k seconds capped at ``cap``.
    ``timeout``: seconds to connect, and seconds a read may wait for the next bytes."""

    attempts: int = 10
    base: float = 0.25
    cap: float = 2.0
    total: float = 30.0
    timeout: float = 10.0

    def delay(self, k: int) -> float:
        return min(self.cap, self.base * 2 ** k) * (0.5 + random.random() / 2)


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None) or getattr(exc, "code", None)  # aiohttp / http errors
    if not isinstance(status, int):
        status = getattr(exc, "response", {}).get("Error", {}).get("Code") if isinstance(
            getattr(exc, "response", None), dict) else None
        status = int(status) if isinstance(status, str) and status.isdigit() else None
    return status


def _kind(exc: BaseException) -> str:
    """``timeout``, ``unreachable``, ``range``, ``permanent`` or ``transient``."""
    name = type(exc).__name__
    text = str(exc)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)) or "Timeout" in name:
        return "timeout"
    if "support range" in text:
        return "range"
    if "Connect" in name or isinstance(exc, ConnectionRefusedError) or "Cannot connect" in text:
        return "unreachable"
    if isinstance(exc, (IsADirectoryError, NotADirectoryError, ValueError, TypeError, NotImplementedError,
                        ImportError)):
        return "permanent"
    status = _status(exc)
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
        return "permanent"
    return "transient"


_LIVE: "weakref.WeakSet[Store]" = weakref.WeakSet()
_INHERITED: list[Any] = []  # in a forked child: the parent's clients, kept unused and never closed


def _forget_parent_clients() -> None:
    """In a forked child: drop every store's client without closing or freeing it.

    A client made before the fork holds the parent's event loop, sockets and epoll
    instance, all shared with the child. Freeing it here runs fsspec's finalizer,
    which closes those sockets from the child: that unregisters them from the
    parent's epoll, and the parent's next read on them waits for its read timeout
    (forever without one: the fork hang of issue 29). Kept referenced, nothing
    touches them; the child makes its own client on first use."""
    for store in list(_LIVE):
        _INHERITED.extend(store.forget_client())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_clients)


class Store:
    """``url`` (a dataset folder or file) and everything below it."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, retry: Retry | None = None) -> None:
        self.url = url.rstrip("/")
        self.options = dict(storage_options or {})
        self.retry = retry or Retry()
        self.scheme = scheme_of(self.url)
        self._fs: tuple[int, Any, str] | None = None
        _LIVE.add(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _LIVE.add(self)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _fs=None)

    def __str__(self) -> str:
        return redact(self.url)

    def forget_client(self) -> list[Any]:
        """Drop this store's client unclosed (see :func:`_forget_parent_clients`); the
        client dropped, if any, for the caller to keep referenced."""
        fs, self._fs = self._fs, None
        return [] if fs is None else [fs[1]]

    def _client(self) -> tuple[Any, str]:
        if self._fs is None or self._fs[0] != os.getpid():
            try:
                import fsspec
            except ImportError:
                raise RemoteError(f"{self}: remote datasets need the remote extra: {EXTRA}") from None
            try:
                opts = self.scheme.options(self.options, self.retry.timeout)
                # skip_instance_cache: a client made before a fork holds the parent's event loop
                fs, root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **opts)
            except ImportError as exc:  # e.g. "Install s3fs to access S3"
                raise RemoteError(f"{self}: no client for this URL scheme ({redact(exc)}); {EXTRA}") from None
            except ValueError as exc:
                raise RemoteError(f"{self}: not a URL fsspec can open ({redact(exc)})") from None
            self._fs = (os.getpid(), fs, root.rstrip("/"))
        return self._fs[1], self._fs[2]

    def url_of(self, rel: str) -> str:
        """The URL of ``rel``, for messages: without credentials or query string."""
        return redact(f"{self.url}/{rel}" if rel else self.url)

    def _path(self, rel: str) -> str:
        root = self._client()[1]
        return f"{root}/{rel}" if rel else root

    def call(self, what: str, rel: str, fn: Callable[[Any, str], T]) -> T:
        """``fn(fs, path)`` with retries on transient errors, all within ``retry.total``
        seconds; failures become a ``RemoteError`` (a subclass per cause) naming the URL."""
        url = self.url_of(rel)
        deadline = time.monotonic() + self.retry.total
        for k in range(self.retry.attempts):
            try:
                fs, _ = self._client()
                return fn(fs, self._path(rel))
            except RemoteError:
                raise
            except FileNotFoundError as exc:
                cause = exc.__cause__  # fsspec's http client turns every failure into this
                if cause is not None and _status(cause) in (401, 403):
                    raise _error("permanent", what, url, cause, k + 1) from None
                if cause is not None and _kind(cause) in ("unreachable", "timeout"):
                    self._retry_or_raise(what, url, cause, k, deadline)
                    continue
                if "bucket" in str(exc).lower():
                    raise self._no_bucket(url) from None
                raise RemoteNotFoundError(f"{url}: not found (deleted, or never uploaded?)") from None
            except PermissionError:
                raise RemoteAccessError(f"{url}: access denied; check the credentials in your environment "
                                        f"(AWS_* variables, ~/.aws/credentials, ...) and the permissions") from None
            except Exception as exc:  # clients raise many unrelated types; classify, then retry or stop
                self._retry_or_raise(what, url, exc, k, deadline)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _no_bucket(self, url: str) -> BucketNotFoundError:
        from urllib.parse import urlsplit

        u = urlsplit(self.url)
        bucket = f"{u.scheme}://{u.hostname or ''}"
        return BucketNotFoundError(f"{url}: the bucket {bucket} does not exist; create it first, or check "
                                   f"its name")

    def _retry_or_raise(self, what: str, url: str, exc: BaseException, k: int, deadline: float) -> None:
        """Wait before try ``k + 2``, or raise when the error is permanent or time is up."""
        kind, wait = _kind(exc), self.retry.delay(k)
        last = k == self.retry.attempts - 1 or time.monotonic() + wait > deadline
        if kind in ("permanent", "range") or last:
            raise _error(kind, what, url, exc, k + 1) from None
        log.warning("packio: %s %s failed (%s); retrying in %.1f s", what, url, type(exc).__name__, wait)
        time.sleep(wait)

    def read(self, rel: str, limit: int) -> bytes:
        """A whole (small) object, at most ``limit`` bytes (else a ``RemoteError``)."""
        return self.call("read", rel, lambda fs, p: _read(fs, p, limit, self.url_of(rel)))

    def cat_ranges(self, rel: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        """Byte ranges ``[start, end)``, fetched concurrently where the client can; a
        server that ignores ``Range`` is a ``RangeNotSupportedError``, a cut transfer is
        retried (the scheme's range read tells them apart)."""
        if not rel:
            return []
        where = rel[0] if len(set(rel)) == 1 else ""

        def ranges(fs: Any, _: str) -> list[bytes]:
            paths, urls = [self._path(r) for r in rel], [self.url_of(r) for r in rel]
            one = self.scheme.range  # fsspec's http and s3fs cat_ranges read a whole body whatever its length
            if one is None:
                return fs.cat_ranges(paths, starts, ends, on_error="raise")
            return _bounded_ranges(one, fs, paths, starts, ends, urls)

        out = self.call("range read", where, ranges)
        for r, a, b, blob in zip(rel, starts, ends, out):
            if len(blob) != b - a:
                raise refused(self.url_of(r), b - a, a, len(blob))
        return out

    @property
    def http(self) -> bool:
        return self.scheme.name == "http"

    def get(self, rel: str, local: Path, limit: int | None) -> None:
        """Download ``rel`` to ``local``, streamed, at most ``limit`` bytes (a retry starts over)."""
        self.call("download", rel, lambda fs, p: _download(fs, p, local, limit, self.url_of(rel), self.scheme.stream))

    def put(self, local: Path, rel: str) -> None:
        """Upload a file (the client uses multipart uploads for large files where the store has them)."""
        self.call("upload", rel, lambda fs, p: fs.put_file(str(local), p))

    def put_bytes(self, data: bytes, rel: str, create: bool = False) -> None:
        """Upload ``data``; ``create``: only if no object is there (the scheme's exclusive
        create: S3 ``If-None-Match``), what an upload's lock is taken with."""
        if create:
            self.call("upload", rel, lambda fs, p: self.scheme.create(fs, p, data))
        else:
            self.call("upload", rel, lambda fs, p: fs.pipe_file(p, data))

    def check_bucket(self) -> None:
        """S3: a missing bucket is a ``BucketNotFoundError`` before anything is written
        (the scheme's cheap listing; schemes without buckets have nothing to check)."""
        probe = self.scheme.probe
        if probe is not None:
            self.call("list", "", probe)

    def exists(self, rel: str) -> bool:
        return self.call("stat", rel, lambda fs, p: fs.exists(p))

    def info(self, rel: str) -> dict[str, Any]:
        return self.call("stat", rel, lambda fs, p: fs.info(p))

    def delete(self, rel: str) -> None:
        self.call("delete", rel, lambda fs, p: fs.rm_file(p))

    def listing(self, rel: str) -> list[str]:
        """Paths below ``rel`` (recursive), relative to this store's URL."""
        root = self._client()[1]
        found = self.call("list", rel, lambda fs, p: fs.find(p))
        return [f[len(root) + 1:] for f in found if f.startswith(root + "/")]


def _error(kind: str, what: str, url: str, exc: BaseException, tries: int) -> RemoteError:
    after = f" after {tries} tries" if tries > 1 else ""
    detail = redact(str(exc).splitlines()[0]) if str(exc) else ""
    if kind == "timeout":
        return RemoteTimeoutError(f"{url}: {what} timed out{after}: the server stopped answering; "
                                  f"retry later, or raise timeout= / retries=")
    if kind == "unreachable":
        return RemoteUnreachableError(f"{url}: {what} failed{after}: cannot connect to the server "
                                      f"({type(exc).__name__}); check the host and port, and that it is up")
    if kind == "range":
        return RangeNotSupportedError(f"{url}: the server does not honour byte ranges; serve the dataset from a "
                                      f"server that does")
    if _status(exc) in (401, 403):
        return RemoteAccessError(f"{url}: access denied (HTTP {_status(exc)}); check the credentials")
    return RemoteError(f"{url}: {what} failed{after} ({type(exc).__name__}: {detail})")


def _read(fs: Any, path: str, limit: int, url: str) -> bytes:
    with fs.open(path, "rb", cache_type="none") as f:
        chunks, total = read_upto(f.read, limit + 1, keep=True)
    if total <= limit:
        return b"".join(chunks)
    raise RemoteError(f"{url}: larger than packio's limit of {limit} bytes for this file; not a packio "
                      f"dataset, or raise the limit in packio.limits")


def _download(fs: Any, path: str, local: Path, limit: int | None, url: str, stream: dict[str, Any]) -> None:
    total = 0
    kw: dict[str, Any] = {} if limit is None else {"size": limit}  # no HEAD request: the manifest gave the size
    with fs.open(path, "rb", cache_type="none", **kw, **stream) as f, open(local, "wb") as out:
        while True:
            b = f.read(CHUNK if limit is None else min(CHUNK, limit + 1 - total))
            if not b:
                return
            out.write(b)
            total += len(b)
            if limit is not None and total > limit:
                raise RemoteError(f"{url}: the server sent more than the manifest's {limit} bytes; the object "
                                  f"was replaced or the server is broken")


def _bounded_ranges(one: Callable[..., bytes], fs: Any, paths: list[str], starts: list[int], ends: list[int],
                    urls: list[str]) -> list[bytes]:
    """``one(fs, path, start, end, url)`` for each range, 8 at a time."""
    if len(paths) == 1:
        return [one(fs, paths[0], starts[0], ends[0], urls[0])]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(8, len(paths)), thread_name_prefix="packio-range") as pool:
        return list(pool.map(lambda k: one(fs, paths[k], starts[k], ends[k], urls[k]), range(len(paths))))
