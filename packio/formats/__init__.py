"""The one registry: format name / suffix → FormatSpec; open any packed dataset."""

from __future__ import annotations

import importlib
from pathlib import Path

from packio.errors import FormatError
from packio.limits import read_head
from packio.formats.base import FormatSpec, Reader
from packio.manifest import MANIFEST_NAME

_MODULES = ("lmdb", "hdf5", "tar", "bmp", "arrays")


def formats() -> dict[str, FormatSpec]:
    """Every format, by name (imports each format's module on first use)."""
    out = {}
    for mod in _MODULES:
        spec = importlib.import_module(f"packio.formats.{mod}").FORMAT
        out[spec.name] = spec
    return out


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


def open_reader(path: str | Path) -> Reader:
    """Open a packed dataset: by its manifest, an HDF5 signature, or tar shards."""
    p = Path(path)
    if p.is_dir() and (p / MANIFEST_NAME).is_file():
        manifest = Reader.read_manifest(p)
        spec = get_format(manifest.format)
        if "parts" in manifest.extra:
            from packio.formats.parts import MultiPartReader

            return MultiPartReader(p, manifest, spec)
        return spec.reader(p, manifest)
    hdf5 = get_format("hdf5")
    if p.is_file() and read_head(p, 8) == b"\x89HDF\r\n\x1a\n":  # the signature, not the whole file
        return hdf5.reader(p, hdf5.reader.read_manifest(p))
    tar = get_format("tar")
    if tar.reader.detect_shards(str(path)):
        return tar.reader.from_shards(str(path))
    if not p.exists():
        raise FormatError(f"{path}: no such file or folder")
    raise FormatError(f"{path}: not a packed dataset (no {MANIFEST_NAME}, not HDF5, no .tar shards); "
                      f"pack it first with 'packio convert'")
