"""Inputs prepared in this process or in local worker processes: ``workers="auto"``
times the first inputs here and starts processes only where they pay off."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from typing import Any, Callable, Iterator

from packio.pack.prepare import Result

__all__ = ["results", "auto_workers", "cpus", "progress_bar", "AUTO_PROBE", "AUTO_PROBE_S", "AUTO_MIN_TASK_S",
           "AUTO_MIN_REST_S"]

# workers="auto": time the first inputs here, then use processes only when each input costs at
# least AUTO_MIN_TASK_S and the rest at least AUTO_MIN_REST_S in one process: starting a pool
# cost 0.7-0.8 s here, and 2 workers lost to 1 on small photos (tools/convert.py workers).
AUTO_PROBE, AUTO_PROBE_S, AUTO_MIN_TASK_S, AUTO_MIN_REST_S = 16, 0.3, 0.002, 3.0

_WORKER_FN: Callable[[Any], Result] | None = None  # set once in each pool process by _init_worker


def _init_worker(fn: Callable[[Any], Result]) -> None:
    global _WORKER_FN
    _WORKER_FN = fn


def _call(task: Any) -> Result:
    assert _WORKER_FN is not None, "pool process started without _init_worker"
    return _WORKER_FN(task)


def results(fn: Callable[[Any], Result], tasks: list[Any], workers: int | str,
            chosen: dict[str, Any] | None = None) -> Iterator[Result]:
    """``fn`` over ``tasks``, in this process or a pool. ``workers="auto"`` times the first
    inputs here and starts processes only where they pay off (``chosen["workers"]`` says why)."""
    chosen = {} if chosen is None else chosen
    if workers == "auto":
        spent, done = 0.0, 0
        while done < min(len(tasks), AUTO_PROBE) and (done < 3 or spent < AUTO_PROBE_S):
            t = time.perf_counter()
            result = fn(tasks[done])
            if done:  # the first input pays one-time costs (imports, decoder set-up): not counted
                spent += time.perf_counter() - t
            done += 1
            yield result
        per, rest = spent / max(done - 1, 1), len(tasks) - done
        free = _free_cpus()
        workers = auto_workers(per, rest, free)
        why = ("processes pay off" if workers > 1 else
               f"the CPUs are busy: fewer than 2 idle of {cpus()}" if free < 2 and per * rest >= AUTO_MIN_REST_S
               and per >= AUTO_MIN_TASK_S else "one process is fastest for inputs this quick")
        chosen["workers"] = f"auto → {workers} ({per * 1e3:.1f} ms per input measured; {why})"
        tasks = tasks[done:]
    else:
        chosen["workers"] = f"{workers}" + (" (inputs read in this process)" if workers <= 1 else " processes")
    if workers <= 1:
        yield from map(fn, tasks)
        return
    # forkserver, not fork: the caller may run threads (Dask, decode pools, OpenCV) whose
    # locks a forked child would inherit held (seen here: a worker hanging in OpenCV).
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    # fn (with a packed source's reader and its index) goes to each process once, not with every chunk
    with ctx.Pool(workers, initializer=_init_worker, initargs=(fn,)) as pool:
        yield from pool.imap(_call, tasks, chunksize=8)


def auto_workers(per_task_s: float, rest: int, free_cpus: float | None = None) -> int:
    """Processes for ``rest`` more inputs that each took ``per_task_s`` here: 0 (this
    process) unless each input is slow enough to outweigh sending it between processes,
    the rest long enough to outweigh starting them, and at least two CPUs are idle
    (``free_cpus``: CPUs minus the load of other processes; on a busy machine
    processes only queue behind each other)."""
    if free_cpus is None:
        free_cpus = _free_cpus()
    if per_task_s < AUTO_MIN_TASK_S or per_task_s * rest < AUTO_MIN_REST_S or free_cpus < 2:
        return 0
    return int(free_cpus)


def cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _free_cpus() -> float:
    try:
        others = max(0.0, os.getloadavg()[0] - 1.0)  # this process is one of the running ones
    except (AttributeError, OSError):
        others = 0.0
    return cpus() - others


class _NoBar:
    """The bar when none is shown: no tqdm object at all, since even a disabled one takes tqdm's
    lock, shared with forked processes (one killed while holding it would hang this process)."""

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None


def progress_bar(total: int, enabled: bool | None) -> Any:
    """A tqdm bar over ``total`` inputs (``enabled=None``: shown on a terminal only)."""
    if not (sys.stderr.isatty() if enabled is None else enabled):
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="img", leave=False)
