"""Packed datasets in object storage and over HTTP (``pip install 'packio[remote]'``).

Any fsspec URL opens like a local path: ``s3://`` (through s3fs), ``gs://``,
``az://``, ``http(s)://``, ... Tar shards stream shard by shard through a local
cache (map-style reads fetch single members by range); the other formats are
cached whole. ``convert(src, "s3://bucket/ds.tar")`` uploads shards as they are
finished and the manifest last. Credentials come from the client library's own
standard sources (``AWS_*`` variables, ``~/.aws``, ...), never from packio files.

Only :func:`is_url` is light; the rest imports fsspec on first use.
"""

from __future__ import annotations

import re
from typing import Any

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(path: Any) -> bool:
    """True for ``scheme://...`` strings (a ``pathlib.Path`` is always local)."""
    return isinstance(path, str) and _URL.match(path) is not None


def open_url(url: str, **kwargs: Any) -> Any:
    """A reader for the packed dataset at ``url``; see :func:`packio.remote.reader.open_url`."""
    from packio.remote.reader import open_url as _open

    return _open(url, **kwargs)


__all__ = ["is_url", "open_url"]
