"""The one timing and reporting module of the developer benchmarks (``tools/*.py``).

Every benchmark here times its cases in interleaved rounds (the order reversed every
other round, so a load trend on a shared machine cancels out), reports medians and
ratios, and prints markdown tables. Timings on a shared machine are noisy: compare
ratios from one run, and take figures for claims on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"  # the real photo sets (see its README)
if str(ROOT) not in sys.path:  # run from a checkout: this packio, not an installed one
    sys.path.insert(0, str(ROOT))

__all__ = ["ROOT", "DATA", "parser", "median", "interleaved", "per_call", "rate", "fresh", "table", "need",
           "subcommands"]


def parser(doc: str | None, rounds: int = 3) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark shares (``--rounds``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds; medians reported ({rounds})")
    return ap


def median(values: Iterable[float]) -> float:
    """Median of the finite values; nan when there are none (a failed case)."""
    ok = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(ok) if ok else float("nan")


def interleaved(cases: dict[str, Callable[[], float]], rounds: int, progress: bool = True) -> dict[str, list[float]]:
    """Each case's figures over ``rounds`` rounds, every case once per round, the order
    reversed every other round. Prints one progress line per round."""
    got: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        names = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in names:
            got[name].append(cases[name]())
        if progress:
            print(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.4g}" for k, v in got.items()), flush=True)
    return got


def per_call(fn: Callable[[], object], n: int, warmup: int = 1) -> float:
    """Mean seconds per call of ``fn`` over ``n`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def rate(epoch: Callable[[], int], seconds: float) -> float:
    """Items per second of repeated ``epoch()`` calls (each returns its item count) for at least ``seconds``."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += epoch()
    return n / (time.perf_counter() - t0)


def fresh(script: str | Path, cfg: dict[str, Any], env: dict[str, str] | None = None, timeout: float = 1800,
          command: Sequence[str] = (), python: str | None = None) -> dict[str, Any]:
    """Run ``script [command] --child JSON`` in a fresh process (of ``python``, default this
    one); its last stdout line is a JSON dict. A failure comes back as ``{"error": last
    stderr line}``, never as a figure."""
    r = subprocess.run([python or sys.executable, str(script), *command, "--child", json.dumps(cfg)],
                       capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, **(env or {}), "PYTHONWARNINGS": "ignore"})
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None) -> str:
    """A markdown table (numbers right-aligned), printed and returned."""
    lines = [title, ""] if title else []
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def need(found: Sequence[Any], what: str, fix: str) -> None:
    """Exit non-zero with a message saying how to fix it when a benchmark has nothing to measure."""
    if not found:
        raise SystemExit(f"{Path(sys.argv[0]).name}: no {what} found; {fix}")


def subcommands(commands: dict[str, Callable[[list[str]], int]], doc: str | None,
                argv: list[str] | None = None) -> int:
    """``script.py NAME [options]``: run one of ``commands`` (each takes its own argv)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in commands:
        print((doc or "").strip() + "\n\ncommands: " + ", ".join(commands) + "  (NAME --help for options)",
              file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return commands[argv[0]](argv[1:])
