"""packio: pack image datasets once, then feed the GPU with few file reads.

Public names load on first use, so ``import packio`` stays fast and imports
neither torch nor any GPU code. The per-format dataset classes (``LMDBDataset``,
``TarIterableDataset``, ...) come from the format registry (``packio.formats``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "convert": "packio.api", "Summary": "packio.pack",
    "verify": "packio.api",
    "collate": "packio.read.batch",
    "ResizeSpec": "packio.decode",
    "PackOptions": "packio.options", "DecodeOptions": "packio.options",
    "Sample": "packio.sample",
    "Manifest": "packio.manifest", "trust_manifest": "packio.manifest",
    "PackioError": "packio.errors", "SourceError": "packio.errors", "FormatError": "packio.errors",
    "CorruptSampleError": "packio.errors", "OutputExistsError": "packio.errors", "StateError": "packio.errors",
    "OutputBusyError": "packio.errors", "DatasetReplacedError": "packio.errors",
    "RemoteError": "packio.errors",
    "open_dataset": "packio.api", "PackedDataset": "packio.read.datasets",
    "PackedIterableDataset": "packio.read.datasets", "DataLoader": "packio.read.loader",
    "ResumableSampler": "packio.read.positions",
    "open_reader": "packio.api",
    "tune": "packio.tuning",
    "show": "packio.preview",
    "mix": "packio.api", "MixedDataset": "packio.read.mix",
}


def _format_class_names() -> list[str]:
    from packio.formats import formats

    return [f"{spec.class_prefix}{kind}" for spec in formats().values() for kind in ("Dataset", "IterableDataset")]


def __getattr__(name: str) -> Any:
    if name == "__all__":  # computed: it names every registered format's dataset classes
        return sorted([*_LAZY, *_format_class_names()])
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name.endswith("Dataset") and name in _format_class_names():
        return getattr(importlib.import_module("packio.read.datasets"), name)
    raise AttributeError(f"module 'packio' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_format_class_names()})
