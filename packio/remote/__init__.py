"""Packed datasets in object storage and over HTTP (``pip install 'packio[remote]'``).

Any fsspec URL opens like a local path: ``s3://`` (through s3fs), ``gs://``,
``az://``, ``http(s)://``, ... Tar shards stream shard by shard through a local
cache (map-style reads fetch single members by range); the other formats are
cached whole. ``convert(src, "s3://bucket/ds.wds")`` uploads shards as they are
finished and the manifest last. Tar shards written by other tools open by a brace
pattern (``https://host/d/shard-{000000..000099}.tar``) or one ``.tar`` URL.
Credentials come from the client library's own standard sources (``AWS_*``
variables, ``~/.aws``, ...), never from packio files.

Importing this package is light; fsspec is imported on first use. URLs are resolved
by :mod:`packio.api` alone, which calls :func:`open_url` and :func:`describe_url`.
"""

from __future__ import annotations

import re
from typing import Any

from packio.errors import is_url


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
    from packio.remote.reader import open_url as open_packed

    return open_packed(url, **kwargs)


def describe_url(url: str, **kwargs: Any) -> tuple[Any, int, str]:
    """What ``packio info`` shows of the dataset at ``url``: its manifest, the bytes it
    holds, and the URL its files lie under (an upload's ``v-VERSION/`` folder; for shards
    another tool wrote, the pattern's folder). A packed dataset's manifest alone is read;
    foreign shards are opened (read once into the cache) to count their samples; one-file
    datasets (HDF5) are cached whole."""
    if is_foreign(url):
        reader = open_url(url, **kwargs)
        return reader.manifest, sum(size or 0 for size, _ in reader.source.files.values()), reader.files_at
    from packio.remote.reader import describe_packed

    return describe_packed(url, **kwargs)


__all__ = ["describe_url", "is_foreign", "is_url", "open_url"]
