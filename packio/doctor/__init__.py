"""packio doctor: does training wait on data, why, and what to change.

- In a training loop: ``with packio.doctor.loop(loader) as feed: for batch in feed: ...``
  then ``feed.report()`` (input-bound fraction, data-wait p50/p99, what the loader
  could sustain alone).
- Offline: ``packio.doctor.offline(path)`` / ``packio doctor PATH``: per-stage
  costs, candidate layouts packed from a sample and timed, a ranked recommendation.
- ``packio.doctor.limits()``: the CPUs and memory this process may use (cgroups).

Names load on first use: importing this package imports neither torch nor OpenCV.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "watch": "packio.doctor.loop", "Watch": "packio.doctor.loop", "WatchReport": "packio.doctor.loop",
    "budget": "packio.doctor.limits", "Budget": "packio.doctor.limits",
    "diagnose": "packio.doctor.offline", "Diagnosis": "packio.doctor.offline",
    "layouts": "packio.doctor.candidates",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'packio.doctor' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
