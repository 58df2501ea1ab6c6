"""Offline diagnosis of a dataset: stage costs, candidate layouts timed on a sample,
a ranked recommendation. Bounded by ``seconds``; sized to the CPU/memory budget."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from packio.doctor import candidates as cand
from packio.doctor.limits import CGROUP_ROOT, Budget, budget, check_options
from packio.doctor.candidates import Candidate
from packio.doctor.gpu import GpuVerdict, measure_gpu_decode, verdict
from packio.doctor.source import Source, disk_bytes, open_source
from packio.doctor.stages import StageCosts, measure_stages, transfer_cost
from packio.errors import PackioError
from packio.measure import Rate
from packio.tuning import measure

__all__ = ["Diagnosis", "diagnose"]


@dataclass
class Diagnosis:
    source: str
    count: int
    sample: int
    size: int
    batch_size: int
    step_ms: float | None
    budget: Budget
    cpus: int
    workers_tried: list[int]
    stages: StageCosts  # of the data as it is
    candidates: list[Candidate]  # ranked, fastest first (errors last)
    gpu: GpuVerdict
    seconds: float  # the budget asked for
    elapsed: float  # what it took
    busy: str = ""  # why the ranking uses CPU time (other load on the machine), or ""
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate | None:
        return next((c for c in self.candidates if not c.now and not c.error), None)

    @property
    def best_with_crops(self) -> Candidate | None:
        return next((c for c in self.candidates if not c.now and not c.error and c.keeps_crops), None)

    @property
    def now(self) -> Candidate | None:
        return next((c for c in self.candidates if c.now), None)

    def expected(self, c: Candidate) -> float:
        """The samples/s the ranking uses: as measured, or from CPU time on a busy machine."""
        return c.ceiling(self.cpus) if self.busy else c.samples_per_s

    @property
    def needed(self) -> float | None:
        """Samples/s the training step takes (from --step-ms)."""
        return self.batch_size / (self.step_ms / 1e3) if self.step_ms else None


def _sample_size(count: int, fraction: float, lo: int, hi: int) -> int:
    return int(min(count, max(lo, min(hi, round(count * fraction)))))


@dataclass
class _Run:
    """What the measurements of one diagnosis share."""

    src: Source
    idx: list[int]  # the sample, as source indices
    size: int
    batch_size: int
    root: Path  # temporary folder
    sample_dir: Path  # the sample exported as an image folder
    pack_workers: int
    workers: list[int]  # num_workers settings packio.tune tries
    threads: tuple[int, ...]  # decode threads settings packio.tune tries
    quick: bool  # too little time for packio.tune: one setting per layout
    xfer: float  # per-sample worker → main hand-over cost
    say: Callable[[str], None]
    jpegs: list[bytes] = field(default_factory=list)  # a batch of original JPEG bytes (GPU decode check)
    packed: dict[str, Path] = field(default_factory=dict)  # layout tag → its pack of the sample
    sizes: list[tuple[int, int]] = field(default_factory=list)  # the sample's stored (h, w), from headers

    @property
    def trials(self) -> int:
        """Timed runs per layout: packio.tune's grid + a re-measure of its pick, or one."""
        return 1 if self.quick else len(self.workers) * len(self.threads) + 1

    def rate(self, ds: Any, trial_s: float, batch: int) -> tuple[Rate, dict[str, Any]]:
        if self.quick or batch < self.batch_size:  # decode threads in this process: no worker start-up to pay for
            settings: dict[str, Any] = {"num_workers": 0, "threads": max(self.threads)}
            return measure(ds, batch, trial_s, settings), settings
        return cand.tune_and_measure(ds, self.batch_size, trial_s, self.workers, self.threads)

    def timed_batch(self, c: Candidate, left: float) -> int:
        """The batch size to time ``c`` with in ``left`` seconds: the training batch, fewer
        samples when one batch alone would take most of that time (huge images), 0 when even
        a first and a timed batch of one sample do not fit: ``c`` is then estimated."""
        per, threads = (c.stages.total if c.stages is not None else 0.0), max(max(self.threads), 1)
        if per <= 0 or self.batch_size * per / threads <= max(left, 1.0):
            return self.batch_size
        return 0 if 2 * per > left else max(1, int(left * threads / (2 * per)))


