"""Small timing helpers shared by packio.tune, the doctor (in-loop watch, offline diagnosis) and the benchmark."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

__all__ = ["batch_len", "cpu_seconds", "Rate", "throughput", "percentile_ms", "OtherLoad"]


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


def cpu_seconds() -> float:
    """CPU time of this process (all threads) and its live child processes (DataLoader
    workers), from /proc; this process alone where /proc is absent."""
    import os

    total = time.process_time()
    me = str(os.getpid())
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return total
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if len(fields) > 12 and fields[1] == me.encode():  # ppid; utime, stime in clock ticks
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


@dataclass
class Rate:
    """What iterating a loader alone gave, timed after its first batch."""

    batches_per_s: float = 0.0
    samples_per_s: float = 0.0
    cpu_per_sample: float = 0.0  # CPU seconds per sample, this process + its workers


def throughput(loader: Iterable[Any], seconds: float, max_batches: int | None = None) -> Rate:
    """Iterate ``loader`` alone, timed after its first batch (start-up is not steady
    state), re-iterating it until ``seconds`` pass."""
    n_batches = n_samples = 0
    t_first: float | None = None
    cpu_first = 0.0
    deadline = 0.0
    while True:
        got_any = False
        for batch in loader:
            got_any = True
            now = time.perf_counter()
            if t_first is None:
                t_first, deadline, cpu_first = now, now + seconds, cpu_seconds()
                continue
            n_batches += 1
            n_samples += batch_len(batch) or 0
            if now >= deadline or (max_batches is not None and n_batches >= max_batches):
                return _rate(n_batches, n_samples, now - t_first, cpu_seconds() - cpu_first)
        if not got_any or iter(loader) is loader:  # empty, or a one-shot iterator: that was all
            break
    if t_first is None:
        return Rate()
    return _rate(n_batches, n_samples, time.perf_counter() - t_first, cpu_seconds() - cpu_first)


def _rate(batches: int, samples: int, dt: float, cpu: float) -> Rate:
    if dt <= 0 or not batches:
        return Rate()
    return Rate(batches / dt, samples / dt, cpu / samples if samples else 0.0)


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if values else float("nan")


def _machine_busy() -> tuple[float, int] | None:
    """CPU seconds the whole machine has been busy since boot (/proc/stat), and its CPUs;
    None where /proc/stat is absent."""
    import os

    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        v = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / tick, sum(x[:3] == "cpu" for x in lines) - 1


def _own_cpu() -> float:
    """CPU seconds of this process and of its children it has waited for (theirs included)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class OtherLoad:
    """How busy other processes kept the machine since this was made: the machine's busy
    CPU time less this process's and its finished children's, per second of wall time.
    Read it after the children measured have ended (their CPU time counts once waited for)."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0 = time.perf_counter(), _machine_busy(), _own_cpu()

    def cores(self) -> float | None:
        """CPUs' worth of time the other processes took, on average; None where unknown."""
        now, dt = _machine_busy(), time.perf_counter() - self.t0
        if now is None or self.busy0 is None or dt <= 0:
            return None
        return max(0.0, (now[0] - self.busy0[0] - (_own_cpu() - self.own0)) / dt)

    def text(self) -> str:
        """``other processes kept 1.3 of the machine's 2 CPUs busy``, when that is a quarter or
        more of them (figures then run lower, and vary more, than on a quiet machine); else ""."""
        cores, cpus = self.cores(), (self.busy0 or (0.0, 0))[1]
        if cores is None or not cpus or cores < 0.25 * cpus:
            return ""
        return f"other processes kept {cores:.1f} of the machine's {cpus} CPUs busy"
