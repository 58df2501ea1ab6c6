"""``packio bench``: pack one dataset into every registered format and compare readers,
the machine's limits and a naive per-file baseline (``packio bench --help``).

Self-contained: its synthetic photo generator is :mod:`packio.bench.synth`; opens and
memory are measured from outside the measured process (:mod:`packio.bench.probe`);
extra dependencies (matplotlib for the chart, webdataset for its reference loader)
come with ``pip install 'packio[bench]'`` and are optional.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    from packio.bench.runner import main as run

    return run(list(argv) if argv is not None else None)
