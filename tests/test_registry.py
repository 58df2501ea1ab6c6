"""The format registry is the one place a format plugs in; the public API is pinned."""

from __future__ import annotations

import dataclasses

import pytest

import packio
import toyformat
from packio.errors import FormatError
from packio.formats import formats, register, unregister

PUBLIC = [
    "ArrayDataset", "ArrayIterableDataset", "BMPDataset", "BMPIterableDataset", "CorruptSampleError",
    "DataLoader", "DatasetReplacedError", "DecodeOptions", "FormatError", "HDF5Dataset", "HDF5IterableDataset",
    "LMDBDataset", "LMDBIterableDataset", "Manifest", "MixedDataset", "OutputBusyError", "OutputExistsError", "PackOptions",
    "PackedDataset", "PackedIterableDataset", "PackioError", "RemoteError", "ResizeSpec", "ResumableSampler", "Sample", "SourceError", "StateError", "Summary", "TarDataset",
    "TarIterableDataset", "collate",
    "convert", "mix", "open_dataset", "open_reader", "show", "trust_manifest", "tune", "verify",
]


def test_public_names_are_pinned_and_resolve():
    assert packio.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(packio, name) is not None
    with pytest.raises(AttributeError):
        packio.NoSuchDataset  # noqa: B018


def test_a_registered_format_reaches_every_consumer(tmp_path):
    from packio.bench.runner import variants
    from packio.cli import build_parser

    spec = toyformat.FORMAT
    register(spec)
    try:
        assert formats()["toy"] is spec and register(spec) is spec  # registering twice is harmless
        assert "ToyDataset" in packio.__all__ and "ToyIterableDataset" in packio.__all__
        assert packio.ToyDataset.format_name == "toy" and issubclass(packio.ToyDataset, packio.PackedDataset)
        assert variants()["toy"] == ("toy", {})
        convert = build_parser()._subparsers._group_actions[0].choices["convert"]
        fmt = next(a for a in convert._actions if a.dest == "format")
        assert "toy" in fmt.choices and ".toy" in convert.description
        with pytest.raises(FormatError, match="already registered"):
            register(dataclasses.replace(spec, suffixes=(".toy2",)))
        with pytest.raises(FormatError, match="taken"):
            register(dataclasses.replace(spec, name="toy2", suffixes=(".lmdb",)))
        with pytest.raises(FormatError, match="taken"):  # .tar is the tar format's to refuse
            register(dataclasses.replace(spec, name="toy2", suffixes=(".tar",)))
    finally:
        unregister("toy")
    assert "toy" not in formats() and "ToyDataset" not in packio.__all__


def test_every_public_module_declares_all():
    import importlib
    import pkgutil

    names = [m.name for m in pkgutil.walk_packages(packio.__path__, "packio.")
             if not m.name.rsplit(".", 1)[-1].startswith("_")]
    assert "packio.formats.lmdb" in names and "packio.bench.probe" in names
    for name in names:
        mod = importlib.import_module(name)
        assert isinstance(getattr(mod, "__all__", None), list), f"{name} has no __all__"
        assert all(hasattr(mod, n) for n in mod.__all__), name
