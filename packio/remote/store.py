"""The URL layer: one dataset location behind fsspec, with bounded retries.

The filesystem object is made lazily in each process (fsspec's async clients are
not fork-safe: a DataLoader worker must not reuse its parent's), so a ``Store``
pickles into workers as its URL and options only.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from packio.errors import RemoteError

__all__ = ["Retry", "Store"]

log = logging.getLogger("packio")
T = TypeVar("T")
EXTRA = "pip install 'packio[remote]'"


@dataclass(frozen=True)
class Retry:
    """Exponential backoff with jitter: ``attempts`` tries in all, waits of ``base`` ·
    2^k seconds capped at ``cap`` (the defaults ride out an outage of ~30 s and notice
    the store is back within ~2 s)."""

    attempts: int = 10
    base: float = 0.25
    cap: float = 2.0

    def delay(self, k: int) -> float:
        return min(self.cap, self.base * 2 ** k) * (0.5 + random.random() / 2)


def _permanent(exc: BaseException) -> bool:
    """Errors a retry cannot fix: missing objects, refused credentials, bad requests."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                        ValueError, TypeError, NotImplementedError, ImportError)):
        return True
    status = getattr(exc, "status", None) or getattr(exc, "code", None)  # aiohttp / http errors
    return isinstance(status, int) and 400 <= status < 500 and status not in (408, 429)


def _defaults(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """s3: botocore's own retries kept short (this module retries with backoff), unless
    the user set them (``config_kwargs``, ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE``)."""
    if not url.startswith(("s3://", "s3a://")) or "config_kwargs" in options or \
            "AWS_MAX_ATTEMPTS" in os.environ or "AWS_RETRY_MODE" in os.environ:
        return options
    return {**options, "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 10}}


class Store:
    """``url`` (a dataset folder or file) and everything below it."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, retry: Retry | None = None) -> None:
        self.url = url.rstrip("/")
        self.options = dict(storage_options or {})
        self.retry = retry or Retry()
        self._fs: tuple[int, Any, str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _fs=None)

    def _client(self) -> tuple[Any, str]:
        if self._fs is None or self._fs[0] != os.getpid():
            try:
                import fsspec
            except ImportError:
                raise RemoteError(f"{self.url}: remote datasets need the remote extra: {EXTRA}") from None
            try:
                fs, root = fsspec.core.url_to_fs(self.url, **_defaults(self.url, self.options))
            except ImportError as exc:  # e.g. "Install s3fs to access S3"
                raise RemoteError(f"{self.url}: no client for this URL scheme ({exc}); {EXTRA}") from None
            except ValueError as exc:
                raise RemoteError(f"{self.url}: not a URL fsspec can open ({exc})") from None
            self._fs = (os.getpid(), fs, root.rstrip("/"))
        return self._fs[1], self._fs[2]

    def url_of(self, rel: str) -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def _path(self, rel: str) -> str:
        root = self._client()[1]
        return f"{root}/{rel}" if rel else root

    def call(self, what: str, rel: str, fn: Callable[[Any, str], T]) -> T:
        """``fn(fs, path)`` with retries on transient errors; failures become a
        ``RemoteError`` that names the URL."""
        url = self.url_of(rel)
        for k in range(self.retry.attempts):
            try:
                fs, _ = self._client()
                return fn(fs, self._path(rel))
            except RemoteError:
                raise
            except FileNotFoundError as exc:
                raise RemoteError(f"{url}: not found (deleted, or never uploaded?)"
                                  + ("" if rel else f" ({exc})")) from None
            except PermissionError as exc:
                raise RemoteError(f"{url}: access denied ({exc}); check the credentials in your environment "
                                  f"(AWS_* variables, ~/.aws/credentials, ...)") from None
            except Exception as exc:  # clients raise many unrelated types; classify, then retry or stop
                if _permanent(exc) or k == self.retry.attempts - 1:
                    tries = "" if _permanent(exc) else f" after {self.retry.attempts} tries"
                    raise RemoteError(f"{url}: {what} failed{tries} ({type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
                wait = self.retry.delay(k)
                log.warning("packio: %s %s failed (%s); retrying in %.1f s", what, url, type(exc).__name__, wait)
                time.sleep(wait)
        raise AssertionError("unreachable")  # the loop returns or raises

    def cat(self, rel: str) -> bytes:
        """A whole (small) object in one request (``start=0``: s3fs asks for the size first otherwise)."""
        return self.call("read", rel, lambda fs, p: fs.cat_file(p, start=0))

    def cat_ranges(self, rel: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
        """Byte ranges ``[start, end)``, fetched concurrently where the client can."""
        if not rel:
            return []
        where = rel[0] if len(set(rel)) == 1 else ""
        return self.call("range read", where,
                         lambda fs, _: fs.cat_ranges([self._path(r) for r in rel], starts, ends, on_error="raise"))

    def get(self, rel: str, local: Path) -> None:
        """Download ``rel`` to ``local`` (streamed; a retry starts the file over)."""
        self.call("download", rel, lambda fs, p: fs.get_file(p, str(local)))

    def put(self, local: Path, rel: str) -> None:
        """Upload a file (the client uses multipart uploads for large files where the store has them)."""
        self.call("upload", rel, lambda fs, p: fs.put_file(str(local), p))

    def put_bytes(self, data: bytes, rel: str) -> None:
        self.call("upload", rel, lambda fs, p: fs.pipe_file(p, data))

    def exists(self, rel: str) -> bool:
        return self.call("stat", rel, lambda fs, p: fs.exists(p))

    def size(self, rel: str) -> int:
        return int(self.call("stat", rel, lambda fs, p: fs.size(p)))

    def delete(self, rel: str) -> None:
        self.call("delete", rel, lambda fs, p: fs.rm_file(p))
