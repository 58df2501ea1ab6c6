"""The one registry: format name / suffix → FormatSpec; open any packed dataset.

A format is one module defining ``FORMAT = FormatSpec(...)`` plus one line here
(built-in formats) or one ``register(spec)`` call (a plugin's or a test's format):
readers, dataset classes, ``convert``, the CLI and the benchmark all read the
registry.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from packio.errors import FormatError, is_url, redact
from packio.formats.base import FormatSpec
from packio.formats.reader import Reader
from packio.manifest import MANIFEST_NAME

__all__ = ["FormatSpec", "Reader", "format_for_path", "formats", "get_format", "is_packed", "open_reader",
           "register", "unregister"]

_MODULES = ("lmdb", "hdf5", "tar", "bmp", "arrays")  # built-in formats: packio.formats.<module>.FORMAT
_REGISTERED: dict[str, FormatSpec] = {}  # added at run time by register()


def formats() -> dict[str, FormatSpec]:
    """Every format, by name: the built-in ones (imported on first use), then the
    registered ones."""
    out = {}
    for mod in _MODULES:
        spec = importlib.import_module(f"packio.formats.{mod}").FORMAT
        out[spec.name] = spec
    out.update(_REGISTERED)
    return out


def register(spec: FormatSpec) -> FormatSpec:
    """Add a format to the registry (for this process). Its name and suffixes must be
    new (and not refused by another format). Returns ``spec``, so a module can write ``FORMAT = register(FormatSpec(...))``."""
    table = formats()
    if spec.name in table and table[spec.name] is not spec:
        raise FormatError(f"a format named {spec.name!r} is already registered")
    taken = {s for other in table.values() if other is not spec for s in _claimed_suffixes(other)}
    if taken & _claimed_suffixes(spec):
        raise FormatError(f"format {spec.name!r}: suffixes {sorted(taken & _claimed_suffixes(spec))} are taken")
    _REGISTERED[spec.name] = spec
    return spec


def _claimed_suffixes(spec: FormatSpec) -> set[str]:
    """The output suffixes a format answers for: its own, and those it refuses (``.tar``)."""
    return {*spec.suffixes, *(suffix for suffix, _ in spec.refused_suffixes)}


def unregister(name: str) -> None:
    """Remove a format added with :func:`register` (built-in ones stay)."""
    _REGISTERED.pop(name, None)


def get_format(name: str) -> FormatSpec:
    table = formats()
    if name not in table:
        raise FormatError(f"unknown format {name!r}; choose one of {', '.join(table)}")
    return table[name]


def format_for_path(path: str | Path) -> FormatSpec:
    """The format an output path asks for, by its suffix."""
    suffix = Path(str(path).rstrip("/")).suffix.lower()
    for spec in formats().values():
        if suffix in spec.suffixes:
            return spec
    known = ", ".join(s for spec in formats().values() for s in spec.suffixes)
    raise FormatError(f"{path}: cannot tell the format from the suffix {suffix or '(none)'!r}; "
                      f"use one of {known}, or pass --format")


def _claimed_by(path: str | Path) -> FormatSpec | None:
    """The format whose reader recognises ``path`` without a packio manifest."""
    return next((spec for spec in formats().values() if spec.reader.claims(str(path))), None)


def is_packed(path: str | Path) -> bool:
    """Whether ``path`` is a dataset ``open_reader`` can open (rather than an image folder)."""
    p = Path(path)
    return (p / MANIFEST_NAME).is_file() or _claimed_by(path) is not None


def open_reader(path: str | Path | Reader) -> Reader:
    """Open a packed dataset: by its manifest, or by the first format whose reader
    claims the path (an HDF5 file, tar shards written by any tool);
    a Reader as is. URLs are opened by ``packio.open_reader`` / ``packio.open_dataset``."""
    if isinstance(path, Reader):
        return path
    if is_url(path):
        raise FormatError(f"{redact(path)}: a URL; open it with packio.open_dataset(url) or packio.open_reader(url)")
    try:
        return _open_local(Path(path), path)
    except OSError as exc:  # a name too long, a folder without permission: said as a packio error
        raise FormatError(f"{redact(str(path))}: cannot be opened ({exc.strerror or exc})") from exc


def _open_local(p: Path, path: str | Path) -> Reader:
    if p.is_dir() and (p / MANIFEST_NAME).is_file():
        manifest = Reader.read_manifest(p)
        spec = get_format(manifest.format)
        if "parts" in manifest.extra:
            from packio.formats.parts import MultiPartReader

            return MultiPartReader(p, manifest, spec)
        return spec.reader(p, manifest)
    spec = _claimed_by(path)
    if spec is not None:
        return spec.reader.open_unlisted(str(path))
    if not p.exists():
        hint = ("; a URL made into a Path (which drops a '/')? pass URLs as strings to packio.open_dataset(url)"
                if is_url(str(path).replace(":/", "://", 1)) else "")
        raise FormatError(f"{redact(path)}: no such file or folder{hint}")
    raise FormatError(f"{path}: not a packed dataset (no {MANIFEST_NAME}, and no format recognises it); "
                      f"pack it first with 'packio convert'")
