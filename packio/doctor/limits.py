"""What this process may use: CPUs (affinity ∩ cgroup quota) and memory (cgroup limit).

``os.cpu_count()`` counts the machine; a container or a batch job usually gets less.
The cgroup files are read from ``cgroup_root`` (a parameter, so tests point it at a
fake tree): cgroup v2 ``cpu.max`` / ``memory.max``, or v1 ``cpu.cfs_quota_us`` /
``cpu.cfs_period_us`` / ``memory.limit_in_bytes``, at this process's own cgroup and
every ancestor (the tightest limit wins, as the kernel enforces it).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

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


def _v2(root: Path, rel: str, sources: list[str]) -> tuple[float | None, int | None, int | None]:
    quota: float | None = None
    limit: int | None = None
    used: int | None = None
    for d in _levels(root, rel):
        cpu = (_read(d / "cpu.max") or "").split()
        if len(cpu) == 2 and cpu[0] != "max":
            try:
                q = int(cpu[0]) / int(cpu[1])
            except (ValueError, ZeroDivisionError):
                q = None
            if q and q > 0 and (quota is None or q < quota):
                quota = q
                sources.append(str(d / "cpu.max"))
        mem = _read(d / "memory.max")
        if mem and mem.isdigit() and (limit is None or int(mem) < limit):
            limit = int(mem)
            sources.append(str(d / "memory.max"))
        cur = _read(d / "memory.current")
        if used is None and cur and cur.isdigit():
            used = int(cur)
    return quota, limit, used


def _v1(root: Path, own: dict[str, str], sources: list[str]) -> tuple[float | None, int | None, int | None]:
    quota: float | None = None
    limit: int | None = None
    used: int | None = None
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for d in _levels(root / name, own.get("cpu", "/")):
            try:
                q_us, p_us = int(_read(d / "cpu.cfs_quota_us") or "-1"), int(_read(d / "cpu.cfs_period_us") or "0")
            except ValueError:
                continue
            if q_us > 0 and p_us > 0 and (quota is None or q_us / p_us < quota):
                quota = q_us / p_us
                sources.append(str(d / "cpu.cfs_quota_us"))
        if quota is not None:
            break
    for d in _levels(root / "memory", own.get("memory", "/")):
        mem = _read(d / "memory.limit_in_bytes")
        if mem and mem.isdigit() and (limit is None or int(mem) < limit):
            limit = int(mem)
            sources.append(str(d / "memory.limit_in_bytes"))
        cur = _read(d / "memory.usage_in_bytes")
        if used is None and cur and cur.isdigit():
            used = int(cur)
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
    aff = affinity if affinity is not None else len(os.sched_getaffinity(0)) if hasattr(
        os, "sched_getaffinity") else (os.cpu_count() or 1)
    phys = physical if physical is not None else physical_memory()
    own = _own_paths(self_cgroup)
    sources: list[str] = []
    if (root / "cgroup.controllers").is_file():
        quota, limit, used = _v2(root, own.get("", "/"), sources)
    else:
        quota, limit, used = _v1(root, own, sources)
    limited = limit is not None and (not phys or limit < phys)
    cpus = max(1, min(aff, math.floor(quota))) if quota else max(1, aff)
    return Budget(cpus=cpus, affinity=aff, cpu_quota=quota, memory=limit if limited else phys,  # type: ignore[arg-type]
                  memory_limited=limited, memory_used=used if limited else None, sources=sources)
