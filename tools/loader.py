"""Read paths against the machine's limits (``python tools/loader.py COMMAND --help``).

    w1      W1 (decode + resize 224, batches of 64) vs L1, each run a fresh process; --compare A/B
    w1cpu   W1 CPU µs per sample of packio nw=0 (1 and 2 decode threads) vs L1's decode + resize of the
            same bytes in one process (the peers harness's dec_simplejpeg), consumed as the harness does
    w2      W2 (pre-resized uint8 arrays) vs the memcpy limit L2, in one process
    w2cpu   W2 CPU µs per sample (process and main-thread CPU time) of packio nw=0 (1 and 2 threads)
            vs the peers harness's L2 (batch memcpy into one reused buffer), consumed as the harness does
    levers  micro-benchmarks behind the read-path choices (resize, stacking, gather, worker IPC)
    memory  peak memory (PSS, process tree) of packio's HDF5 reader vs a plain h5py reader
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import interleaved, median, need, parser, per_call, rate, subcommands, table  # noqa: E402

BATCH, SIZE = 64, 224


# ---------------------------------------------------------------- w1

def _w1_dataset(a: Any) -> str:
    """The LMDB dataset W1 reads: --path, else --src packed, else --count generated photos."""
    if a.path:
        need([a.path] if Path(a.path).exists() else [], f"dataset at {a.path}", "pass a packed LMDB to --path")
        return a.path
    import packio

    src, csv = a.src, a.csv
    if src is None:
        from packio.bench.synth import make_photo_folder

        root, csv_path = make_photo_folder(Path(tempfile.mkdtemp(prefix="bench-w1-")) / "synth", a.count)
        src, csv = str(root), str(csv_path)
    need([src] if Path(src).is_dir() else [], f"image folder at {src}", "pass an image folder to --src")
    path = str(Path(src).resolve().parent / "packio-w1.lmdb")
    packio.convert(src, path, csv=csv, progress=False, overwrite=True)
    return path


def w1(argv: list[str]) -> int:
    """W1 on original bytes against the decode limit L1 (1 and 2 processes), every run a
    fresh process (``packio.bench.runner.run_child``); ``--compare DIR`` also times the
    packio under DIR in the same rounds (A/B). × L1 uses the same cores: nw=0 and no
    decode threads is 1 process, else 2.

        python tools/loader.py w1 --path packed.lmdb --settings 0/0,0/2,2/0
        python tools/loader.py w1 --path packed.lmdb --compare /tmp/old   # A/B
    """
    ap = parser(w1.__doc__)
    ap.add_argument("--path", help="a packed LMDB dataset (else packed from --src)")
    ap.add_argument("--src", help="image folder to pack first")
    ap.add_argument("--csv", help="CSV of boxes for --src")
    ap.add_argument("--settings", default="0/0,0/2,2/0", help="workers/threads pairs, comma-separated")
    ap.add_argument("--compare", help="a folder holding another packio/ to time in the same rounds (A/B)")
    ap.add_argument("--count", type=int, default=1000, help="images generated when neither --path nor --src")
    a = ap.parse_args(argv)
    from packio.bench.runner import run_child

    path = _w1_dataset(a)
    here = os.environ.get("PYTHONPATH", "")
    variants = {"": here}
    if a.compare:
        variants["B "] = os.pathsep.join(p for p in (str(Path(a.compare).resolve()), here) if p)
    cpu: dict[str, list[float]] = {}

    def case(key: str, cfg: dict[str, Any], pythonpath: str = here) -> Callable[[], float]:
        def run() -> float:
            os.environ["PYTHONPATH"] = pythonpath
            res = run_child(cfg)
            os.environ["PYTHONPATH"] = here
            cpu.setdefault(key, []).append(res.get("cpu_us", float("nan")))
            return res.get("rate", float("nan"))
        return run

    cases = {f"L1 x{p}": case(f"L1 x{p}", {"kind": "L1", "procs": p, "path": path, "workload": "limit",
                                            "workers": 0}) for p in (1, 2)}
    for w, t in (tuple(int(v) for v in s.split("/")) for s in a.settings.split(",")):
        for tag, pp in variants.items():  # A and B back to back: they see the same machine
            cases[f"{tag}nw={w} threads={t}"] = case(f"{tag}nw={w} threads={t}", {
                "kind": "packio", "path": path, "workload": "W1", "workers": w, "threads": t, "cold": False}, pp)
    got = interleaved(cases, a.rounds)
    _w1_report({k: median(v) for k, v in got.items()}, {k: median(v) for k, v in cpu.items()})
    return 0


def _w1_report(med: dict[str, float], cpu: dict[str, float]) -> None:
    best = max(v for k, v in med.items() if not k.startswith("L1"))
    rows = []
    for k, v in med.items():
        if k.startswith("L1"):
            rows.append((k, f"{v:.0f}", "", "", "", f"{cpu[k]:.0f}", ""))
            continue
        w, t = (int(x.split("=")[1]) for x in k.split()[-2:])
        same = "L1 x1" if (w == 0 and t <= 1) else "L1 x2"
        rows.append((k, f"{v:.0f}", f"{v / med[same]:.3f}", f"{v / med['L1 x2']:.3f}", f"{v / best:.3f}",
                     f"{cpu[k]:.0f}", f"{cpu[same] / cpu[k]:.3f}"))
    table(("run", "samples/s", "× L1 (same cores)", "× L1 x2", "× best", "CPU µs/sample", "L1 CPU / this"), rows,
          "W1, medians of interleaved rounds")


def _l1_decode(buf: bytes) -> Any:
    """The peers harness's L1 decoder (``dec_simplejpeg``): power-of-two DCT scale while both
    sides stay >= 224, then one INTER_LINEAR resize into a fresh array."""
    import cv2
    import simplejpeg

    h, w, _, _ = simplejpeg.decode_jpeg_header(buf)
    for k in (8, 4, 2):
        if w >= SIZE * k and h >= SIZE * k:
            img = simplejpeg.decode_jpeg(buf, "RGB", min_height=(h + k - 1) // k, min_width=(w + k - 1) // k)
            return cv2.resize(img, (SIZE, SIZE), interpolation=cv2.INTER_LINEAR)
    return cv2.resize(simplejpeg.decode_jpeg(buf, "RGB"), (SIZE, SIZE), interpolation=cv2.INTER_LINEAR)


def _w1cpu_cases(path: str, count: int) -> dict[str, Callable[[], int]]:
    """One pass each over the dataset's first ``count`` samples (returns its samples): L1 on
    their stored bytes (in memory), and packio.DataLoader (nw=0, 1 and 2 decode threads)
    consumed as the harness's PackioLoader (image, label, padded boxes, key)."""
    import cv2

    import packio

    cv2.setNumThreads(1)  # as the harness's L1 worker and its loaders' worker_init
    plain = packio.open_dataset(path)
    count = min(count, len(plain))
    need(range(count), f"samples in {path}", "pass a non-empty packed LMDB to --path")
    bufs = [bytes(plain.sample(i).payload) for i in range(count)]

    def l1() -> int:
        for b in bufs:
            _l1_decode(b)
        return count

    def loader(threads: int) -> Callable[[], int]:
        ds = packio.open_dataset(path, resize=SIZE, threads=threads)
        dl = packio.DataLoader(ds, batch_size=BATCH, sampler=range(count), num_workers=0)

        def run() -> int:
            n = 0
            for b in dl:
                n += len((b["image"], b["label"], _harness_pad(b["boxes"]), b["key"])[1])
            return n
        return run
    return {"L1 (same bytes, 1 process)": l1, "packio nw=0": loader(1), "packio nw=0 threads=2": loader(2)}


