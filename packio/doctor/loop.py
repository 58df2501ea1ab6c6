"""In a training loop: how long each step waits for its batch, and why.

    import packio.doctor
    with packio.doctor.watch(loader) as feed:
        for batch in feed:
            step(batch)
    feed.report()          # prints, and returns a WatchReport

Per step the wrapper records the *wait* (from asking for the next batch to getting
it) and the *step* (from handing the batch out to the next request). When the step
runs on a GPU the two are taken from CUDA events on the current stream, so that
asynchronous kernels count where the GPU runs them: the wait is then the time the
GPU sat idle between the end of one step's work and the start of the next one's.
Without CUDA (or ``cuda=False``) both are wall time.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterable, Iterator

import numpy as np

from packio.errors import PackioError
from packio.measure import batch_len, percentile_ms, throughput

__all__ = ["WatchReport", "Watch", "advise", "watch"]
INPUT_BOUND = 0.10  # waiting less than this share of the time: a faster loader would not speed training up


@dataclass
class WatchReport:
    """What ``Watch.report()`` found. Times in seconds unless the name says ms."""

    steps: int
    samples: int
    passes: int
    timing: str  # "CUDA events" or "wall clock"
    wait_s: float
    step_s: float
    input_bound: float  # share of steady-state time spent waiting for data
    wait_p50_ms: float
    wait_p99_ms: float
    step_p50_ms: float
    step_p99_ms: float
    startup_s: float  # mean wait for the first batch of a pass
    batches_per_s: float  # observed while training (steady state)
    samples_per_s: float
    step_needs_per_s: float  # batches/s the step alone could take (1 / mean step)
    loader_alone_per_s: tuple[float, float]  # (low, high) batches/s; low == high when known
    loader_alone_how: str
    num_workers: int | None
    cpus: int
    advice: list[str] = field(default_factory=list)

    def text(self) -> str:
        lo, hi = self.loader_alone_per_s
        alone = f"{lo:.1f}" if abs(hi - lo) <= 0.05 * max(lo, 1e-9) else f"{lo:.1f} to {hi:.1f}"
        lines = [
            self.verdict(),
            f"packio doctor: {self.steps} steps, {self.samples} samples, {self.passes} pass(es); timing: {self.timing}",
            f"  input-bound:      {self.input_bound * 100:.0f} % of the time waits for data "
            f"({self.wait_s:.2f} s waiting, {self.step_s:.2f} s in steps)",
            f"  data wait:        p50 {self.wait_p50_ms:.1f} ms, p99 {self.wait_p99_ms:.1f} ms per step"
            f" (first batch of a pass: {self.startup_s:.2f} s, not counted above)",
            f"  step:             p50 {self.step_p50_ms:.1f} ms, p99 {self.step_p99_ms:.1f} ms "
            f"→ the step could take {self.step_needs_per_s:.1f} batches/s",
            f"  observed:         {self.batches_per_s:.1f} batches/s"
            + (f", {self.samples_per_s:.0f} samples/s" if self.samples else ""),
            f"  loader alone:     {alone} batches/s ({self.loader_alone_how})",
        ]
        lines += [f"  → {a}" for a in self.advice]
        return "\n".join(lines)

    def verdict(self) -> str:
        """The answer first: does training wait for data, and if so what to do."""
        if not self.steps:
            return "verdict: no steps recorded yet"
        if self.input_bound < INPUT_BOUND:
            return (f"verdict: your loader keeps up: nothing to change (training waits {self.input_bound * 100:.0f} % "
                    "of the time)")
        return f"verdict: training waits {self.input_bound * 100:.0f} % of the time; do: " + (
            self.advice[0] if self.advice else "see below")

    def __str__(self) -> str:
        return self.text()


class Watch:
    """Wraps any iterable of batches; see the module docstring. Re-iterable when the
    wrapped object is (one pass per ``for``); every batch passes through unchanged."""

    def __init__(self, iterable: Iterable[Any], *, cuda: bool | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.iterable = iterable
        self.cuda = cuda
        self.clock = clock or time.perf_counter  # wall time in seconds; a simulation may bring its own
        self.waits: list[float] = []  # steady-state waits (GPU idle gaps with CUDA)
        self.steps: list[float] = []
        self.wall_waits: list[float] = []
        self.wall_steps: list[float] = []
        self.startups: list[float] = []
        self.samples = 0
        self._pending: deque[tuple[list[float], Any, Any]] = deque()  # CUDA event pairs to resolve
        self._alone: tuple[float, float] | None = None  # measured (batches/s, samples/s)
        self._timing = "wall clock"

    # -------------------------------------------------------------- the loop

    def _use_cuda(self) -> bool:
        if self.cuda is False:
            return False
        torch = sys.modules.get("torch")
        ready = torch is not None and torch.cuda.is_available() and (self.cuda or torch.cuda.is_initialized())
        if self.cuda and not ready:
            raise PackioError("watch(cuda=True) needs CUDA, and torch sees none; leave cuda=None to time wall clock")
        return bool(ready)

    def _event(self, cuda: bool) -> Any:
        if not cuda:
            return None
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _add(self, wall_list: list[float], gpu_list: list[float], wall: float, a: Any, b: Any) -> None:
        wall_list.append(wall)
        if a is None:
            gpu_list.append(wall)
        else:
            self._pending.append((gpu_list, a, b))
            self._resolve(block=False)

    def _resolve(self, block: bool) -> None:
        """Turn completed CUDA event pairs into milliseconds, oldest first (in order)."""
        while self._pending:
            target, a, b = self._pending[0]
            if not block and not b.query():
                return
            if block:
                b.synchronize()
            target.append(a.elapsed_time(b) / 1e3)
            self._pending.popleft()

    def __iter__(self) -> Iterator[Any]:
        cuda = self._use_cuda()
        self._timing = "CUDA events" if cuda else "wall clock"
        it = iter(self.iterable)
        t_req, ev_req = self.clock(), self._event(cuda)
        first, stepping = True, False
        t_got, ev_got = t_req, ev_req
        try:
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    return
                t_got, ev_got = self.clock(), self._event(cuda)
                if first:  # worker start-up / epoch start: reported apart, not steady state
                    self.startups.append(t_got - t_req)
                    first = False
                else:
                    self._add(self.wall_waits, self.waits, t_got - t_req, ev_req, ev_got)
                self.samples += batch_len(batch) or 0
                stepping = True
                yield batch
                stepping = False
                t_req, ev_req = self.clock(), self._event(cuda)
                self._add(self.wall_steps, self.steps, t_req - t_got, ev_got, ev_req)
        finally:
            if stepping:  # the loop left during a step (break): it ends now
                self._add(self.wall_steps, self.steps, self.clock() - t_got, ev_got, self._event(cuda))

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._resolve(block=True)

    # -------------------------------------------------------------- after the loop

    def measure_loader(self, seconds: float = 3.0) -> tuple[float, float]:
        """Iterate the wrapped loader alone (no step) for ``seconds`` after its first
        batch: (batches/s, samples/s). Needs a re-iterable loader (a DataLoader, a
        list), not a one-shot generator."""
        if iter(self.iterable) is self.iterable:
            raise PackioError("measure_loader() re-iterates the loader, but this one is a one-shot iterator; "
                              "wrap a re-iterable (a DataLoader, a list), or read the estimate in report()")
        r = throughput(self.iterable, seconds)
        self._alone = (r.batches_per_s, r.samples_per_s)
        return self._alone

    def summary(self) -> WatchReport:
        """The figures so far (waits for outstanding CUDA work)."""
        from packio.doctor.limits import budget

        self._resolve(block=True)
        waits, steps = self.waits, self.steps
        n = len(waits)  # steady-state waits: every step's but the first of each pass
        wait_s, step_s = float(sum(waits)), float(sum(steps))
        wall = float(sum(self.wall_waits) + sum(self.wall_steps))
        rate = len(self.wall_steps) / wall if wall > 0 else 0.0
        per_batch = self.samples / max(len(self.wall_steps), 1)
        needs = 1.0 / np.mean(steps) if steps and np.mean(steps) > 0 else float("inf")
        workers = getattr(self.iterable, "num_workers", None)
        if self._alone is not None:
            alone, how = (self._alone[0], self._alone[0]), "measured alone with measure_loader()"
        elif not n:
            alone, how = (0.0, 0.0), "no steady-state steps yet"
        elif workers == 0:
            mean_wait = np.mean(self.wall_waits)
            alone = (1 / mean_wait,) * 2 if mean_wait > 0 else (float("inf"),) * 2
            how = "num_workers=0: the loader works only inside next(), so alone it runs at 1 / mean wait"
        else:
            mean_wait = np.mean(self.wall_waits)
            alone = (rate, 1 / mean_wait if mean_wait > 0 else float("inf"))
            how = ("estimated from wait times: at least the observed rate, at most 1 / mean wait; "
                   "measure_loader() measures it")
        b = budget()
        input_bound = wait_s / (wait_s + step_s) if wait_s + step_s > 0 else 0.0
        rep = WatchReport(
            steps=len(self.wall_steps), samples=self.samples, passes=len(self.startups),
            timing=self._timing,
            wait_s=wait_s, step_s=step_s, input_bound=input_bound,
            wait_p50_ms=percentile_ms(waits, 50), wait_p99_ms=percentile_ms(waits, 99),
            step_p50_ms=percentile_ms(steps, 50), step_p99_ms=percentile_ms(steps, 99),
            startup_s=float(np.mean(self.startups)) if self.startups else 0.0,
            batches_per_s=rate, samples_per_s=rate * per_batch, step_needs_per_s=float(needs),
            loader_alone_per_s=(float(alone[0]), float(alone[1])), loader_alone_how=how,
            num_workers=workers, cpus=b.cpus)
        rep.advice = advise(rep)
        return rep

    def report(self, file: IO[str] | None = sys.stderr) -> WatchReport:
        """Print the summary to ``file`` (None: print nothing) and return it."""
        rep = self.summary()
        if file is not None:
            print(rep.text(), file=file, flush=True)
        return rep


def advise(r: WatchReport) -> list[str]:
    """What to change, from the figures (each line says which figure it rests on)."""
    if not r.steps:
        return ["no steps recorded yet"]
    out: list[str] = []
    if r.input_bound < INPUT_BOUND:
        out.append(f"the step is the bottleneck ({r.input_bound * 100:.0f} % waiting): a faster loader will not "
                   "speed this training up")
    else:
        lo, hi = r.loader_alone_per_s
        workers = "" if r.num_workers is None else f" (num_workers={r.num_workers}, this process may use {r.cpus} CPUs)"
        if hi < r.step_needs_per_s:
            out.append(f"the loader alone delivers at most {hi:.1f} batches/s but the step could take "
                       f"{r.step_needs_per_s:.1f}{workers}: make each sample cheaper — "
                       "`packio doctor DATASET --step-ms {:.0f}` ranks storage layouts (pre-resized images cut the "
                       "decode) — or give the loader more CPUs".format(r.step_p50_ms))
        elif lo >= r.step_needs_per_s:
            out.append(f"the loader alone could keep up ({lo:.1f} ≥ {r.step_needs_per_s:.1f} batches/s) but not "
                       f"while training runs{workers}: it competes with the step for CPUs or its queue runs dry — "
                       "raise prefetch_factor, keep persistent_workers=True, leave CPUs for the main process")
        else:
            out.append(f"the loader alone gives {lo:.1f} to {hi:.1f} batches/s against {r.step_needs_per_s:.1f} the "
                       "step could take; call feed.measure_loader() to tell which, then "
                       "`packio doctor DATASET` for the layout")
        if r.num_workers == 0 and r.cpus > 1:
            out.append(f"num_workers=0 decodes in the training process: with {r.cpus} CPUs, try num_workers="
                       f"{r.cpus} or packio's threads={r.cpus}")
    if r.wait_p99_ms > 5 * max(r.wait_p50_ms, 0.1) and r.wait_p99_ms > 10:
        out.append(f"waits are spiky (p99 {r.wait_p99_ms:.0f} ms vs p50 {r.wait_p50_ms:.1f} ms): a deeper "
                   "prefetch_factor smooths slow batches")
    if r.passes > 1 and r.startup_s > 20 * max(r.step_p50_ms, 1) / 1e3:
        out.append(f"every pass waits {r.startup_s:.2f} s for its first batch: persistent_workers=True keeps "
                   "the workers between epochs")
    return out


def watch(loader: Iterable[Any], *, cuda: bool | None = None, clock: Callable[[], float] | None = None) -> Watch:
    """Wrap ``loader`` (any iterable of batches) to time data waits against steps.
    ``cuda=None``: CUDA events when this process already uses CUDA, else wall time, read
    from ``clock`` (default ``time.perf_counter``)."""
    return Watch(loader, cuda=cuda, clock=clock)
