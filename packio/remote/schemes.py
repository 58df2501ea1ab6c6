"""What differs between the kinds of store a URL names: one :class:`Scheme` per URL
scheme in :data:`SCHEMES` (any other scheme gets :data:`OTHER`: fsspec's defaults).
:class:`~packio.remote.store.Store` looks its scheme up once and never branches on it.

Each entry says how to *open* a client (timeouts and retries packio sets unless the
user did), how to *range-read* (one bounded request per range: read at most one byte
more than asked, a refusal told from a cut transfer), how to *stream* a download, how
to *list* cheaply (a missing bucket found before anything is written), and how to take
the *lock* an upload holds (an exclusive create: write only if nothing is there).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

from packio.errors import RangeNotSupportedError

__all__ = ["CHUNK", "OTHER", "SCHEMES", "CutTransfer", "Scheme", "read_upto", "refused", "scheme_of"]

CHUNK = 4 << 20  # bytes per streamed read


class CutTransfer(Exception):
    """A body that ended before the bytes it was to carry: a transient failure, retried
    like a dropped connection (whatever the response's status)."""


@dataclass(frozen=True)
class Scheme:
    """How packio talks to one kind of store."""

    name: str
    options: Callable[[dict[str, Any], float], dict[str, Any]]  # open: the client's options, given a timeout
    range: Callable[[Any, str, int, int, str], bytes] | None  # range-read (fs, path, start, end, url); None: fsspec's
    stream: dict[str, Any]  # stream: fs.open keywords for one streamed download
    probe: Callable[[Any, str], None] | None  # list: one cheap listing at a path (None: nothing to check)
    create: Callable[[Any, str, bytes], None]  # lock: write ``data`` only if no object is there


def refused(url: str, want: int, start: int, got: object) -> RangeNotSupportedError:
    return RangeNotSupportedError(f"{url}: asked for {want} bytes at {start}, got {got}: the server does not "
                                  f"honour byte ranges; serve the dataset from a server that does, or read it as "
                                  f"a stream (iterable=True)")


def read_upto(read: Callable[[int], bytes], limit: int, keep: bool) -> tuple[list[bytes], int]:
    """Chunks of a body until it ends or ``limit`` bytes came (``keep``: kept, else only counted)."""
    chunks, got = [], 0
    while got < limit:
        b = read(min(CHUNK, limit - got))
        if not b:
            break
        if keep:
            chunks.append(b)
        got += len(b)
    return chunks, got


def _http_options(options: dict[str, Any], timeout: float) -> dict[str, Any]:
    if "client_kwargs" in options:
        return options
    import aiohttp

    t = aiohttp.ClientTimeout(total=None, connect=timeout, sock_connect=timeout, sock_read=timeout)
    return {**options, "client_kwargs": {"timeout": t}}


def _http_range(fs: Any, path: str, start: int, end: int, url: str) -> bytes:
    """Bytes ``[start, end)`` by one ``Range`` request. A 206 is read to one byte past the
    range (a longer body is refused). A 200 is the whole object: it is read on to its end
    (its declared length; without one, to the range's end), and only a complete one is a
    refusal; one cut short is a :class:`CutTransfer`, retried. (A 200 for a range from
    byte 0 of the object's length is that range.)"""
    want = end - start
    if want <= 0:
        return b""
    headers = {**dict(getattr(fs, "kwargs", {}).get("headers") or {}), "Range": f"bytes={start}-{end - 1}"}
    with fs.open(path, "rb", block_size=0, size=want, headers=headers) as f:
        r = getattr(f, "r", None)
        length = getattr(r, "content_length", None)
        if getattr(r, "status", 206) == 206 or (start == 0 and length in (None, want)):  # the bytes asked for
            chunks, got = read_upto(f.read, want + 1, keep=True)
        else:  # the whole object, from its first byte
            whole = read_upto(f.read, length if isinstance(length, int) else end, keep=False)[1]
            if isinstance(length, int) and whole < length:
                raise CutTransfer(f"a 200 answer ended after {whole} of its {length} bytes")
            raise refused(url, want, start, "the whole file")
    if got > want:
        raise refused(url, want, start, "more")
    if got < want:
        raise CutTransfer(f"a 206 answer ended after {got} of {want} bytes")
    return b"".join(chunks)


def _s3_options(options: dict[str, Any], timeout: float) -> dict[str, Any]:
    """botocore's own retries kept to one try (the store retries with backoff), unless set."""
    if "config_kwargs" in options or "AWS_MAX_ATTEMPTS" in os.environ or "AWS_RETRY_MODE" in os.environ:
        return options
    return {**options, "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"},
                                         "connect_timeout": timeout, "read_timeout": timeout}}


def _s3_range(fs: Any, path: str, start: int, end: int, url: str) -> bytes:
    """Bytes ``[start, end)`` by one S3 GET with ``Range``: a response whose length is not
    the range's (a whole object, a longer body) is refused from its header, and the body
    is read at most one byte past what was asked, never buffered whole; one that ends
    early is a :class:`CutTransfer`, retried."""
    from fsspec.asyn import sync

    want = end - start
    if want <= 0:
        return b""
    bucket, key, version = fs.split_path(path)
    resp = fs.call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                      **({"VersionId": version} if version else {}))
    body = resp["Body"]
    try:
        length = resp.get("ContentLength")
        if isinstance(length, int) and length != want:
            raise refused(url, want, start, "more" if length > want else length)
        chunks, got = read_upto(lambda n: sync(fs.loop, body.read, n), want + 1, keep=True)
    finally:
        body.close()  # an unread rest is dropped with its connection
    if got > want:
        raise refused(url, want, start, "more")
    if got < want:
        raise CutTransfer(f"the answer ended after {got} of {want} bytes")
    return b"".join(chunks)


def _s3_probe(fs: Any, path: str) -> None:
    """One list of at most one key, with the permission uploads need (a missing bucket
    is found here: some servers, SeaweedFS among them, would make one on the first write)."""
    bucket, key, _ = fs.split_path(path)
    fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{key}/" if key else "", MaxKeys=1)


def _create(fs: Any, path: str, data: bytes) -> None:
    fs.pipe_file(path, data, mode="create")  # S3: If-None-Match: *; fsspec's local files: O_EXCL


def _keep(options: dict[str, Any], timeout: float) -> dict[str, Any]:
    return options


HTTP = Scheme("http", _http_options, _http_range, {"block_size": 0}, None, _create)  # block_size 0: one streamed GET
S3 = Scheme("s3", _s3_options, _s3_range, {}, _s3_probe, _create)
OTHER = Scheme("other", _keep, None, {}, None, _create)
SCHEMES: dict[str, Scheme] = {"http": HTTP, "https": HTTP, "s3": S3, "s3a": S3}


def scheme_of(url: str) -> Scheme:
    """The table's entry for ``url``'s scheme (:data:`OTHER` for one it does not name)."""
    return SCHEMES.get(urlsplit(url).scheme.lower(), OTHER)