def w1cpu(argv: list[str]) -> int:
    """W1 in CPU time, so a loaded machine still gives usable ratios: packio.DataLoader over a
    packed LMDB (nw=0; 1 and 2 decode threads, resize 224, batches of 64, consumed as the peers
    harness does) against L1, the harness's decode + resize of the same stored bytes from memory.
    CPU is process_time (every thread); main thread is thread_time (with threads=2 the part
    the second thread cannot share); "busy cores" = CPU ÷ wall, which shows threads=2's
    scaling on a quiet machine only (2.0 = both cores decode all the time).

        python tools/loader.py w1cpu --path /tmp/peers-packed/packio-lmdb/data.lmdb
    """
    ap = parser(w1cpu.__doc__, rounds=5)
    ap.add_argument("--path", help="a packed LMDB of JPEGs (default: 640 generated photos, packed)")
    ap.add_argument("--count", type=int, default=640, help="samples per pass (the first ones)")
    ap.add_argument("--seconds", type=float, default=2.0, help="CPU seconds per case per round")
    a = ap.parse_args(argv)
    a.src = a.csv = None
    path = _w1_dataset(a)
    cases = _w1cpu_cases(path, a.count)
    med = _cpu_medians(cases, a.seconds, a.rounds)
    l1 = med["L1 (same bytes, 1 process)"][0]
    table(("run", "CPU µs/sample", "main thread µs/sample", "wall µs/sample", "L1 CPU ÷ CPU", "CPU − L1 µs/sample",
           "busy cores (quiet machine only)"),
          [(k, f"{p:.1f}", f"{t:.1f}", f"{w:.1f}", f"{l1 / p:.3f}", f"{p - l1:.1f}", f"{p / w:.2f}")
           for k, (p, t, w) in med.items()],
          f"W1 CPU per sample, {path}, {a.count} samples, batch {BATCH}, resize {SIZE}, "
          f"medians of {a.rounds} interleaved rounds")
    return 0


