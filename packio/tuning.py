"""packio.tune: measure a few DataLoader settings on this machine, return the fastest."""

from __future__ import annotations

import itertools
import os
from typing import Any

from packio.measure import Rate, throughput

__all__ = ["tune", "default_trials", "measure"]


def measure(dataset: Any, batch_size: int, seconds: float, settings: dict[str, Any]) -> Rate:
    """A packio DataLoader over ``dataset`` with ``settings`` (DataLoader keywords plus ``threads``,
    as :func:`tune` returns them), timed by :func:`packio.measure.throughput`."""
    from packio.read.datasets import PackedIterableDataset
    from packio.read.loader import DataLoader

    dataset.threads = settings.get("threads", 0)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=not isinstance(dataset, PackedIterableDataset),
                        **{k: v for k, v in settings.items() if k != "threads"})
    try:
        return throughput(loader, seconds)
    finally:
        del loader  # stops persistent workers now, not at garbage collection (an error's traceback holds it)


def _timed_batch(dataset: Any, batch_size: int, seconds: float, cpus: int, verbose: bool) -> int:
    """The batch size trials time: ``batch_size``, fewer samples when one sample takes so long
    (huge images) that a batch would outlast a trial, 0 when even two samples would (then
    nothing is timed). Read from one sample, in this process; iterable datasets: ``batch_size``."""
    import time

    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset) or not len(dataset):
        return batch_size
    t = time.perf_counter()
    dataset[0]
    per = time.perf_counter() - t
    if batch_size * per / cpus <= seconds:
        return batch_size
    timed = int(seconds * cpus / (2 * per)) if 2 * per <= seconds else 0
    if verbose:
        print(f"one sample takes {per:.2f} s here: " + (
            f"trials time batches of {timed} (a batch of {batch_size} would outlast a {seconds:g} s trial)" if timed
            else f"no setting can be timed in {seconds:g} s trials; num_workers=0 with threads={cpus} (each "
                 "thread decodes a sample of the batch)"), flush=True)
    return timed


def default_trials(cpus: int) -> list[dict[str, Any]]:
    """Threads vs workers vs both, each using every core: decode threads in the
    training process, ``cpus`` workers, and ``cpus // 2`` workers with 2 threads
    each, plus the plain single-process loader."""
    pw = {"prefetch_factor": 2, "persistent_workers": True}
    trials = [{"num_workers": 0, "threads": 0}]
    if cpus > 1:
        half = cpus // 2
        trials += [{"num_workers": 0, "threads": cpus}, {"num_workers": cpus, **pw, "threads": 0},
                   {"num_workers": half, **pw, "threads": max(2, cpus // half)}]
    return trials


def tune(dataset: Any, batch_size: int = 64, seconds: float = 3.0, workers: list[int] | None = None,
         prefetch: tuple[int, ...] | None = None, threads: tuple[int, ...] | None = None,
         verbose: bool = True) -> dict[str, Any]:
    """Measure DataLoader settings for ``seconds`` each after start-up, print the
    table, leave the dataset set to the fastest thread count, and return the
    fastest settings: DataLoader keyword arguments plus ``threads`` (pop it before
    passing them on). By default a short plan (:func:`default_trials`: threads vs
    workers vs both); give ``workers``, ``prefetch`` or ``threads`` to try every
    combination of ``num_workers`` × ``prefetch_factor`` (persistent workers) ×
    decode ``threads`` instead. Bounded time: trials × seconds, huge images included
    (trials then time smaller batches, or none when one sample outlasts half a trial)."""
    from packio.errors import PackioError

    if hasattr(dataset, "__len__") and len(dataset) == 0:  # no batch to time (torch's samplers raise a bare ValueError)
        where = getattr(getattr(dataset, "reader", None), "path", "the dataset")
        raise PackioError(f"{where}: holds no samples; nothing to tune. Pack some into it first (packio convert)")
    cpus = os.cpu_count() or 1
    if workers is None and prefetch is None and threads is None:
        trials = default_trials(cpus)
    else:
        workers = workers if workers is not None else sorted({0, 1, cpus // 2, cpus, cpus * 2})
        prefetch = prefetch or (2, 4)
        threads = threads if threads is not None else tuple(sorted({0, cpus}))
        trials = []
        for w, pf, th in itertools.product(workers, prefetch, threads):
            if w == 0 and pf != prefetch[0]:
                continue
            kw: dict[str, Any] = {"num_workers": w}
            if w:
                kw.update(prefetch_factor=pf, persistent_workers=True)
            trials.append({**kw, "threads": th})
    timed = _timed_batch(dataset, batch_size, seconds, cpus, verbose)
    if not timed:  # one sample outlasts half a trial: no setting can be timed, each thread decodes a sample
        dataset.threads = cpus
        return {"num_workers": 0, "threads": cpus}
    results = []
    for trial in trials:
        rate = measure(dataset, timed, seconds, trial).samples_per_s
        results.append((rate, trial))
        if verbose:
            print(f"  {rate:9.0f} samples/s  {trial}", flush=True)
    best = max(results, key=lambda r: r[0])
    dataset.threads = best[1]["threads"]
    if verbose:
        print(f"best: {best[1]} ({best[0]:.0f} samples/s, batch {timed})")
    return dict(best[1])