def diagnose(path: str | Path, *, size: int = 224, batch_size: int = 64, seconds: float = 60.0,
             fraction: float = 0.02, min_samples: int = 256, max_samples: int = 1000,
             step_ms: float | None = None, gpu_decode_ms: float | None = None, csv: str | Path | None = None,
             csv_columns: str | None = None,
             work: str | Path | None = None, keep: bool = False, cgroup_root: str | Path = CGROUP_ROOT,
             cpus: int | None = None, seed: int = 0, log: Callable[[str], None] | None = None) -> Diagnosis:
    """Measure the dataset at ``path`` (image folder or packed) and rank layouts.

    A sample of ``fraction`` of the samples (at least ``min_samples``, at most
    ``max_samples``, fewer when packing would not fit the time) is packed into each
    layout of :func:`packio.doctor.candidates.layouts` in a temporary folder (under
    ``work``; removed unless ``keep``), and each is timed with the settings
    ``packio.tune`` finds within the CPU budget, on a warm page cache.

    ``seconds`` bounds the run: the sample shrinks (to 2 batches at least) so that
    packing fits ~30 % of it; tuning trials share what is left; when even the
    shortest trials would not fit, tuning is skipped (one setting per layout, said
    in the notes). Every layout is measured, within ``seconds`` and half as much again:
    with huge images a layout may be timed on smaller batches, estimated from its stage
    costs, packed from part of the sample, or left "not measured" (each said in the
    report); the report says how long it took.
    ``gpu_decode_ms``: a declared nvjpeg time per batch, used only without CUDA.
    ``csv_columns``: the CSV's column map (``class=cell_type``), for the listing and the
    convert lines.
    """
    check_options(size=size, batch_size=batch_size, seconds=seconds, fraction=fraction, min_samples=min_samples,
                  max_samples=max_samples, step_ms=step_ms, gpu_decode_ms=gpu_decode_ms, cpus=cpus)
    say = log or (lambda _msg: None)
    t0 = time.perf_counter()
    b = budget(cgroup_root)
    ncpu = max(1, cpus or b.cpus)
    load_before = _load()
    src = open_source(path, csv, csv_columns)
    if not src.count:
        raise PackioError(f"{path}: holds no samples; nothing to measure")
    n = _sample_size(src.count, fraction, min_samples, max_samples)
    order = [int(i) for i in np.random.default_rng(seed).permutation(src.count)]  # any prefix: a fair sample
    say(f"budget: {b.text()}" + (f"; using {ncpu} CPUs as asked" if cpus else ""))

    say("measuring per-stage costs ...")
    xfer = transfer_cost(batch_size, size, seconds=min(1.0, 0.02 * seconds))
    t_stages = time.perf_counter()
    stages = measure_stages("as stored", src.payload, order[:min(n, 64)], size, batch_size, xfer,
                            deadline=t0 + 0.12 * seconds)
    # wall time per sample pass, preemption by other processes included: what packing will see
    stage_wall = (time.perf_counter() - t_stages) / max(stages.passes, 1)
    notes: list[str] = []
    p = _plan(n, order, stages, stage_wall, size=size, batch_size=batch_size, seconds=seconds, ncpu=ncpu, b=b,
              t0=t0, csv=bool(csv), notes=notes)
    with _workdir(work, keep, say) as root:
        run = _Run(src, p.idx, size, batch_size, root, src.export(p.idx, root / "sample"), p.pack_workers,
                   p.workers, p.threads, p.quick, xfer, say, sizes=src.sizes(p.idx))
        out = _measure_all(run, p.lays, (t0 + seconds, 0.5 * seconds), p.pack_est, p.first_batch, stages, notes)

    ranked, busy = _rank(out, src.count, b, ncpu, load_before, notes)
    return Diagnosis(source=src.describe(), count=src.count, sample=len(p.idx), size=size, batch_size=batch_size,
                     step_ms=step_ms, budget=b, cpus=ncpu, workers_tried=[0] if p.quick else p.workers, stages=stages,
                     candidates=ranked, gpu=_gpu(run, ranked, stages, ncpu, step_ms, gpu_decode_ms),
                     seconds=seconds, elapsed=time.perf_counter() - t0, busy=busy, notes=notes)