# ---------------------------------------------------------------- w2

def _pad(boxes: list[Any]) -> Any:
    import torch

    out = torch.full((len(boxes), 8, 4), -1.0)
    for j, b in enumerate(boxes):
        k = min(len(b), 8)
        if k:
            out[j, :k] = b[:k]
    return out


def _epoch(loader: Any, pad: bool) -> Callable[[], int]:
    def run() -> int:
        n = 0
        for b in loader:
            if pad:  # the consumer touches boxes as the peers harness does
                _pad(b["boxes"])
            n += len(b["label"])
        return n
    return run


def _w2_copies(arr: Any) -> dict[str, Callable[[], int]]:
    """L2 (per-sample copy out of the memmap) and whole-batch copies: memcpy vs np.take."""
    import numpy as np

    one, flat = np.empty(arr.shape[1:], np.uint8), np.asarray(arr)
    block = np.empty((BATCH, *arr.shape[1:]), np.uint8)
    starts = range(0, len(arr) - BATCH + 1, BATCH)
    runs_of = [np.arange(s, s + BATCH) for s in starts]

    def l2() -> int:
        for i in range(len(arr)):
            np.copyto(one, arr[i])
        return len(arr)

    def memcpy_runs() -> int:
        for s in starts:
            np.copyto(block, flat[s:s + BATCH])
        return len(starts) * BATCH

    def take_runs() -> int:  # the same batches with np.take (what packio does)
        for idx in runs_of:
            np.take(flat, idx, axis=0, out=block, mode="clip")
        return len(starts) * BATCH

    def take_in_turn() -> int:
        """As a loop that keeps the batch it was handed while the next is made must be fed:
        never into the buffer it holds (the peers harness's L2 batch64 reuses one buffer,
        which may stay in the last-level cache)."""
        two = [block, np.empty_like(block)]
        for k, idx in enumerate(runs_of):
            np.take(flat, idx, axis=0, out=two[k % 2], mode="clip")
        return len(starts) * BATCH

    def take_fresh() -> int:  # a fresh block per batch, the last one held (packio's read_batch)
        held = None
        for idx in runs_of:
            out = np.empty_like(block)
            np.take(flat, idx, axis=0, out=out, mode="clip")
            held = out  # noqa: F841
        return len(starts) * BATCH
    return {"L2": l2, "copy batch: memcpy": memcpy_runs, "copy batch: np.take": take_runs,
            "copy batch: np.take, 2 blocks in turn": take_in_turn, "copy batch: np.take, fresh block": take_fresh}


