"""Small timing helpers shared by the in-loop watch and the offline diagnosis."""

from __future__ import annotations

import time
from typing import Any, Iterable

import numpy as np


def batch_len(batch: Any) -> int | None:
    """Samples in a batch: packio's ``label``, else the first tensor/array/list's
    length; None when it cannot tell."""
    if isinstance(batch, dict):
        for key in ("label", "image"):
            if key in batch:
                return batch_len(batch[key])
        batch = next(iter(batch.values()), None)
    if isinstance(batch, (tuple, list)) and batch and not isinstance(batch[0], (int, float, bytes, str)):
        return batch_len(batch[0])
    shape = getattr(batch, "shape", None)
    if shape is not None and len(shape):
        return int(shape[0])
    if isinstance(batch, (list, tuple)):
        return len(batch)
    return None


def throughput(loader: Iterable[Any], seconds: float, max_batches: int | None = None) -> tuple[float, float]:
    """(batches/s, samples/s) of iterating ``loader`` alone, timed after its first
    batch (start-up is not steady state), re-iterating it until ``seconds`` pass."""
    n_batches = n_samples = 0
    t_first: float | None = None
    deadline = 0.0
    while True:
        got_any = False
        for batch in loader:
            got_any = True
            now = time.perf_counter()
            if t_first is None:
                t_first, deadline = now, now + seconds
                continue
            n_batches += 1
            n_samples += batch_len(batch) or 0
            if now >= deadline or (max_batches is not None and n_batches >= max_batches):
                dt = now - t_first
                return n_batches / dt, n_samples / dt
        if not got_any:
            break
        if iter(loader) is loader:  # a one-shot iterator: what it gave is all there is
            break
    dt = time.perf_counter() - t_first if t_first is not None else 0.0
    return (n_batches / dt, n_samples / dt) if dt > 0 and n_batches else (0.0, 0.0)


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if values else float("nan")
