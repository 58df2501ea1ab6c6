"""URLs at one edge: the public ``open_reader``, ``convert`` and ``verify`` take a
path or a URL; a URL goes to :mod:`packio.remote` here (a reader over the cache, an
upload after a local conversion), so formats, the converter and the verifier only
ever see local paths and readers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from packio.errors import PackioError, redact
from packio.remote import is_url

__all__ = ["convert", "open_reader", "verify", "is_url"]


def open_reader(path: Any, **remote: Any) -> Any:
    """A reader for a packed dataset at a local path or a URL; ``remote``: the
    options of :func:`packio.remote.open_url` (cache, retries, timeout, ...)."""
    if is_url(path):
        from packio.remote import open_url

        return open_url(path, **remote)
    from packio.formats import open_reader as open_local

    return open_local(path)


def convert(src: Any, dst: str | Path, *args: Any, storage_options: dict[str, Any] | None = None,
            tmp_dir: str | Path | None = None, **kwargs: Any) -> Any:
    """:func:`packio.pack.convert`; to a URL: packed into a local staging folder,
    then uploaded (files first, the manifest last; see :mod:`packio.remote.upload`).
    From a URL (a packed dataset, or foreign tar shards by a brace pattern): read
    through the cache (default options; ``storage_options`` apply to both URLs)."""
    from packio.pack import convert as convert_local

    if is_url(src):
        from packio.remote import open_url

        src = open_url(str(src), storage_options=storage_options)
    if not is_url(dst):
        return convert_local(src, dst, *args, **kwargs)
    if kwargs.get("append"):
        raise PackioError(f"{redact(str(dst))}: appending to a URL is not supported (an upload replaces every file "
                          f"of the dataset); append to a local copy, then upload it with "
                          f"'packio convert LOCAL URL --overwrite'")
    from packio.remote.upload import convert_to_url

    return convert_to_url(convert_local, src, str(dst), *args, storage_options=storage_options, tmp_dir=tmp_dir,
                          **kwargs)


def verify(path: str | Path, **remote: Any) -> Any:
    """:func:`packio.verifier.verify`; a URL: every file is downloaded into the cache
    and checked; each one that fails is one line of the report (its samples are still
    checked, by range reads), which names the URL without credentials."""
    from packio.verifier import VerifyReport
    from packio.verifier import verify as verify_local

    if not is_url(path):
        return verify_local(path)
    from packio.remote import open_url

    shown = redact(str(path))
    try:
        reader = open_url(str(path), **remote)
    except PackioError as exc:
        if "\n" not in str(exc) and not str(exc).count("checksum"):
            raise  # not a dataset, unreachable, ...: nothing to report on
        return VerifyReport(path=shown, bad_files=str(exc).splitlines())
    damaged = reader.fetch_all()
    report = verify_local(reader, damaged)
    report.path = shown
    return report