def _arrays_dataset(path: str | None, prefix: str) -> tuple[tempfile.TemporaryDirectory, str]:
    """``path`` checked to be a packed ``.arrays`` dataset, or (None) a generated 2,000-sample
    SIZE x SIZE one in a temporary folder (kept alive by the returned handle)."""
    import packio

    tmp = tempfile.TemporaryDirectory(prefix=prefix)
    if path is None:
        from packio.bench.synth import make_photo_folder

        src, csv = make_photo_folder(Path(tmp.name) / "src", 2000, size=(240, 320))
        path = str(Path(tmp.name) / "d.arrays")
        packio.convert(src, path, csv=csv, resize=packio.ResizeSpec(size=(SIZE, SIZE)), progress=False)
    need([path] if (Path(path) / "images.npy").is_file() else [], f"arrays dataset at {path}",
         "pass a packed .arrays folder to --path")
    return tmp, path


def w2(argv: list[str]) -> int:
    """W2 (pre-resized uint8 arrays) against the memcpy limit L2 (per-sample ``np.copyto``
    out of the page-cached memmap), in one process: packio.DataLoader with 0 and 2 workers,
    shuffled or not, and torch's DataLoader over per-sample items with ``packio.collate``.
    Without --path a generated 2,000-sample 224x224 dataset is packed first."""
    ap = parser(w2.__doc__)
    ap.add_argument("--path", help="a packed .arrays dataset (default: a generated one)")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per case per round")
    ap.add_argument("--no-pad", action="store_true", help="consumers skip the harness-style box padding")
    a = ap.parse_args(argv)
    import numpy as np
    import torch

    import packio

    tmp, a.path = _arrays_dataset(a.path, "packio-w2-")
    npy = Path(a.path) / "images.npy"
    arr = np.load(npy, mmap_mode="r")
    runs = _w2_copies(arr)
    ds = packio.open_dataset(a.path)
    for shuffle in (False, True):
        for nw in (0, 2):
            runs[f"packio nw={nw} shuffle={shuffle}"] = _epoch(
                packio.DataLoader(ds, batch_size=BATCH, shuffle=shuffle, num_workers=nw), not a.no_pad)
        items = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=shuffle, collate_fn=packio.collate)
        runs[f"items nw=0 shuffle={shuffle}"] = _epoch(items, not a.no_pad)
    for run in runs.values():  # warm-up: page cache, this process' page tables
        run()
    got = interleaved({k: (lambda f=f: rate(f, a.seconds)) for k, f in runs.items()}, a.rounds)
    l2 = median(got["L2"])
    table(("run", "samples/s", "× L2"), [(k, f"{median(v):.0f}", f"{median(v) / l2:.2f}") for k, v in got.items()],
          f"W2: {len(arr)} samples of {arr.shape[1:]} uint8, medians of {a.rounds} interleaved rounds")
    tmp.cleanup()
    return 0


# ---------------------------------------------------------------- w2cpu

