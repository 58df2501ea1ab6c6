"""The one public edge that resolves paths and URLs: :func:`open_dataset`,
:func:`open_reader`, :func:`convert`, :func:`verify` (and, for the mix and ``packio
info``, :func:`mix` and :func:`describe`). A URL goes to :mod:`packio.remote` here and
nowhere else: the formats, the read pipeline, the converter and the verifier only
ever see local paths and opened readers. Heavy modules load on first use (``import
packio`` and the CLI stay light)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from packio.errors import PackioError, SourceError, is_url, redact

__all__ = ["convert", "describe", "mix", "open_dataset", "open_reader", "verify"]


def open_reader(path: Any, **remote: Any) -> Any:
    """A reader for a packed dataset at a local path or a URL (or a reader, as it is);
    ``remote``: the options of :func:`packio.remote.reader.open_url` (``cache_dir``,
    ``cache_limit``, ``storage_options``, ``prefetch``, ``retries``, ``timeout``,
    ``retry_seconds``)."""
    if is_url(path):
        from packio.remote import open_url

        return open_url(path, **remote)
    from packio.formats import open_reader as open_local

    return open_local(path)


def open_dataset(path: Any, *, iterable: bool = False, options: Any = None, cache_dir: str | Path | None = None,
                 cache_limit: int | str | None = None, storage_options: dict[str, Any] | None = None,
                 retries: int = 10, timeout: float = 10.0, retry_seconds: float = 30.0, **kwargs: Any) -> Any:
    """Open any packed dataset (the format comes from its manifest) as a
    :class:`~packio.read.datasets.PackedDataset`, or with ``iterable=True`` a
    :class:`~packio.read.datasets.PackedIterableDataset`; ``options`` and ``kwargs`` go to
    that class. A URL (``s3://``, ``https://``, any fsspec URL) reads through a local
    cache: ``cache_dir``, ``cache_limit``, ``storage_options``, ``retries``, ``timeout``
    and ``retry_seconds`` are :func:`packio.remote.reader.open_url`'s."""
    from packio.read.datasets import PackedDataset, PackedIterableDataset

    cls = PackedIterableDataset if iterable else PackedDataset
    if not is_url(path):
        return cls(path, options=options, **kwargs)
    reader = open_reader(path, cache_dir=cache_dir, cache_limit=cache_limit, storage_options=storage_options,
                         retries=retries, timeout=timeout, retry_seconds=retry_seconds)
    ds = cls(reader, options=options, **kwargs)
    ds.path = str(path)
    return ds


_REMOTE_OPTIONS = ("cache_dir", "cache_limit", "storage_options", "prefetch", "retries", "timeout", "retry_seconds")


def mix(sources: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
    """:func:`packio.read.mix.mix`, a source given as a URL opened here first (its reader
    read with the mix's decode options; ``cache_dir``, ``cache_limit``, ``storage_options``,
    ``prefetch``, ``retries``, ``timeout`` and ``retry_seconds`` open it, as in
    :func:`open_dataset`)."""
    from packio.read.mix import mix as mix_sources

    remote = {k: kwargs.pop(k) for k in _REMOTE_OPTIONS if k in kwargs}
    return mix_sources([open_reader(s, **remote) if is_url(s) else s for s in sources], *args, **kwargs)


def convert(src: Any, dst: str | Path, *args: Any, storage_options: dict[str, Any] | None = None,
            tmp_dir: str | Path | None = None, **kwargs: Any) -> Any:
    """:func:`packio.pack.convert`; to a URL: packed into a local staging folder,
    then uploaded (files first, the manifest last; see :mod:`packio.remote.upload`).
    From a URL (a packed dataset, or foreign tar shards by a brace pattern): read
    through the cache (default options; ``storage_options`` apply to both URLs)."""
    from packio.pack import convert as convert_local

    src = _source(src)
    if is_url(src):
        src = open_reader(str(src), storage_options=storage_options)
    if not is_url(dst):
        return convert_local(src, dst, *args, **kwargs)
    if kwargs.get("append"):
        raise PackioError(f"{redact(str(dst))}: appending to a URL is not supported (an upload replaces every file "
                          f"of the dataset); append to a local copy, then upload it with "
                          f"'packio convert LOCAL URL --overwrite'")
    from packio.remote.upload import convert_to_url

    return convert_to_url(convert_local, src, str(dst), *args, storage_options=storage_options, tmp_dir=tmp_dir,
                          **kwargs)


def _source(src: Any) -> Any:
    """What :func:`convert` packs from ``src``: a path, URL or reader as it is; an opened packio
    dataset through its reader (its stored samples: decode options do not apply); a mix refused."""
    from packio.formats.reader import Reader

    if isinstance(src, (str, os.PathLike, Reader)):
        return src
    from packio.read.datasets import Reading
    from packio.read.mix import MixedDataset

    if isinstance(src, MixedDataset):
        raise SourceError("a mix (packio.mix) is no source to convert: its samples are drawn at read time, by "
                          "weight, epoch after epoch. Convert each of its sources (convert(..., append=True) grows "
                          "one dataset from several), and mix them when reading")
    if isinstance(src, Reading):
        return src.reader
    raise SourceError(f"cannot convert a {type(src).__name__}: give a path or URL of an image folder or a packed "
                      f"dataset, or an opened packio dataset")


def verify(path: str | Path, **remote: Any) -> Any:
    """:func:`packio.verifier.verify`; a URL: every file is downloaded into the cache
    and checked; each one that fails is one line of the report (its samples are still
    checked, by range reads), which names the URL without credentials."""
    from packio.verifier import VerifyReport
    from packio.verifier import verify as verify_local

    if not is_url(path):
        return verify_local(path)
    shown = redact(str(path))
    try:
        reader = open_reader(str(path), **remote)
    except PackioError as exc:
        if "\n" not in str(exc) and not str(exc).count("checksum"):
            raise  # not a dataset, unreachable, ...: nothing to report on
        return VerifyReport(path=shown, bad_files=str(exc).splitlines())
    report = verify_local(reader, reader.fetch_all())
    report.path = shown
    return report


def describe(path: str) -> tuple[Any, int, str]:
    """What ``packio info`` shows of the dataset at ``path``: its manifest, the bytes it
    holds, and where its files lie (a folder, a file, or the URL they are served under:
    an upload's version folder, read from the manifest alone)."""
    if is_url(path):
        from packio.remote import describe_url

        return describe_url(path)
    from packio.manifest import disk_bytes

    reader = open_reader(path)
    m = reader.manifest
    if not m.source.get("foreign"):
        return m, disk_bytes(Path(path)), str(path)
    # shards another tool wrote (a folder, a pattern, one .tar): only they count
    return m, sum(p.stat().st_size for p in reader.source.paths), str(reader.path)
