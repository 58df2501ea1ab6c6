"""What this process may use: CPUs (affinity ∩ cgroup quota) and memory (cgroup limit).

``os.cpu_count()`` counts the machine; a container or a batch job usually gets less.
The cgroup files are read from ``cgroup_root`` (a parameter, so tests point it at a
fake tree): cgroup v2 ``cpu.max`` / ``memory.max``, or v1 ``cpu.cfs_quota_us`` /
``cpu.cfs_period_us`` / ``memory.limit_in_bytes``, at this process's own cgroup and
every ancestor (the tightest limit wins, as the kernel enforces it).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from packio.errors import PackioError
from packio.pack.workers import cpus as allowed_cpus

# What each option may be: (low, high); a float option must also be finite. The CLI parses with the same ranges.
RANGES: dict[str, tuple[float, float]] = {
    "size": (8, 4096), "batch_size": (1, 4096), "seconds": (1.0, 86400.0), "fraction": (1e-9, 1.0),
    "min_samples": (1, 10**7), "max_samples": (1, 10**7), "step_ms": (1e-3, 1e7), "gpu_decode_ms": (0.0, 1e7),
    "cpus": (1, 4096)}
MAX_BATCH_BYTES = 4 << 30  # one decoded batch (batch_size x size x size x 3)


def check_options(**opts: Any) -> None:
    """Refuse an option out of its range (``None``: not given) with the range in the message."""
    for name, v in opts.items():
        lo, hi = RANGES[name]
        if v is None and name in ("step_ms", "gpu_decode_ms", "cpus"):
            continue
        number = isinstance(v, numbers.Real) and not isinstance(v, bool)
        whole = isinstance(lo, int)
        if not number or not math.isfinite(v) or (whole and int(v) != v) or not lo <= v <= hi:
            kind = "an integer" if whole else "a number"
            raise PackioError(f"doctor: {name} must be {kind} from {lo:g} to {hi:g}, not {v!r}")
    if opts["batch_size"] * opts["size"] ** 2 * 3 > MAX_BATCH_BYTES:
        raise PackioError(f"doctor: a batch of {opts['batch_size']} images of {opts['size']}x{opts['size']} takes "
                          f"over {MAX_BATCH_BYTES >> 30} GiB; lower --batch-size or --size")


__all__ = ["Budget", "physical_memory", "budget"]

CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"
WORKER_BASE_BYTES = 400 << 20  # a DataLoader worker: Python + torch + decoder state, measured ~300-400 MB RSS


@dataclass(frozen=True)
class Budget:
    """CPUs and memory this process may use, and where each figure came from."""

    cpus: int  # whole CPUs to size workers and decode threads by
    affinity: int  # CPUs in os.sched_getaffinity
    cpu_quota: float | None  # cgroup CPU quota in CPUs; None: no quota
    memory: int  # bytes: the cgroup limit, else physical memory
    memory_limited: bool  # True when ``memory`` is a cgroup limit
    memory_used: int | None  # the cgroup's current usage, when it says
    sources: list[str] = field(default_factory=list)  # files the limits came from

    @property
    def memory_free(self) -> int:
        return max(0, self.memory - (self.memory_used or 0))

    def max_workers(self, batch_bytes: int, prefetch: int = 2) -> int:
        """Most DataLoader workers the CPUs and the memory allow (each holds
        ``prefetch`` batches plus its own process)."""
        per = WORKER_BASE_BYTES + (prefetch + 1) * batch_bytes
        return max(0, min(self.cpus, self.memory_free // per))

    def text(self) -> str:
        quota = f"cgroup quota {self.cpu_quota:g} CPUs" if self.cpu_quota else "no cgroup CPU quota"
        mem = (f"{self.memory / 2**30:.1f} GiB cgroup limit" + (
            f" ({self.memory_used / 2**30:.1f} GiB in use)" if self.memory_used is not None else "")
               if self.memory_limited else f"{self.memory / 2**30:.1f} GiB (physical; no cgroup limit)")
        return f"{self.cpus} CPUs (affinity {self.affinity}, {quota}); memory {mem}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _own_paths(self_cgroup: str | Path) -> dict[str, str]:
    """Controller → this process's cgroup path ('' key: the v2 unified hierarchy)."""
    out: dict[str, str] = {}
    for line in (_read(Path(self_cgroup)) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _levels(base: Path, rel: str) -> list[Path]:
    """``base/rel`` and each of its ancestors up to ``base``, those that exist.
    Inside a cgroup namespace ``rel`` is often '/' or absent under ``base``: then ``base`` alone."""
    parts = [p for p in rel.split("/") if p and p not in (".", "..")]
    dirs = [base.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _quota_v2(d: Path) -> float | None:
    parts = (_read(d / "cpu.max") or "").split()  # "max 100000" or "150000 100000"
    try:
        return int(parts[0]) / int(parts[1]) if len(parts) == 2 and parts[0] != "max" else None
    except (ValueError, ZeroDivisionError):
        return None


def _quota_v1(d: Path) -> float | None:
    try:
        quota, period = int(_read(d / "cpu.cfs_quota_us") or "-1"), int(_read(d / "cpu.cfs_period_us") or "0")
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _int_file(d: Path, name: str | None) -> int | None:
    text = _read(d / name) if name else None
    return int(text) if text and text.isdigit() else None


def _tightest(dirs: list[Path], quota_of: Callable[[Path], float | None], quota_file: str | None,
              limit_file: str | None, usage_file: str | None,
              sources: list[str]) -> tuple[float | None, int | None, int | None]:
    """(CPU quota, memory limit, memory usage) over a cgroup and its ancestors: the
    smallest quota and limit (each level caps all below it); usage of the deepest level."""
    quota: float | None = None
    limit: int | None = None
    used: int | None = None
    for d in dirs:
        q = quota_of(d) if quota_file else None
        if q and q > 0 and (quota is None or q < quota):
            quota = q
            sources.append(str(d / quota_file))  # type: ignore[operator]
        mem = _int_file(d, limit_file)
        if mem is not None and (limit is None or mem < limit):
            limit = mem
            sources.append(str(d / limit_file))
        if used is None:
            used = _int_file(d, usage_file)
    return quota, limit, used


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def budget(cgroup_root: str | Path = CGROUP_ROOT, self_cgroup: str | Path = SELF_CGROUP,
           affinity: int | None = None, physical: int | None = None) -> Budget:
    """CPUs and memory this process may use. A CPU quota of 1.5 gives 1 CPU to size
    workers by (rounded down: a worker per fractional CPU oversubscribes). A cgroup
    memory limit above physical memory means none (v1 writes ~2**63 for 'no limit')."""
    root = Path(cgroup_root)
    aff = affinity if affinity is not None else allowed_cpus()
    phys = physical if physical is not None else physical_memory()
    own = _own_paths(self_cgroup)
    sources: list[str] = []
    if (root / "cgroup.controllers").is_file():  # v2: one unified hierarchy
        quota, limit, used = _tightest(_levels(root, own.get("", "/")), _quota_v2, "cpu.max", "memory.max",
                                       "memory.current", sources)
    else:  # v1: a hierarchy per controller (cpu is often mounted as cpu,cpuacct)
        cpu_dirs = next((_levels(root / n, own.get("cpu", "/")) for n in ("cpu", "cpu,cpuacct", "cpuacct,cpu")
                         if (root / n).is_dir()), [])
        quota = _tightest(cpu_dirs, _quota_v1, "cpu.cfs_quota_us", None, None, sources)[0]
        _, limit, used = _tightest(_levels(root / "memory", own.get("memory", "/")), _quota_v1, None,
                                   "memory.limit_in_bytes", "memory.usage_in_bytes", sources)
    limited = limit is not None and (not phys or limit < phys)
    cpus = max(1, min(aff, math.floor(quota))) if quota else max(1, aff)
    return Budget(cpus=cpus, affinity=aff, cpu_quota=quota, memory=limit if limited else phys,  # type: ignore[arg-type]
                  memory_limited=limited, memory_used=used if limited else None, sources=sources)