def _harness_pad(boxes: list[Any]) -> Any:
    """The peers harness's box padding (its ``_pad_list``): torch's pad_sequence to [B, 8, 4]."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    out = pad_sequence([b[:8] for b in boxes], batch_first=True, padding_value=-1.0)
    if out.shape[1] < 8:
        out = torch.nn.functional.pad(out, (0, 0, 0, 8 - out.shape[1]), value=-1.0)
    return out


def _w2cpu_cases(path: str, pad: bool) -> dict[str, Callable[[], int]]:
    """One epoch each (returns its samples): L2 as the harness measures it, packio's gather
    alone, and packio.DataLoader (nw=0, 1 and 2 threads) consumed as the harness does."""
    import numpy as np

    import packio

    flat = np.asarray(np.load(Path(path) / "images.npy", mmap_mode="r"))
    need(range(len(flat)), f"samples in {path}", "pass a non-empty .arrays dataset")
    size = min(BATCH, len(flat))  # a tiny dataset: one smaller batch
    starts = range(0, len(flat) - size + 1, size)
    reused = np.empty((size, *flat.shape[1:]), np.uint8)

    def l2() -> int:  # the harness's L2 batch64: copies of 64 consecutive samples into one buffer
        for s in starts:
            np.copyto(reused, flat[s:s + size])
        return len(starts) * size

    def gather() -> int:  # what packio's read_batch copies: a fresh buffer per batch, the last one held
        held = None
        for s in starts:
            held = np.empty_like(reused)
            np.take(flat, np.arange(s, s + size), axis=0, out=held, mode="clip")
        return len(starts) * size

    def loader(threads: int) -> Callable[[], int]:
        dl = packio.DataLoader(packio.open_dataset(path, threads=threads), batch_size=BATCH, num_workers=0)

        def run() -> int:
            n = 0
            for b in dl:  # as the harness's PackioLoader: image, label, padded boxes, key
                n += len((b["image"], b["label"], _harness_pad(b["boxes"]) if pad else b["boxes"], b["key"])[1])
            return n
        return run
    return {"L2 (memcpy, reused buffer)": l2, "gather (np.take, fresh buffer)": gather,
            "packio nw=0": loader(1), "packio nw=0 threads=2": loader(2)}


def _cpu_medians(cases: dict[str, Callable[[], Any]], seconds: float, rounds: int) -> dict[str, list[float]]:
    """Per case, the medians over interleaved rounds of (CPU, main-thread CPU, wall) µs per
    sample (see ``_cpu_per_sample``), after one warm-up run of each (page cache, page tables,
    threads, pools)."""
    for run in cases.values():
        run()
    figures: dict[str, list[tuple[float, float, float]]] = {k: [] for k in cases}

    def timed(name: str) -> Callable[[], float]:
        def one() -> float:
            figures[name].append(_cpu_per_sample(cases[name], seconds))
            return figures[name][-1][0]
        return one
    interleaved({k: timed(k) for k in cases}, rounds)
    return {k: [median(f[j] for f in v) for j in range(3)] for k, v in figures.items()}


def _cpu_per_sample(epoch: Callable[[], int], seconds: float) -> tuple[float, float, float]:
    """(process CPU, main-thread CPU, wall) µs per sample of repeated epochs, for ``seconds`` of CPU."""
    n, p0, t0, w0 = 0, time.process_time(), time.thread_time(), time.perf_counter()
    while time.process_time() - p0 < seconds:
        n += epoch()
    return tuple((x1 - x0) * 1e6 / n for x0, x1 in ((p0, time.process_time()), (t0, time.thread_time()),
                                                      (w0, time.perf_counter())))  # type: ignore[return-value]


def w2cpu(argv: list[str]) -> int:
    """W2 in CPU time (process_time: every thread; thread_time: the main thread, the critical
    path of ``threads=2``), so a loaded machine still gives usable ratios: packio's
    DataLoader over a packed ``.arrays`` (nw=0; threads 1 and 2), consumed as the peers
    harness does (box padding with pad_sequence), against the harness's L2 (64 consecutive
    samples memcpy'd into one reused buffer) and packio's gather alone. Without --path a
    generated 2,000-sample 224x224 dataset is packed first.

        python tools/loader.py w2cpu --path /tmp/peers-packed/packio-arrays/data.arrays
    """
    ap = parser(w2cpu.__doc__, rounds=5)
    ap.add_argument("--path", help="a packed .arrays dataset (default: a generated one)")
    ap.add_argument("--seconds", type=float, default=1.0, help="CPU seconds per case per round")
    ap.add_argument("--no-pad", action="store_true", help="consume without the harness's box padding")
    a = ap.parse_args(argv)
    tmp, a.path = _arrays_dataset(a.path, "packio-w2cpu-")
    cases = _w2cpu_cases(a.path, not a.no_pad)
    med = _cpu_medians(cases, a.seconds, a.rounds)
    l2 = med["L2 (memcpy, reused buffer)"]
    table(("run", "CPU µs/sample", "main thread µs/sample", "wall µs/sample", "L2 ÷ CPU", "L2 ÷ main thread",
           "L2 ÷ wall (quiet machine only)"),
          [(k, f"{p:.2f}", f"{t:.2f}", f"{w:.2f}", f"{l2[0] / p:.3f}", f"{l2[1] / t:.3f}", f"{l2[2] / w:.3f}")
           for k, (p, t, w) in med.items()],
          f"W2 CPU per sample, {a.path}, batch {BATCH}, medians of {a.rounds} interleaved rounds"
          f"{'' if a.no_pad else ', consumed with the harness box padding'}")
    tmp.cleanup()
    return 0


# ---------------------------------------------------------------- levers

def _lever_resize_and_stack() -> list[tuple[str, str, str, str]]:
    import cv2
    import numpy as np
    import torch

    from packio import decode as dec

    img = np.random.default_rng(0).integers(0, 255, (480, 540, 3), dtype=np.uint8)
    t_area = per_call(lambda: cv2.resize(img, (224, 224), interpolation=cv2.INTER_AREA), 300)
    t_fast = per_call(lambda: dec.resize(img, (224, 224)), 300)
    hwc = [torch.from_numpy(np.ascontiguousarray(img[:224, :224])) for _ in range(64)]
    chw = [x.permute(2, 0, 1) for x in hwc]
    t_views = per_call(lambda: torch.stack(chw), 30)
    t_hwc = per_call(lambda: torch.stack(hwc).permute(0, 3, 1, 2), 30)
    return [("resize 540x480 → 224² (ms)", f"OpenCV INTER_AREA {t_area * 1e3:.2f}",
             f"packio 2x2 halving + bilinear {t_fast * 1e3:.2f}", f"{t_area / t_fast:.1f}"),
            ("batch of 64 (µs/sample)", f"stack CHW views {t_views / 64 * 1e6:.0f}",
             f"stack HWC (channels_last) {t_hwc / 64 * 1e6:.0f}", f"{t_views / t_hwc:.1f}")]


class _Batches:
    """A map-style dataset whose ``__getitems__`` gathers a whole batch from a memmap."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __len__(self) -> int:
        return 10_000

    def __getitems__(self, idx: list[int]) -> Any:
        import numpy as np
        import torch

        a = np.load(self.path, mmap_mode="r")
        return torch.from_numpy(np.asarray(a)[np.asarray(idx) % len(a)])


