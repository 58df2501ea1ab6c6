"""packio doctor: the in-loop wrapper's numbers against known delays, the CPU/memory
budget from cgroup files, and the offline recommendation on large slow-to-decode JPEGs."""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import packio
from packio import cli
from packio.doctor import report
from packio.doctor.limits import budget
from packio.doctor.loop import watch
from packio.doctor.offline import diagnose
from packio.errors import PackioError


class Clock:
    """A simulated wall clock: the loader and the step advance it by what they take, so the
    figures the wrapper reports are checked exactly, on any machine under any load (they
    were checked against real sleeps, which a busy machine stretches)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedLoader:
    """Batches of 4 labels, batch i taking ``delays[i]`` seconds of the clock."""

    def __init__(self, clock: Clock, delays: np.ndarray) -> None:
        self.clock, self.delays = clock, delays

    def __iter__(self):
        for i, d in enumerate(self.delays):
            self.clock.now += d
            yield {"label": torch.arange(4) + 4 * i}


def run_loop(loader_delay: float, step_delay: float, n: int = 30):
    """Each loader batch and each step takes its delay, ±50 % (seeded), on a simulated clock."""
    rng = np.random.default_rng(0)
    clock = Clock()
    loader = TimedLoader(clock, loader_delay * rng.uniform(0.5, 1.5, n))
    steps, seen = step_delay * rng.uniform(0.5, 1.5, n), []
    with watch(loader, cuda=False, clock=clock) as feed:
        for k, batch in enumerate(feed):
            seen.append(batch["label"])
            clock.now += steps[k]
    return feed, feed.report(file=None), loader, steps, seen


def test_watch_slow_loader_is_input_bound():
    feed, rep, loader, steps, seen = run_loop(0.020, 0.005)
    waits = loader.delays[1:]  # the first wait is start-up, reported apart
    assert rep.steps == 30 and rep.samples == 120 and rep.passes == 1 and rep.timing == "wall clock"
    assert torch.equal(torch.cat(seen), torch.arange(120))  # every batch passed through, in order
    assert rep.startup_s == pytest.approx(loader.delays[0])
    assert rep.wait_s == pytest.approx(waits.sum()) and rep.step_s == pytest.approx(steps.sum())
    assert rep.input_bound == pytest.approx(waits.sum() / (waits.sum() + steps.sum())) and rep.input_bound > 0.75
    assert rep.wait_p50_ms == pytest.approx(np.percentile(waits, 50) * 1e3)
    assert rep.wait_p99_ms == pytest.approx(np.percentile(waits, 99) * 1e3)
    assert rep.step_p50_ms == pytest.approx(np.percentile(steps, 50) * 1e3)
    # a loader of unknown kind: at least the rate observed, at most 1 / mean wait
    assert rep.loader_alone_per_s == pytest.approx((30 / (waits.sum() + steps.sum()), 1 / waits.mean()))
    assert "waits for data" in rep.text() and rep.advice and rep.verdict().startswith("verdict: training waits")
    batches_s, samples_s = feed.measure_loader(seconds=0.05)  # the loader alone, re-iterated
    assert batches_s > 0 and samples_s == pytest.approx(4 * batches_s)
    assert feed.report(file=None).loader_alone_how.startswith("measured")


def test_watch_slow_step_is_not_input_bound():
    _, rep, loader, steps, _ = run_loop(0.005, 0.020)
    waits = loader.delays[1:]
    assert rep.input_bound == pytest.approx(waits.sum() / (waits.sum() + steps.sum())) and rep.input_bound < 0.25
    assert rep.wait_s == pytest.approx(waits.sum()) and rep.step_s == pytest.approx(steps.sum())


def test_watch_break_passes_and_one_shot():
    batches = [[i] for i in range(10)]
    feed = watch(batches)
    for k, b in enumerate(feed):
        if k == 4:
            break  # the step in progress ends when the loop leaves
    assert list(feed) == batches  # a second pass sees everything again
    rep = feed.report(file=None)
    assert rep.passes == 2 and rep.steps == 15 and rep.samples == 15
    assert len(feed.waits) == 15 - 2  # the first wait of each pass is start-up
    with pytest.raises(PackioError, match="one-shot"):
        watch(iter(batches)).measure_loader(0.1)
    if not torch.cuda.is_available():
        with pytest.raises(PackioError, match="needs CUDA"):
            list(watch(batches, cuda=True))


def test_watch_with_worker_processes(gen_folder, tmp_path):
    src, _ = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", progress=False)
    ds = packio.open_dataset(tmp_path / "d.lmdb", resize=32)
    loader = packio.DataLoader(ds, batch_size=3, num_workers=2, shuffle=True)
    keys = []
    with watch(loader) as feed:
        for batch in feed:
            keys += batch["key"]
    rep = feed.report(file=None)
    assert sorted(keys) == sorted(ds.sample(i).key for i in range(len(ds)))  # each sample exactly once
    assert rep.samples == len(ds) and rep.num_workers == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_watch_cuda_counts_asynchronous_kernels():
    """The step only queues GPU work (returns at once); the loader is instant. Wall
    time would call this input-bound; CUDA events see a busy GPU."""
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    with watch([0] * 20, cuda=True) as feed:
        for _ in feed:
            for _ in range(20):
                x = (x @ x).clamp_(-1, 1)
    rep = feed.report(file=None)
    assert rep.timing == "CUDA events" and rep.input_bound <= 0.1 and rep.step_p50_ms > 5


# ------------------------------------------------------------------ budget

def _files(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_budget_cgroup_v2_tightest_level_wins(tmp_path):
    root = _files(tmp_path / "cg", {
        "cgroup.controllers": "cpu memory", "cpu.max": "max 100000", "memory.max": "max",
        "job/cpu.max": "150000 100000", "job/memory.max": str(3 << 30),
        "job/step/cpu.max": "400000 100000", "job/step/memory.max": "max", "job/step/memory.current": str(1 << 30)})
    own = _files(tmp_path, {"self": "0::/job/step\n"}) / "self"
    b = budget(root, own, affinity=8, physical=16 << 30)
    assert b.cpu_quota == 1.5 and b.cpus == 1  # 1.5 CPUs → 1 worker's worth, not 2
    assert b.memory == 3 << 30 and b.memory_limited and b.memory_used == 1 << 30
    assert b.max_workers(batch_bytes=100 << 20) == 1
    assert str(root / "job" / "cpu.max") in b.sources and "1.5" in b.text()


def test_budget_cgroup_v1_and_no_limits(tmp_path):
    root = _files(tmp_path / "cg", {
        "cpu,cpuacct/cpu.cfs_quota_us": "250000", "cpu,cpuacct/cpu.cfs_period_us": "100000",
        "memory/memory.limit_in_bytes": str(2 << 30), "memory/memory.usage_in_bytes": "0"})
    own = _files(tmp_path, {"self": "4:memory:/\n2:cpu,cpuacct:/\n"}) / "self"
    b = budget(root, own, affinity=4, physical=16 << 30)
    assert (b.cpus, b.cpu_quota, b.memory, b.memory_limited) == (2, 2.5, 2 << 30, True)
    free = _files(tmp_path / "free", {
        "cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000",
        "memory/memory.limit_in_bytes": "9223372036854771712"})
    b = budget(free, own, affinity=4, physical=16 << 30)
    assert (b.cpus, b.cpu_quota, b.memory, b.memory_limited) == (4, None, 16 << 30, False)
    b = budget(tmp_path / "absent", tmp_path / "absent-self", affinity=3, physical=1 << 30)
    assert (b.cpus, b.memory) == (3, 1 << 30)


# ------------------------------------------------------------------ offline

def big_jpegs(root: Path, n: int, seed: int = 0) -> Path:
    """Large photo-like JPEGs (1600x1200, q95, no chroma subsampling): slow to decode."""
    import cv2
    import simplejpeg

    rng = np.random.default_rng(seed)
    grain = rng.normal(0, 10, (1300, 1700, 3)).astype(np.int16)  # one noise field, cropped per image
    for i in range(n):
        small = rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)
        y, x = (int(v) for v in rng.integers(0, 100, 2))
        img = cv2.resize(small, (1600, 1200), interpolation=cv2.INTER_CUBIC) + grain[y:y + 1200, x:x + 1600]
        d = root / f"class_{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        jpg = simplejpeg.encode_jpeg(np.clip(img, 0, 255).astype(np.uint8), quality=95, colorsubsampling="444")
        (d / f"img_{i:03d}.jpg").write_bytes(jpg)
    return root


def test_recommends_a_preresized_layout_for_large_jpegs(tmp_path, monkeypatch):
    src = big_jpegs(tmp_path / "big", 16)
    one_cpu = _files(tmp_path / "cg", {"cgroup.controllers": "cpu", "cpu.max": "100000 100000"})
    d = diagnose(src, size=224, batch_size=8, seconds=5, cgroup_root=one_cpu, work=tmp_path)
    assert d.cpus == 1 and d.budget.cpu_quota == 1.0  # sized to the cgroup's 1 CPU, not the machine's
    assert d.sample == 16 and not [c.error for c in d.candidates if c.error]
    assert d.stages.share("decode") > 0.5 and d.stages.stored_hw == (1200, 1600)
    titles = [c.title for c in d.candidates]
    best = d.candidates[0]
    assert best.tag in ("jpeg256", "bmp256", "u8-224"), titles  # a pre-resized layout ranks first
    orig = next(c for c in d.candidates if c.tag == "orig")
    assert orig.cpu_per_sample > 1.5 * best.cpu_per_sample  # the work per sample (CPU time), not a wall-clock race
    assert best.full_bytes == pytest.approx(best.bytes_per_sample * 16)
    # stage costs count the stages each loader runs: no worker hand-over without workers (1 CPU:
    # none), no read-time resize of arrays stored at the training size (the chart's 241 µs vs 44)
    timed = [c for c in d.candidates if c.stages is not None and not c.error]
    assert timed and all(c.stages.transfer == 0 for c in timed if not c.settings.get("num_workers"))
    assert all(c.stages.resize == 0 for c in timed if c.tag == "u8-224")
    assert not list(tmp_path.glob("packio-doctor-*"))  # the packed samples are gone
    # the printed lines do what they say: convert the full folder, then read it
    monkeypatch.chdir(tmp_path)
    args = shlex.split(best.convert_line)
    assert args[:2] == ["packio", "convert"] and cli.main(args[1:] + ["--quiet"]) == 0
    ns = {"packio": packio}
    exec("\n".join(best.reader_lines), ns)
    batch = next(iter(ns["loader"]))
    assert tuple(batch["image"].shape) == (8, 3, 224, 224)
    text = report.text(d)
    assert "recommendation: " + best.title in text and best.convert_line in text and "GPU decode" in text
    md, png = report.write(d, tmp_path / "rep")
    assert best.convert_line in md.read_text() and "timed loader, CPU µs/sample |" in md.read_text()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert png is None and "matplotlib is missing" in md.read_text()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](doctor.png)" in md.read_text()


def test_cli_doctor_on_a_packed_dataset(gen_folder, tmp_path, capsys):
    src, _ = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", progress=False)
    assert cli.main(["doctor", str(tmp_path / "d.lmdb"), "--seconds", "8", "--batch-size", "4", "--size", "64",
                     "--cpus", "1", "--step-ms", "10", "--quiet", "--work", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "as stored (lmdb)" in out and "recommendation:" in out
    assert "num_workers tried [0]" in out and "no time to tune" not in out  # packio.tune picked (1 CPU: no workers)
    assert f"packio convert {tmp_path / 'd.lmdb'} d-" in out  # output named after the dataset
    assert "a 10 ms step of 4 takes 400 samples/s" in out
    # the 60-95 px images are smaller than the short side 73 the layouts pack: said where they appear
    assert re.search(r"JPEG short side 73 q90, LMDB .*enlarges \d+ sampled images", out), out
    assert "cannot tell without a GPU" in out or "GPU decode (measured)" in out
    assert cli.main(["doctor", str(tmp_path / "missing")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cpu_seconds_counts_worker_processes():
    """The CPU time behind the busy-machine ranking includes live child processes."""
    import multiprocessing as mp

    from packio.measure import cpu_seconds

    ctx = mp.get_context("fork")
    go = ctx.Event()
    child = ctx.Process(target=lambda: (_spin(0.3), go.set(), time.sleep(5)))
    before = cpu_seconds()
    child.start()
    try:
        assert go.wait(20)
        assert cpu_seconds() - before >= 0.25  # the child's 0.3 s of CPU, while it is alive
    finally:
        child.terminate()
        child.join()


def test_watch_report_leads_with_the_verdict():
    _, fast, *_ = run_loop(0.001, 0.040, n=20)  # the loader keeps up with a slow step
    first = fast.text().splitlines()[0]
    assert first.startswith("verdict: your loader keeps up: nothing to change"), fast.text()
    _, slow, *_ = run_loop(0.020, 0.002, n=20)  # the step waits for a slow loader
    first = slow.text().splitlines()[0]
    assert first.startswith(f"verdict: training waits {slow.input_bound * 100:.0f} % of the time; do: "), slow.text()
    assert slow.advice[0] in first


def _diagnosis(now: float, best: float, step_ms: float | None):
    from packio.doctor.candidates import Candidate
    from packio.doctor.offline import Diagnosis

    cands = [Candidate("uint8 64x64 arrays", "u8-64", samples_per_s=best, full_bytes=5e8, keeps_crops=False,
                       convert_line="packio convert imgs d-u8.arrays --size 64x64",
                       reader_lines=["ds = packio.open_dataset('d-u8.arrays')"]),
             Candidate("JPEG short side 256 (lmdb)", "jpeg256", samples_per_s=best * 0.6, full_bytes=2e8,
                       convert_line="packio convert imgs d-256.lmdb --short-side 256",
                       reader_lines=["ds = packio.open_dataset('d-256.lmdb', resize=64)"]),
             Candidate("image folder, a file per sample", "now", samples_per_s=now, now=True)]
    return Diagnosis(source="imgs", count=1000, sample=256, size=64, batch_size=32, step_ms=step_ms, budget=None,
                     cpus=2, workers_tried=[0], stages=None, candidates=cands, gpu=None, seconds=10, elapsed=5)


def test_offline_verdict_keeps_up_or_says_how_long_it_waits_and_what_to_do():
    keeps = report.verdict(_diagnosis(now=800, best=9000, step_ms=120))  # 32 per 120 ms: 267/s needed
    assert keeps[0].startswith("verdict: your loader keeps up: nothing to change"), keeps
    waits = report.verdict(_diagnosis(now=100, best=9000, step_ms=20))  # 1,600/s needed
    assert waits[0].startswith("verdict: training waits ~94 % of the time"), waits
    # the smallest layout that keeps the step fed with random crops kept: short side 256, not the arrays
    assert waits[0].endswith("do: packio convert imgs d-256.lmdb --short-side 256") and "enough" in waits[-1]
    assert waits[2].strip() == "ds = packio.open_dataset('d-256.lmdb', resize=64)"  # the reader line as printed
    close = report.verdict(_diagnosis(now=250, best=9000, step_ms=120))  # 267/s needed: waits ~6 %
    assert close[0].startswith("verdict: your loader keeps up: nothing to change") and "waits ~6 %" in close[0]
    short = report.verdict(_diagnosis(now=100, best=1000, step_ms=20))  # nothing is fast enough
    assert short[0].endswith("d-u8.arrays --size 64x64") and "still short" in short[-1]
    unknown = report.verdict(_diagnosis(now=800, best=9000, step_ms=None))
    assert "give --step-ms" in unknown[0] and "40 ms or more never waits" in unknown[0]


def test_layout_chart_uses_a_log_axis_when_rates_span_decades():
    assert report.log_axis([137.0, 900.0, 2500.0, 19000.0]) and not report.log_axis([800.0, 1200.0, 2500.0])
    assert not report.log_axis([5000.0]) and not report.log_axis([0.0, 10.0])


def test_reader_lines_read_with_the_threads_measured(gen_folder_once, tmp_path, monkeypatch):
    """The doctor's reader lines read as the settings ``packio.tune`` measured: a pick of
    ``threads=0`` with no workers (the calling thread alone) says so, since the default
    now decodes on torch's CPU threads; with workers, or any other count, as before."""
    from packio.doctor.candidates import reader_lines

    src, csv = gen_folder_once
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    monkeypatch.chdir(tmp_path)
    for settings, want in [({"num_workers": 0, "threads": 0}, 0), ({"num_workers": 0, "threads": 2}, 2),
                           ({"num_workers": 2, "prefetch_factor": 2, "persistent_workers": True, "threads": 0}, None)]:
        ns = {"packio": packio}
        exec("\n".join(reader_lines("d.lmdb", 64, 8, settings)), ns)
        assert ns["ds"].threads == want, (settings, reader_lines("d.lmdb", 64, 8, settings))
        assert {k: getattr(ns["loader"], k) for k in ("num_workers",)} == {"num_workers": settings["num_workers"]}


