"""Packed datasets in object storage and over HTTP (``pip install 'packio[remote]'``).

Any fsspec URL opens like a local path: ``s3://`` (through s3fs), ``gs://``,
``az://``, ``http(s)://``, ... Tar shards stream shard by shard through a local
cache (map-style reads fetch single members by range); the other formats are
cached whole. ``convert(src, "s3://bucket/ds.wds")`` uploads shards as they are
finished and the manifest last. Tar shards written by other tools open by a brace
pattern (``https://host/d/shard-{000000..000099}.tar``) or one ``.tar`` URL.
Credentials come from the client library's own standard sources (``AWS_*``
variables, ``~/.aws``, ...), never from packio files.

Only :func:`is_url` is light; the rest imports fsspec on first use.
"""

from __future__ import annotations

import re
from typing import Any

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(path: Any) -> bool:
    """True for ``scheme://...`` strings (a ``pathlib.Path`` is always local)."""
    return isinstance(path, str) and _URL.match(path) is not None


def is_foreign(url: Any) -> bool:
    """A URL of tar shards another tool wrote: a brace pattern, or one ``.tar`` (packio
    never names a dataset ``*.tar``)."""
    return is_url(url) and ("{" in url or re.split(r"[?#]", url)[0].rstrip("/").lower().endswith(".tar"))


def open_url(url: str, **kwargs: Any) -> Any:
    """A reader for the packed dataset at ``url`` (see :func:`packio.remote.reader.open_url`),
    or for tar shards another tool wrote: a brace pattern or one ``.tar`` URL, no
    ``packio.json`` (see :mod:`packio.remote.foreign`)."""
    if is_foreign(url):
        from packio.remote.foreign import open_foreign

        return open_foreign(url.rstrip("/"), **kwargs)
    from packio.remote.reader import open_url as _open

    return _open(url, **kwargs)


__all__ = ["is_foreign", "is_url", "open_url"]