def _lever_gather(path: str) -> list[tuple[str, str, str, str]]:
    import numpy as np
    import torch

    mm = np.load(path, mmap_mode="r")
    view = np.asarray(mm)
    np.array(view)  # page cache warm
    rng = np.random.default_rng(1)
    out = np.empty((64, *mm.shape[1:]), np.uint8)
    t_take = per_call(lambda: np.take(mm, rng.integers(0, len(mm), 64), axis=0, out=out), 50)
    t_view = per_call(lambda: view[rng.integers(0, len(mm), 64)], 50)
    loader = torch.utils.data.DataLoader(_Batches(path), batch_size=64, num_workers=2, collate_fn=lambda b: b,
                                         persistent_workers=True, sampler=range(64 * 60))
    sum(len(b) for b in loader)  # workers started
    ipc = 1 / per_call(lambda: sum(len(b) for b in loader), 1, warmup=0) * 64 * 60
    return [("gather 64 from a memmap (samples/s)", f"np.take(out=) {64 / t_take:.0f}",
             f"ndarray view fancy index {64 / t_view:.0f}", f"{t_take / t_view:.1f}"),
            ("64-sample batches (samples/s)", f"from 2 workers via shared memory {ipc:.0f}",
             f"gathered in the main process {64 / t_view:.0f}", f"{(64 / t_view) / ipc:.1f}")]


def levers(argv: list[str]) -> int:
    """Micro-benchmarks behind packio's read-path choices: resize (INTER_AREA vs packio),
    batching (CHW views vs HWC), gathering from a memmap (np.take vs fancy index) and
    batches from DataLoader workers vs gathered in the main process."""
    ap = parser(levers.__doc__, rounds=1)
    ap.add_argument("--npy", help="an images.npy of a packed arrays dataset (default: a generated 2,000-sample one)")
    a = ap.parse_args(argv)
    import cv2
    import numpy as np
    import torch

    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    path = a.npy
    if path is None:
        path = str(Path(tempfile.mkdtemp()) / "images.npy")
        arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(2000, 224, 224, 3))
        arr[:] = 7
        arr.flush()
        del arr
    need([path] if Path(path).is_file() else [], f"file at {path}", "pass an arrays dataset's images.npy to --npy")
    rows = _lever_resize_and_stack() + _lever_gather(path)
    table(("lever", "one way", "packio's way (or the other)", "ratio"), rows, "read-path levers")
    return 0


