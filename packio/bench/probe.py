"""Measure a benchmark child from the outside: file opens from real system calls,
memory over the whole process tree while it runs. Nothing in the storage code helps.

- Opens: the child runs under ``strace -f -e trace=open,openat,openat2`` (with
  ``--seccomp-bpf`` where supported, so only those calls stop) and every successful
  open of a path inside the dataset after the child's start marker is counted. Without
  a usable strace, ``/proc/PID/fd`` of every process in the tree is sampled: distinct
  (process, descriptor, file) triples seen, an estimate (opens shorter than the sampling
  interval are missed; the child's cache set-up may be seen). :attr:`Probe.opens_method`
  says which was used.
- Memory: the sum over the tree (the child and its DataLoader workers) of PSS from
  ``/proc/PID/smaps_rollup`` (shared pages split between the processes that map them,
  so forked workers are not counted twice), or of VmRSS where that file is absent;
  sampled every ``interval`` seconds while the tree lives; the peak is kept.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

__all__ = ["MARKER", "Probe", "count_opens", "strace_prefix", "wait_and_probe"]

# The child tries to open this (absent) path once its set-up is done: opens are counted after it.
MARKER = "/nonexistent-packio-bench-marker"

_STRACE: list[list[str] | None] = []  # cached strace_prefix() result


def strace_prefix(log: Path) -> list[str] | None:
    """The command prefix that traces opens into ``log``, or None where strace is
    missing or cannot trace here (no ptrace permission)."""
    if not _STRACE:
        exe = shutil.which("strace")
        found = None
        if exe:
            for seccomp in (["--seccomp-bpf"], []):
                cmd = [exe, "-f", "-qq", *seccomp, "-e", "trace=open,openat,openat2", "-e", "signal=none"]
                try:
                    ok = subprocess.run([*cmd, "-o", os.devnull, "true"], capture_output=True,
                                        timeout=30).returncode == 0
                except (OSError, subprocess.SubprocessError):
                    ok = False
                if ok:
                    found = cmd
                    break
        _STRACE.append(found)
    return None if _STRACE[0] is None else [*_STRACE[0], "-o", str(log)]


_CALL = re.compile(r'^(\d+)\s+(?:open|openat|openat2)\((?:[^,"]*,\s*)?"((?:[^"\\]|\\.)*)"(.*)$')
_RESUMED = re.compile(r"^(\d+)\s+<\.\.\. open\w* resumed>.*=\s*(-?\d+)")
_RESULT = re.compile(r"=\s*(-?\d+)")


def _unescape(s: str) -> str:
    """strace's C escapes (``\\303\\251``, ``\\"``) back to the path."""
    if "\\" not in s:
        return s
    return s.encode("latin-1", "backslashreplace").decode("unicode_escape").encode("latin-1").decode(
        "utf-8", "replace")


def count_opens(log: Path, root: str) -> int:
    """Successful opens of paths below ``root`` after :data:`MARKER` in an strace log."""
    root = root.rstrip("/") + "/"
    started, count = False, 0
    pending: dict[str, str] = {}  # pid -> path of an <unfinished ...> open
    with open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = _CALL.match(line)
            if m:
                pid, path, rest = m.group(1), _unescape(m.group(2)), m.group(3)
                if path == MARKER:
                    started = True
                    continue
                if "<unfinished" in rest:
                    pending[pid] = path
                    continue
                r = _RESULT.search(rest)
                ok = r is not None and int(r.group(1)) >= 0
            else:
                m = _RESUMED.match(line)
                if not m or m.group(1) not in pending:
                    continue
                path, ok = pending.pop(m.group(1)), int(m.group(2)) >= 0
            if started and ok and (path + "/").startswith(root):
                count += 1
    return count


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _tree(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _memory_kb(pid: int) -> tuple[int, str | None]:
    for name, field, kind in (("smaps_rollup", "Pss:", "PSS"), ("status", "VmRSS:", "RSS")):
        try:
            with open(f"/proc/{pid}/{name}") as f:
                for line in f:
                    if line.startswith(field):
                        return int(line.split()[1]), kind
        except OSError:
            pass
    return 0, None  # the process is gone


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class Probe:
    """Samples the process tree below ``pid`` on a thread until :meth:`stop`."""

    def __init__(self, pid: int, root: str, *, sample_fds: bool, interval: float = 0.05) -> None:
        self.pid, self.root, self.sample_fds, self.interval = pid, root.rstrip("/") + "/", sample_fds, interval
        self.peak_kb, self.memory_kind = 0, "RSS"
        self._fds: set[tuple[int, int, str]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.opens_method = "/proc/PID/fd sampling (an estimate)" if sample_fds else "strace"

    def start(self) -> "Probe":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for p in _tree(self.pid):
                if _comm(p) == "strace":  # the tracer is not part of what is measured
                    continue
                kb, kind = _memory_kb(p)
                self.memory_kind = kind or self.memory_kind
                total += kb
                if self.sample_fds:
                    self._scan_fds(p)
            self.peak_kb = max(self.peak_kb, total)
            self._stop.wait(self.interval)

    def _scan_fds(self, pid: int) -> None:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            return
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (target + "/").startswith(self.root):
                self._fds.add((pid, int(fd), target))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_mb(self) -> float:
        return self.peak_kb / 1024

    @property
    def fds_seen(self) -> int:
        return len(self._fds)


def wait_and_probe(proc: subprocess.Popen, probe: Probe, timeout: float) -> tuple[str, str]:
    """Run ``proc`` to completion under ``probe``; returns its stdout and stderr."""
    probe.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        probe.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out, err