@dataclass(frozen=True)
class _Plan:
    """What one diagnosis measures: the sample, the layouts and the loader settings to try."""

    lays: list[cand.Layout]
    idx: list[int]  # the sample, as source indices
    pack_workers: int
    workers: list[int]
    threads: tuple[int, ...]
    pack_est: dict[str, float]  # layout tag → its estimated packing seconds
    first_batch: float  # seconds each trial waits for its first batch
    quick: bool  # too little time for packio.tune: one setting per layout


def _plan(n: int, order: list[int], stages: StageCosts, stage_wall: float, *, size: int, batch_size: int,
          seconds: float, ncpu: int, b: Budget, t0: float, csv: bool, notes: list[str]) -> _Plan:
    """Fit the sample and the settings to ``seconds`` and the budget; ``notes`` say what was cut."""
    if csv:
        notes.append("the CSV's boxes are not packed into the sample: they change little of a sample's cost")
    if stages.skipped:
        notes.append(f"{stages.skipped} of the sampled files did not decode (skipped; packio convert counts them)")
    # Pre-resizing the originals costs a full decode + area resize + encode per sample
    # (~2.5 x a read-time pass); layouts packed from that pack cost little. Packing gets
    # ~30 % of the budget, but the sample keeps 2 batches at least.
    lays = cand.layouts(size)
    heavy = sum(1 for lay in lays if lay.resize and not lay.pack_from)
    pack_cost = 2.5 * stage_wall + 1e-3
    n = max(min(n, 2 * batch_size), min(n, int(0.3 * seconds * ncpu / (heavy * pack_cost))))
    idx = sorted(order[:n])
    # A process pool pays off only for long packs: its forkserver imports this program
    # (torch included) before the first worker starts: seconds on a busy machine.
    pack_workers = ncpu if ncpu > 1 and heavy * n * pack_cost > 15.0 else 0

    max_w = b.max_workers(batch_size * size * size * 3)
    # one CPU: a worker process only adds hand-over costs to the loader alone
    workers = sorted({0, min(ncpu, max_w) if ncpu > 1 else 0} | ({min(ncpu // 2, max_w)} if ncpu >= 4 else set()))
    threads = (0, ncpu) if ncpu > 1 else (0,)
    if max_w < ncpu:
        notes.append(f"memory allows {max_w} workers (of {ncpu} CPUs) at batch {batch_size}")
    pack_est = {lay.tag: n * (pack_cost / max(1, pack_workers) if lay.resize and not lay.pack_from else 2e-3)
                for lay in lays}
    first_batch = batch_size * stages.total  # each trial waits for a first batch before it times anything
    jobs = len(lays) + 1  # + the data as stored now
    full = jobs * (len(workers) * len(threads) + 1) * (0.2 + 0.3 + first_batch)
    quick = time.perf_counter() - t0 + sum(pack_est.values()) + full > 0.9 * seconds
    if quick:
        notes.append(f"--seconds {seconds:g} leaves no time to tune: the layouts timed used num_workers=0, "
                     f"threads={max(threads)} (raise --seconds for packio.tune's pick)")
    return _Plan(lays, idx, pack_workers, workers, threads, pack_est, first_batch, quick)


@contextlib.contextmanager
def _workdir(work: str | Path | None, keep: bool, say: Callable[[str], None]) -> Iterator[Path]:
    """A temporary folder (under ``work``) for the packed samples, removed afterwards unless ``keep``."""
    root = Path(tempfile.mkdtemp(prefix="packio-doctor-", dir=str(work) if work else None))
    try:
        yield root
    finally:
        if keep:
            say(f"kept the packed samples in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _load() -> float:
    """The machine's 1-minute load average (0 where the platform has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def _rank(out: list[Candidate], count: int, b: Budget, ncpu: int, load_before: float,
          notes: list[str]) -> tuple[list[Candidate], str]:
    """Full-size disk figures, then the ranking: by measured samples/s, or by CPU time
    per sample when other processes kept the machine busy (wall-clock rates are a
    lottery then; CPU time per sample is disturbed far less)."""
    for c in out:
        c.full_bytes = c.bytes_per_sample * count
        if c.full_bytes > b.memory_free and not c.error:
            c.note = (c.note + "; " if c.note else "") + (
                f"{c.full_bytes / 2**30:.1f} GiB > {b.memory_free / 2**30:.1f} GiB of memory: will not stay in the "
                f"page cache; needs {c.samples_per_s * c.bytes_per_sample / 1e6:.0f} MB/s from disk")
    machine = os.cpu_count() or 1
    others = max(load_before, _load() - ncpu)
    busy = f"load {others:.1f} from other processes on {machine} CPUs" if others > machine else ""
    if busy:
        notes.append(f"the machine was busy ({busy}): ranked by CPU time per sample (≤ samples/s on {ncpu} CPUs "
                     "of its own); the measured samples/s are shown as measured")
    notes.append("rates: warm page cache, the sample repeated so that every timed epoch holds ≥ 32 batches; "
                 "the machine's other load counts (a shared machine gives noisy figures)")
    ranked = sorted(out, key=lambda c: (bool(c.error), -(c.ceiling(ncpu) if busy else c.samples_per_s)))
    return ranked, busy


def _measure_all(run: _Run, lays: list[cand.Layout], until: tuple[float, float], pack_est: dict[str, float],
                 first_batch: float, stages: StageCosts, notes: list[str]) -> list[Candidate]:
    """The data as stored, then each layout; trial lengths share the time left. ``until``:
    the deadline, and how far past it a layout's packing may end (else it is skipped)."""
    deadline, grace = until
    folder = run.src.kind == "folder"
    now = Candidate(title="files (one open per sample)" if folder else f"as stored ({run.src.format})", tag="now",
                    now=True, bytes_per_sample=run.src.stored_bytes(run.idx), stages=stages)
    # a folder's baseline is timed right after the original-bytes layout, with its settings
    trials = {lay.tag: run.trials + (folder and lay.tag == "orig") for lay in lays}
    trials["now"] = 0 if folder else run.trials
    jobs: list[tuple[str, cand.Layout | None]] = [("now", None), *[(lay.tag, lay) for lay in lays]]
    overhead = (0.02 if run.quick else 0.3) + first_batch  # per trial, beyond its timed seconds; learned below
    out: list[Candidate] = []
    for k, (tag, lay) in enumerate(jobs):
        rest = [t for t, _ in jobs[k:]]
        left = deadline - time.perf_counter() - 0.3  # a moment for the report
        pack_left = sum(pack_est.get(t, 0.0) for t in rest)
        trial_s = max(0.2, (left - pack_left) / max(1, sum(trials[t] for t in rest)) - overhead)
        t_job = time.perf_counter()
        if lay is None:
            c = now
            if not folder:
                _measure_stored(run, c, trial_s, trials[tag] * trial_s)
        else:
            slot = _Slot(left, pack_est[tag], trials[tag] * trial_s, grace)
            c = _measure_layout(run, lay, trial_s, now, slot, stages)
        out.append(c)
        if lay is not None and c.pack_s_per_sample:
            for t, j in jobs[k + 1:]:  # what packing really costs here, for the layouts still to come
                if j is not None and (j.pack_from, bool(j.resize)) == (lay.pack_from, bool(lay.resize)):
                    pack_est[t] = c.pack_s_per_sample * len(run.idx)
        if trials[tag] and not c.estimated and not c.error:
            spent = time.perf_counter() - t_job - c.pack_s_per_sample * len(run.idx)
            overhead = min(5.0, max(0.02, (spent - trials[tag] * trial_s) / trials[tag]))
    over = time.perf_counter() - deadline
    if over > 0:
        notes.append(f"took {over:.0f} s more than --seconds: every layout measured got its shortest trials")
    return out


@dataclass(frozen=True)
class _Slot:
    """The time one layout may take: ``left`` for everything still to do, ``pack`` its
    estimated packing, ``timing`` its trials. A pack that would end more than ``grace`` past
    the deadline is skipped (a layout's pack of a few huge images can take minutes)."""

    left: float
    pack: float
    timing: float
    grace: float


def _measure_stored(run: _Run, c: Candidate, trial_s: float, slot: float) -> None:
    """A packed source as it is: its own sampled indices, its own format."""
    run.say(f"timing {c.title} ...")
    try:
        index = np.asarray(run.idx)[cand.repeat_index(len(run.idx), run.batch_size)]
        ds = cand.IndexedDataset(run.src.path, index, resize=run.size, on_error="skip")  # a damaged one: dropped
        _time(run, c, ds, trial_s, slot)
    except PackioError as exc:
        c.error = str(exc)
    c.reader_lines = cand.reader_lines(str(run.src.path), run.size, run.batch_size, c.settings)


def _time(run: _Run, c: Candidate, ds: Any, trial_s: float, slot: float, resized: bool = True) -> None:
    """Time ``c`` reading ``ds`` within ``slot`` seconds, or estimate it from its stage costs
    when a sample takes too long for even two (huge images): never past the budget. Its
    stage costs then keep only the stages its loader runs (see ``StageCosts.as_loaded``)."""
    batch = run.timed_batch(c, slot)
    if not batch:
        per = c.stages.total if c.stages is not None else 0.0
        if c.stages is not None:
            c.stages = c.stages.as_loaded(workers=False, resized=resized)
        c.estimate(max(run.threads), f"not timed: one sample takes ~{per:.1f} s on a core, too long to time "
                                     f"within --seconds; estimated from its stage costs on {max(run.threads)} threads")
        return
    c.measured(*run.rate(ds, trial_s, batch))
    c.timed_batch = batch if batch < run.batch_size else 0
    if c.stages is not None:
        c.stages = c.stages.as_loaded(workers=bool(c.settings.get("num_workers")), resized=resized)


def _measure_layout(run: _Run, lay: cand.Layout, trial_s: float, now: Candidate, slot: _Slot,
                    stages: StageCosts) -> Candidate:
    """Pack the sample as ``lay``, measure its stages and its rate (and, after the
    original bytes of a folder, the one-file-per-sample baseline ``now``)."""
    out_name = cand.output_name(run.src.name, lay)
    c = Candidate(title=lay.title, tag=lay.tag, keeps_crops=lay.keeps_crops,
                  convert_line=cand.convert_line(run.src.path, out_name, lay, run.src.csv, run.src.csv_columns),
                  reader_lines=cand.reader_lines(out_name, lay.reader_resize, run.batch_size, {}),
                  enlarged=cand.enlarged(lay, run.sizes))
    src_dir = run.packed.get(lay.pack_from or "", run.sample_dir)
    n = len(run.idx)
    fit = n if slot.pack <= slot.left + slot.grace else int((slot.left + slot.grace) / (slot.pack / n))
    if lay.pack_from and lay.pack_from not in run.packed:
        c.error = f"not measured: it is packed from the {lay.pack_from} layout's sample, which was not"
    elif fit < 1:
        c.error = (f"not measured: packing one sample takes ~{slot.pack / n:.0f} s here, more than --seconds "
                   "leaves (raise --seconds)")
    else:
        if fit < n:  # a part of the sample, spread over it: the rate does not depend on how many
            part = run.idx[::-(-n // fit)]
            src_dir = run.src.export(part, run.root / f"sample-{lay.tag}")
            c.note = f"packed {len(part)} of the {n} sampled images: more would not fit --seconds"
        _pack_and_time(run, lay, c, src_dir, trial_s, now, slot, stages)
    c.reader_lines = cand.reader_lines(out_name, lay.reader_resize, run.batch_size, c.settings)
    return c


def _pack_and_time(run: _Run, lay: cand.Layout, c: Candidate, src_dir: Path, trial_s: float, now: Candidate,
                   slot: _Slot, stages: StageCosts) -> None:
    from packio.formats import open_reader

    dst = run.root / cand.output_name(run.src.name, lay)
    run.say(f"packing {len(run.idx)} samples as {lay.title} ...")
    try:
        heavy = lay.resize is not None and not lay.pack_from  # a full decode of every original
        packed, secs = cand.pack(src_dir, dst, lay, workers=run.pack_workers if heavy else 0)
        if not packed:
            raise PackioError("no sample of the source could be packed")
        c.pack_s_per_sample = secs / packed
        run.packed[lay.tag] = dst
        c.bytes_per_sample = disk_bytes(dst) / packed
        reader = open_reader(dst)
        try:
            if lay.resize is None and run.src.kind == "folder":  # the original files' bytes: measured already
                c.stages = dataclasses.replace(stages, layout=lay.title)
            else:
                c.stages = measure_stages(lay.title, lambda i: reader.read(i).payload, list(range(min(8, packed))),
                                          run.size, run.batch_size, run.xfer,
                                          deadline=time.perf_counter() + max(0.25, 0.05 * slot.left))
            if lay.tag == "orig":
                run.jpegs[:] = [p for p in (bytes(reader.read(i).payload) for i in range(min(run.batch_size, packed)))
                                if p[:3] == b"\xff\xd8\xff"]
            run.say(f"timing {lay.title} ...")
            ds = cand.IndexedDataset(dst, cand.repeat_index(packed, run.batch_size), resize=lay.reader_resize)
            _time(run, c, ds, trial_s, slot.timing, resized=lay.reader_resize is not None)
            ds.reader.close()
            if lay.tag == "orig" and run.src.kind == "folder":
                _time_files(run, c, now, reader, trial_s, slot.timing)
        finally:
            reader.close()
    except PackioError as exc:
        c.error = str(exc)


def _time_files(run: _Run, orig: Candidate, now: Candidate, reader: Any, trial_s: float, slot: float) -> None:
    """The one-file-per-sample baseline, with the settings of the original-bytes layout."""
    run.say(f"timing {now.title} ...")
    batch = run.timed_batch(now, slot)
    if not batch or orig.estimated:
        if now.stages is not None:  # as _time does: an estimate keeps only the stages its loader runs
            now.stages = now.stages.as_loaded(workers=False, resized=True)
        now.estimate(max(run.threads), orig.estimated or "not timed: a sample takes too long for --seconds")
        return
    paths = [str(run.sample_dir / reader.read(i).key) for i in range(len(reader))]
    settings = cand.process_settings(orig.settings)
    now.measured(cand.measure_files(paths, run.size, batch, settings, trial_s), settings)
    now.timed_batch = batch if batch < run.batch_size else 0
    if now.stages is not None:
        now.stages = now.stages.as_loaded(workers=bool(settings.get("num_workers")), resized=True)
    now.note = "DataLoader settings of the original-bytes LMDB" + (
        " (its decode threads as worker processes)" if orig.settings.get("threads", 0) > 1
        and not orig.settings.get("num_workers") else "")


def _gpu(run: _Run, ranked: list[Candidate], stages: StageCosts, ncpu: int, step_ms: float | None,
         declared_ms: float | None) -> GpuVerdict:
    import torch

    original = next((c for c in ranked if c.tag == "orig" and not c.error), None)
    best = next((c for c in ranked if not c.now and not c.error), None)
    base = original.stages if original and original.stages else stages
    no_decode = base.read + base.collate + base.transfer
    cuda = torch.cuda.is_available()
    gpu_ms, how = None, ""
    if cuda:
        gpu_ms = measure_gpu_decode(run.jpegs, run.batch_size)
        how = "measured" if gpu_ms is not None else ""
    elif declared_ms is not None:
        gpu_ms, how = declared_ms, "declared by --gpu-decode-ms, not measured"
    return verdict(batch_size=run.batch_size, step_ms=step_ms,
                   cpu_rate_original=original.samples_per_s if original else 0.0,
                   cpu_ceiling_no_decode=ncpu / no_decode if no_decode > 0 else float("inf"),
                   decode_share=base.share("decode") + base.share("resize"),
                   best_rate=best.samples_per_s if best else 0.0, best_title=best.title if best else "-",
                   gpu_ms=gpu_ms, how=how, cuda=cuda)
