"""packio's exceptions (every message says what went wrong, where, and what to do), and
the two helpers every message and every edge share about locations: :func:`redact`
(what a message may print of a URL) and :func:`is_url` (the one test for a URL)."""

from __future__ import annotations

import re

__all__ = ["PackioError", "SourceError", "OutputExistsError", "OutputBusyError", "FormatError", "DatasetReplacedError",
           "CorruptSampleError", "StateError", "RemoteError", "RemoteUnreachableError", "RemoteTimeoutError",
           "RemoteAccessError", "RemoteNotFoundError", "BucketNotFoundError", "RangeNotSupportedError", "is_url",
           "redact"]


class PackioError(Exception):
    """Base class of every error packio raises on purpose."""


class SourceError(PackioError):
    """The input folder, an input file or the CSV cannot be used."""


class OutputExistsError(PackioError):
    """The output path exists and ``overwrite`` was not asked for."""


class OutputBusyError(PackioError):
    """Another conversion holds the lock on the same output path."""


class FormatError(PackioError):
    """A packed dataset is missing, malformed, or of an unknown format."""


class DatasetReplacedError(FormatError):
    """The dataset a reader opened was replaced on disk (e.g. ``convert --overwrite``)."""


class CorruptSampleError(PackioError):
    """One stored sample cannot be read back (bad record, bad bytes, checksum mismatch)."""

    def __init__(self, key: str, reason: str | None = None) -> None:
        # One-argument form: a ready message (how DataLoader workers and pickling re-raise it).
        super().__init__(key if reason is None else f"sample {key!r} is corrupt: {reason}")
        self.key = key
        self.reason = reason or key

    def __reduce__(self) -> tuple:
        return (CorruptSampleError, (str(self),))


class StateError(PackioError, ValueError):
    """A resume state that cannot continue this dataset or sampler exactly."""


class RemoteError(PackioError):
    """A remote dataset (s3://, https://, ...) cannot be read or written: missing
    object, checksum mismatch, the store unreachable after retries, or no client."""


class RemoteUnreachableError(RemoteError):
    """The server of a URL did not accept connections (wrong host or port, or down) after retries."""


class RemoteTimeoutError(RemoteError):
    """The server of a URL stopped answering within the timeout, after retries."""


class RemoteAccessError(RemoteError):
    """The store refused the request (HTTP 401/403): credentials or permissions."""


class RemoteNotFoundError(RemoteError):
    """The object or bucket named by a URL does not exist."""


class BucketNotFoundError(RemoteNotFoundError):
    """The bucket (container) named by a URL does not exist: create it first."""


class RangeNotSupportedError(RemoteError):
    """The server ignored a byte-range request (answered 200 with the whole object)."""


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^/\s@'\"]*@")
_QUERY = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://[^\s'\"?#]*)[?#][^\s'\"]*")


def redact(text: object) -> str:
    """``text`` with every URL's user name, password, query string and fragment removed
    (signed URLs carry their tokens in the query): what messages may print."""
    return _QUERY.sub(r"\1", _USERINFO.sub(r"\1", str(text)))


def is_url(path: object) -> bool:
    """True for ``scheme://...`` strings (a ``pathlib.Path`` is always local)."""
    return isinstance(path, str) and _URL.match(path) is not None