def test_huge_image_keeps_the_doctor_near_its_budget(tmp_path, monkeypatch):
    """One huge PNG (issue 38: a 156-megapixel one made ``--seconds 5`` run 114 s: every trial
    decoded batches of 64 copies of it). The doctor measures it, decodes it a number of times
    bounded by what the budget holds, and says which figures it estimated instead of timing."""
    import cv2

    h, w = 3000, 4000
    ramp = (np.arange(w, dtype=np.uint32)[None, :] * 255 // w).astype(np.uint8)
    img = np.dstack([np.broadcast_to(ramp, (h, w))] * 3)
    (tmp_path / "huge").mkdir()
    ok, png = cv2.imencode(".png", img, [cv2.IMWRITE_PNG_COMPRESSION, 1])
    (tmp_path / "huge" / "big.png").write_bytes(png.tobytes())
    from packio import decode as dec

    one = min(_timed(lambda: dec.decode(png.tobytes())) for _ in range(2))  # one decode, here and now
    counter, real = tmp_path / "decodes", cv2.imdecode

    def counting(buf, flags):  # forked DataLoader workers inherit it: the counter is a file
        out = real(buf, flags)
        if out is not None and out.shape[0] * out.shape[1] >= h * w:
            with open(counter, "ab") as f:
                f.write(b".")
        return out

    monkeypatch.setattr(cv2, "imdecode", counting)
    seconds = 3.0
    d = diagnose(tmp_path / "huge", seconds=seconds, work=tmp_path)
    decodes = counter.stat().st_size if counter.exists() else 0
    assert 1 <= decodes <= 2 * seconds / one + 8, (decodes, one)  # the code before: 260 or more
    text = report.text(d)
    assert d.stages.n == 1 and d.now is not None and not d.now.error
    for c in d.candidates:  # each is timed, estimated (and said so), or said not measured
        assert c.error.startswith("not measured") or c.estimated or c.samples_per_s > 0, c
    assert all("estimated from its stage costs" in text for c in d.candidates if c.estimated)
    print(f"{decodes} decodes of the huge image, one decode {one:.2f} s; took {d.elapsed:.0f} s of {seconds:g}")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def test_figures_say_measured_or_estimated_and_nothing_to_change_stays_so():
    """A figure is measured unless said otherwise: on a busy machine the verdict gives the
    measured rate, with the estimate from CPU time beside it and called one (it printed the
    estimate alone: 'the data feeds 3480 samples/s' where 1,020 was measured). When the loader
    keeps up, the recommendation says nothing needs to change before naming a faster layout
    (it read 'nothing to change' then 'recommendation: uint8 224x224 arrays')."""
    d = _diagnosis(now=470, best=9000, step_ms=None)
    d.busy, d.now.cpu_per_sample = "load 3.2 from other processes on 2 CPUs", 2 / 951
    line = report.verdict(d)[0]
    assert "feeds 470 samples/s measured on the busy machine, ≤951 estimated from its CPU time" in line, line
    assert "32 taking 68 ms or more" in line  # from the measured rate
    keeps = _diagnosis(now=250, best=9000, step_ms=120)  # 267/s needed: waits ~6 %
    rec = report.recommendation(keeps)
    assert rec[0].startswith("recommendation: nothing to change (your loader keeps up); were your step to get "
                             "faster, the fastest layout here: uint8 64x64 arrays: 9000 samples/s measured"), rec
    assert report.verdict(keeps)[0].startswith("verdict: your loader keeps up: nothing to change")
    busy = _diagnosis(now=230, best=9000, step_ms=120)  # measured: waits ~14 %; its CPU time says 600/s
    busy.busy, busy.now.cpu_per_sample = "load 3.2 from other processes on 2 CPUs", 2 / 600
    line = report.verdict(busy)[0]
    assert line.startswith("verdict: on this busy machine training would wait ~14 % of the time") and \
        "measure again on a quiet machine" in line, line
    assert not report.recommendation(busy)[0].startswith("recommendation: nothing to change")


def test_convert_lines_carry_the_csv_column_map(tmp_path, monkeypatch):
    """bccd's CSV names its class column ``cell_type``: the doctor's convert lines carry
    ``--csv-columns`` as given (they gave ``--csv`` alone, and the line packed every box as
    class -1)."""
    from conftest import jpeg

    from packio.doctor import candidates as cand
    from packio.doctor.source import open_source

    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(3):
        (flat / f"b{i}.jpg").write_bytes(jpeg(40, 50, seed=i))
    (tmp_path / "t.csv").write_text("filename,cell_type,xmin,xmax,ymin,ymax\n" + "".join(
        f"b{i}.jpg,{'RBC' if i else 'WBC'},2,20,3,30\n" for i in range(3)))
    src = open_source(flat, tmp_path / "t.csv", "class=cell_type")
    lay = cand.layouts(64)[0]
    line = cand.convert_line(src.path, "out.lmdb", lay, src.csv, src.csv_columns)
    assert line.endswith(f"--csv {tmp_path / 't.csv'} --csv-columns class=cell_type"), line
    monkeypatch.chdir(tmp_path)
    assert cli.main(shlex.split(line)[1:] + ["--quiet"]) == 0
    assert packio.open_dataset(tmp_path / "out.lmdb").box_classes == ["RBC", "WBC"]