# ---------------------------------------------------------------- memory

def _memory_child(kind: str, path: str, workers: int) -> int:
    import torch

    if kind == "packio":
        import packio

        loader = packio.DataLoader(packio.open_dataset(path, resize=SIZE), batch_size=BATCH, num_workers=workers)
    else:
        loader = torch.utils.data.DataLoader(_PlainH5(path), batch_size=BATCH, num_workers=workers)
    n = 0
    for b in loader:  # consumed as the peers harness does: boxes padded to one [B, 8, 4] tensor
        if isinstance(b, dict):
            _pad(b["boxes"])
            b = b["image"]
        n += len(b)
    print(n)
    return 0


class _PlainH5:
    """A plain h5py Dataset over the layout packio writes (images_bytes + offsets)."""

    def __init__(self, path: str) -> None:
        import h5py

        self.path, self.f = path, None
        with h5py.File(path, "r") as f:
            self.off = f["offsets"][:]

    def __len__(self) -> int:
        return len(self.off) - 1

    def __getitem__(self, i: int) -> Any:
        import h5py
        import torch

        from packio import decode as dec

        if self.f is None:
            self.f = h5py.File(self.path, "r")
        data = self.f["images_bytes"][self.off[i]:self.off[i + 1]].tobytes()
        return torch.from_numpy(dec.resize(dec.decode(data, min_size=(SIZE, SIZE)), (SIZE, SIZE))).permute(2, 0, 1)


def _peak(kind: str, path: str, workers: int) -> tuple[float, str]:
    from packio.bench.probe import Probe, wait_and_probe

    proc = subprocess.Popen([sys.executable, __file__, "memory", "--child", kind, "--path", path,
                             "--workers", str(workers)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    probe = Probe(proc.pid, str(Path(path).parent), sample_fds=False)
    _, err = wait_and_probe(proc, probe, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{kind} failed: {err[-2000:]}")
    return probe.peak_mb, probe.memory_kind


def memory(argv: list[str]) -> int:
    """Peak memory (PSS summed over the process tree) of one epoch through packio's HDF5
    reader (``open_dataset(path, resize=224)``) vs a plain h5py reader of the same file,
    each in a fresh process; prints packio / plain (target <= 1.2)."""
    ap = parser(memory.__doc__, rounds=1)
    ap.add_argument("--path", help="a packio HDF5 file of encoded images (default: a generated one)")
    ap.add_argument("--n", type=int, default=3000, help="images to generate without --path")
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return _memory_child(a.child, a.path, int(a.workers))
    tmp = tempfile.TemporaryDirectory(prefix="packio-mem-")
    if a.path is None:
        import packio
        from packio.bench.synth import make_photo_folder

        src, csv = make_photo_folder(Path(tmp.name) / "src", a.n, size=(375, 500))
        a.path = str(Path(tmp.name) / "d.h5")
        packio.convert(src, a.path, csv=csv, progress=False)
    need([a.path] if Path(a.path).is_file() else [], f"HDF5 file at {a.path}", "pass a packed .h5 to --path")
    rows = []
    for w in (int(x) for x in a.workers.split(",")):
        packio_mb, kind = _peak("packio", a.path, w)
        plain_mb, _ = _peak("plain", a.path, w)
        rows.append((w, f"{packio_mb:.0f}", f"{plain_mb:.0f}", f"{packio_mb / plain_mb:.2f}"))
    table(("workers", f"packio peak MiB ({kind})", "plain h5py peak MiB", "packio / plain (target <= 1.2)"), rows,
          f"{a.path}: {Path(a.path).stat().st_size / 2**20:.0f} MiB, one epoch, batch {BATCH}, resize {SIZE}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(subcommands({"w1": w1, "w1cpu": w1cpu, "w2": w2, "w2cpu": w2cpu, "levers": levers, "memory": memory}, __doc__))
