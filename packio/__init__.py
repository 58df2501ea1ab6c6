"""packio: pack image datasets once, then feed the GPU with few file reads.

Public names load on first use, so ``import packio`` stays fast and imports
neither torch nor any GPU code.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "convert": "packio.converter", "Summary": "packio.converter",
    "verify": "packio.verifier",
    "collate": "packio.collation",
    "ResizeSpec": "packio.decode",
    "Sample": "packio.sample",
    "Manifest": "packio.manifest",
    "PackioError": "packio.errors", "SourceError": "packio.errors", "FormatError": "packio.errors",
    "CorruptSampleError": "packio.errors", "OutputExistsError": "packio.errors",
    "OutputBusyError": "packio.errors", "DatasetReplacedError": "packio.errors",
    "open_dataset": "packio.datasets", "PackedDataset": "packio.datasets",
    "PackedIterableDataset": "packio.datasets", "DataLoader": "packio.datasets",
    "ResumableSampler": "packio.datasets",
    **{f"{p}{kind}": "packio.datasets" for p in ("LMDB", "HDF5", "Tar", "BMP", "Array")
       for kind in ("Dataset", "IterableDataset")},
    "open_reader": "packio.formats",
    "tune": "packio.tuning",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'packio' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
