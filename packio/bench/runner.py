"""Benchmark: pack one dataset into every registered format and compare readers,
limits and a naive per-file baseline. ``packio bench --help``.

Every read measurement runs in a fresh subprocess (isolated RSS, page cache state
and worker pools); figures are medians of interleaved repeats. Warm: the files are
read once into the page cache, the loader (persistent workers) runs an untimed
warm-up, then whole epochs are timed, for a second at least. Cold: the files are evicted
(POSIX_FADV_DONTNEED, checked with mincore), then a fresh epoch is timed after its
first batch (start-up is reported apart, as ``first batch s``). Opens and peak
memory are measured from outside the child (:mod:`packio.bench.probe`): opens from
strace (or /proc fd sampling), memory as the peak PSS summed over the child and its
DataLoader workers while they live (mapped file pages count: LMDB, memory maps).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from packio.bench.probe import MARKER, Probe, count_opens, strace_prefix, wait_and_probe
from packio.manifest import dataset_files, disk_bytes
from packio.measure import OtherLoad

__all__ = ["BATCH", "SIZE", "variants", "child", "run_child", "main", "render", "plot", "limit_lines", "legend",
           "warm_cache", "evict", "resident_fraction", "limit_l1", "limit_l2", "bare_lmdb_write", "NaiveDataset",
           "ratios", "measure", "summarise", "Progress", "limit_key", "plan", "Setup", "run_all"]

BATCH = 64
SIZE = 224
WORKLOADS = {"W1": f"decode + resize to {SIZE}x{SIZE} of every sample, shuffled batches of {BATCH}",
             "W2": f"pre-resized uint8 {SIZE}x{SIZE} arrays, shuffled batches of {BATCH}, no decode"}

QUICK_FORMATS = ("lmdb", "tar", "arrays")  # --quick: a smoke run over a couple of formats


def variants(names: Sequence[str] | None = None) -> dict[str, tuple[str, dict[str, Any]]]:
    """name → (format, convert kwargs), from the format registry: every format as it
    packs by default (fixed-shape formats pre-resized to SIZE², BMP pre-resized to a
    short side of 256, since it stores decoded pixels), plus two levers: LMDB
    pre-resized (short side 256) and HDF5 holding pre-resized pixels."""
    from packio.formats import formats

    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, spec in formats().items():
        if names is not None and name not in names:
            continue
        if spec.needs_fixed_shape:
            out[f"{name}-{SIZE}"] = (name, {"resize": {"size": [SIZE, SIZE]}})
        elif spec.encoding is not None:  # a fixed lossless encoding: BMP files of decoded pixels
            out[f"{name}-256"] = (name, {"resize": {"short_side": 256}})
        else:
            out[name] = (name, {})
    if names is None:
        out["lmdb-pre256"] = ("lmdb", {"resize": {"short_side": 256}})
        out[f"hdf5-{SIZE}"] = ("hdf5", {"resize": {"size": [SIZE, SIZE]}})
    return out


# ---------------------------------------------------------------- page cache

def evict(root: Path) -> None:
    """Drop the dataset's pages from the page cache (POSIX_FADV_DONTNEED)."""
    for p in dataset_files(root):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(root: Path) -> float:
    """Share of the dataset's pages in the page cache (mincore), to check eviction."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    total = resident = 0
    for p in dataset_files(root):
        size = p.stat().st_size
        if not size:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                continue
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) == 0:
                resident += sum(b & 1 for b in vec)
                total += pages
            libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


# ---------------------------------------------------------------- limits

_BLOBS: list[bytes] = []


def _decode_resize(span: tuple[int, int, int]) -> int:
    import cv2

    from packio import decode as dec

    cv2.setNumThreads(1)
    start, stop, step = span
    for b in _BLOBS[start:stop:step]:
        dec.resize(dec.decode(b, min_size=(SIZE, SIZE)), (SIZE, SIZE))
    return len(range(start, stop, step))


def limit_l1(blobs: list[bytes], procs: int, cpu: list[float] | None = None) -> float:
    """Fastest available decode + resize of in-memory bytes, in ``procs`` processes
    (each forked process already holds the bytes: nothing crosses a pipe).
    ``cpu``: gets the CPU seconds per sample appended (all processes)."""
    from packio.measure import cpu_seconds

    _BLOBS[:] = blobs
    n = len(blobs)
    if procs == 1:
        _decode_resize((0, 20, 1))
        t, c = time.perf_counter(), cpu_seconds()
        _decode_resize((0, n, 1))
        dt = time.perf_counter() - t
        if cpu is not None:
            cpu.append((cpu_seconds() - c) / n)
        return n / dt
    with mp.get_context("fork").Pool(procs) as pool:
        pool.map(_decode_resize, [(0, 10, 1)] * procs)
        t, c = time.perf_counter(), cpu_seconds()
        pool.map(_decode_resize, [(i, n, procs) for i in range(procs)], chunksize=1)
        dt = time.perf_counter() - t
        if cpu is not None:  # while the pool's processes live: their CPU time counts
            cpu.append((cpu_seconds() - c) / n)
        return n / dt


def limit_l2(images_npy: Path) -> tuple[float, float]:
    """Copying uint8 samples out of a page-cached memory map: per sample, and 64 at a time."""
    a = np.load(images_npy, mmap_mode="r")
    base = np.asarray(a)
    n = len(a)
    order = np.random.default_rng(0).permutation(n)
    for i in order[:256]:
        np.array(base[i])
    t = time.perf_counter()
    for i in order:
        np.array(base[i])
    per = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for s in range(0, n, BATCH):
        base[order[s:s + BATCH]]
    return per, n / (time.perf_counter() - t)


# ---------------------------------------------------------------- child runs

class NaiveDataset:
    """The seeds' tutorial loader: one file per sample, PIL decode and resize, and the
    CSV re-parsed in every ``__getitem__``."""

    def __init__(self, root: str, csv_path: str | None) -> None:
        self.root, self.csv_path = Path(root), csv_path
        self.files = sorted(p for p in self.root.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        self.classes = sorted({p.parent.name for p in self.files})

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import csv

        import torch
        from PIL import Image

        path = self.files[i]
        rel = path.relative_to(self.root).as_posix()
        boxes = []
        if self.csv_path:
            with open(self.csv_path, newline="") as f:
                for row in csv.DictReader(f):
                    if row["filename"] == rel:
                        boxes.append([float(row[k]) for k in ("xmin", "ymin", "xmax", "ymax")])
        img = Image.open(path).convert("RGB").resize((SIZE, SIZE), Image.BILINEAR)
        return {"image": torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1),
                "label": self.classes.index(path.parent.name), "boxes": torch.tensor(boxes).reshape(-1, 4)}


def _wds_loader(path: str, workers: int, persistent: bool = False):
    import webdataset as wds

    from packio import decode as dec

    shards = sorted(str(p) for p in Path(path).glob("*.tar"))

    def to_tensor(sample: dict) -> tuple:
        import torch

        img = dec.resize(dec.decode(sample["jpg"], min_size=(SIZE, SIZE)), (SIZE, SIZE))
        return torch.from_numpy(img).permute(2, 0, 1), int(sample["cls"])

    ds = (wds.WebDataset(shards, shardshuffle=len(shards), nodesplitter=wds.split_by_node, empty_check=False)
          .shuffle(1000).map(to_tensor).batched(BATCH))
    return wds.WebLoader(ds, batch_size=None, num_workers=workers, persistent_workers=persistent and workers > 0)


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One measured pass, in this (fresh) process. Prints nothing; returns figures."""
    import torch

    torch.set_num_threads(1)
    root = str(Path(cfg["path"]).resolve())
    out: dict[str, Any] = {}
    cold = bool(cfg.get("cold"))
    if cold:
        evict(Path(root))
        out["resident_after_evict"] = resident_fraction(Path(root))
    else:
        warm_cache(Path(root))
    _mark_start()  # after the cache set-up: the probe counts the loader's opens only
    import cv2

    cv2.setNumThreads(1)
    if cfg["kind"] in ("L1", "L2"):  # the machine's limits, measured in the same interleaved passes as the loaders
        return _limit_child(cfg, root)
    if cfg["workload"] == "random":
        return {**out, **_random_child(root)}
    loader, n_total = _make_loader(cfg, root, cold)
    return {**out, **_timed_epoch(loader, cold, None if cfg["workload"] == "W2" else 10), "expected": n_total}


def _limit_child(cfg: dict[str, Any], root: str) -> dict[str, Any]:
    if cfg["kind"] == "L2":
        per, batched = limit_l2(Path(root) / "images.npy")
        return {"rate": per, "batched": batched}
    import packio

    ds = packio.open_dataset(root, decode=False)
    blobs = [ds.sample(i).payload for i in range(len(ds))]
    ds.reader.close()
    cpu: list[float] = []
    return {"rate": limit_l1(blobs, cfg["procs"], cpu), "cpu_us": cpu[0] * 1e6}


def _random_child(root: str) -> dict[str, Any]:
    """Latency of 1,000 random ``ds[i]`` reads without decoding."""
    import packio

    ds = packio.open_dataset(root, decode=False)
    idx = np.random.default_rng(1).integers(0, len(ds), 1000)
    lat = []
    for i in idx:
        t = time.perf_counter()
        ds[int(i)]
        lat.append(time.perf_counter() - t)
    return {"p50_us": float(np.percentile(lat, 50) * 1e6), "p99_us": float(np.percentile(lat, 99) * 1e6),
            "samples_read": len(idx)}


def _cv2_one_thread(_: int) -> None:
    import cv2

    cv2.setNumThreads(1)


def _make_loader(cfg: dict[str, Any], root: str, cold: bool) -> tuple[Any, int | None]:
    """The run's loader and how many samples an epoch should yield (None: not known)."""
    import torch

    workers, kind = cfg["workers"], cfg["kind"]
    common: dict[str, Any] = {"num_workers": workers}
    if workers:  # warm: persistent workers (an untimed warm-up epoch starts them); cold: a fresh epoch
        common.update(worker_init_fn=_cv2_one_thread, persistent_workers=not cold)
    if kind == "naive":
        import torch.utils.data as tud

        ds = NaiveDataset(root, cfg.get("csv"))
        if cfg.get("limit"):
            ds = tud.Subset(ds, range(min(cfg["limit"], len(ds))))
        loader = tud.DataLoader(ds, batch_size=BATCH, shuffle=True,
                                collate_fn=lambda b: {"image": torch.stack([x["image"] for x in b]),
                                                      "label": torch.tensor([x["label"] for x in b])}, **common)
        return loader, len(ds)
    if kind == "webdataset":
        return _wds_loader(root, workers, persistent=not cold), None
    import packio

    resize = SIZE if cfg["workload"] == "W1" else None
    threads = int(cfg.get("threads", 0))
    if kind == "packio-iter":
        ds = packio.open_dataset(root, iterable=True, shuffle=True, resize=resize, threads=threads)
        return packio.DataLoader(ds, batch_size=BATCH, **common), len(ds)
    ds = packio.open_dataset(root, resize=resize, threads=threads)
    return packio.DataLoader(ds, batch_size=BATCH, shuffle=True, **common), len(ds)


def _labels(batch: Any) -> Any:
    return batch["label"] if isinstance(batch, dict) else batch[1]


def _timed_epoch(loader: Any, cold: bool, warmup: int | None, min_s: float = 1.0) -> dict[str, Any]:
    """Warm: an untimed warm-up (``warmup`` batches, None: a whole epoch), then whole epochs
    timed until ``min_s`` pass (a small dataset's one epoch is over in milliseconds). Cold:
    one fresh epoch timed after its first batch (start-up reported apart)."""
    from packio.measure import cpu_seconds

    n_warm = 0
    if not cold:
        for k, batch in enumerate(loader):
            n_warm += len(_labels(batch))
            if warmup is not None and k + 1 >= warmup:
                break
    c0 = cpu_seconds()  # before the clock starts: it scans /proc, milliseconds on a busy machine
    t0 = time.perf_counter()
    n = epochs = per_epoch = 0
    t_first = n_first = None
    while True:
        for batch in loader:
            n += len(_labels(batch))
            if t_first is None:
                t_first, n_first = time.perf_counter(), n
        epochs += 1
        per_epoch = per_epoch or n
        if cold or time.perf_counter() - t0 >= min_s or not n:
            break
    t_end = time.perf_counter()
    c_end = cpu_seconds()  # persistent workers are still alive: they count
    if t_first is None:
        return {"samples": 0, "rate": 0.0, "first_batch_s": float("nan"), "samples_read": n_warm, "epochs": 1}
    rate = (n - n_first) / (t_end - t_first) if cold else n / (t_end - t0)
    out = {"samples": per_epoch, "epochs": epochs, "rate": rate, "first_batch_s": t_first - t0,
           "samples_read": n + n_warm}
    if not cold and n:
        out["cpu_us"] = (c_end - c0) / n * 1e6  # CPU per sample, all processes: steadier than rates when shared
    return out


def _mark_start() -> None:
    try:
        open(MARKER, "rb").close()
    except OSError:
        pass  # absent by design: the attempt itself is the marker in the strace log


def warm_cache(root: Path) -> None:
    """Read every file of the dataset once so that its pages are in the page cache."""
    for p in dataset_files(root):
        with open(p, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass


def run_child(cfg: dict[str, Any], timeout: int = 900) -> dict[str, Any]:
    """One measurement in a fresh process, probed from here: opens (strace, else /proc
    fd sampling) and peak memory of its process tree while it runs."""
    import tempfile

    root = str(Path(cfg["path"]).resolve())
    with tempfile.TemporaryDirectory(prefix="packio-bench-") as tmp:
        log = Path(tmp) / "strace.log"
        prefix = strace_prefix(log) or []
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "packio.bench", "--child", json.dumps(cfg)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
        probe = Probe(proc.pid, root, sample_fds=not prefix)
        out, err = wait_and_probe(proc, probe, timeout)
        if proc.returncode != 0:
            return {"error": (err.strip().splitlines() or ["?"])[-1]}
        result = json.loads(out.strip().splitlines()[-1])
        opens = count_opens(log, root) if prefix else probe.fds_seen
    if "samples_read" in result:
        result["opens_per_sample"] = opens / max(result["samples_read"], 1)
    result.update(peak_mb=probe.peak_mb, memory_kind=probe.memory_kind, opens_method=probe.opens_method)
    return result


# ---------------------------------------------------------------- orchestration

def _source(a: argparse.Namespace, work: Path) -> tuple[Path, Path | None, str]:
    if a.src:
        return Path(a.src), Path(a.csv) if a.csv else None, Path(a.src).name
    root = work / f"synth-{a.count}"
    csv_path = work / f"synth-{a.count}_boxes.csv"
    if not (root / ".complete").exists():
        from packio.bench.synth import make_photo_folder

        print(f"generating {a.count} photo-like JPEGs in {root} ...", flush=True)
        make_photo_folder(root, count=a.count)
        (root / ".complete").touch()
    return root, csv_path, f"synthetic {a.count} JPEGs (400-600 px, q90)"


def _pack(src: Path, csv_path: Path | None, work: Path, tag: str,
          table: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    import packio
    from packio.formats import get_format

    out = {}
    for name, (fmt, kw) in table.items():
        suffix = get_format(fmt).suffixes[0]
        kw = dict(kw, format=fmt)  # tar: the default shard count, max(8, 2 x CPUs)
        if "resize" in kw:
            r = kw["resize"]
            kw["resize"] = packio.ResizeSpec(size=tuple(r["size"]) if "size" in r else None,
                                             short_side=r.get("short_side"))
        dst = work / f"{tag}-{name}{suffix}"
        warm_cache(src)  # every pack, and the bare write, start from the same page cache state
        s = packio.convert(src, dst, csv=csv_path, workers=0, overwrite=True, progress=False, **kw)
        out[name] = {"path": str(dst), "format": fmt, "payload": get_format(fmt).payload_for(None),
                     "fixed": "size" in table[name][1].get("resize", {}),
                     "data": ("arrays" if "size" in table[name][1].get("resize", {}) else
                              "pre-resized" if "short_side" in table[name][1].get("resize", {}) else "original"),
                     "pack_s": s.seconds,
                     "bytes": disk_bytes(dst), "count": s.packed}
        print(f"packed {name:12s} {s.packed} samples, {out[name]['bytes'] / 1e6:8.1f} MB, {s.seconds:6.1f} s",
              flush=True)
    return out


ITERABLE = ("tar",)  # formats also measured through PackedIterableDataset (sequential shard reads)


def plan(packed: dict[str, dict[str, Any]], workers: list[int], quick: bool, cold: bool, src: Path,
          csv_path: Path | None, ncpu: int) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    """The limits and the loader runs, derived from the packed variants: W1 (decode +
    resize) for variants that store encoded images, W2 for fixed-shape pixel variants.
    Every variant runs at packio's documented setting (``num_workers=0``, one decode or
    copy thread per CPU: the default in a training process), then at each of ``workers``
    (without threads); only the limits some run is compared with are measured."""
    w1 = [n for n, p in packed.items() if not p["fixed"]]
    w2 = [n for n, p in packed.items() if p["fixed"]]
    plain = [n for n in w1 if n == packed[n]["format"]]  # each format as packed by default
    runs: list[dict[str, Any]] = []

    def add(label: str, name: str, workload: str, ws: list[int], **kw: Any) -> None:
        for w in ws:
            runs.append({"label": label, "kind": "packio", "path": packed[name]["path"], "workload": workload,
                         "workers": w, "cold": False, **kw})

    for name in w1:
        add(f"{name} + {ncpu} decode threads", name, "W1", [0], threads=ncpu)
        add(name, name, "W1", workers)
        if packed[name]["format"] in ITERABLE and not quick:
            add(name + " (iterable)", name, "W1", workers, kind="packio-iter")
    for w in workers or [ncpu]:  # a plain Dataset's only parallelism: worker processes
        runs.append({"label": "naive per-file PIL + CSV", "kind": "naive", "path": str(src),
                     "csv": str(csv_path) if csv_path else None, "workload": "W1", "workers": w, "cold": False,
                     "limit": 640})
    runs += _webdataset_runs(packed, plain, workers, quick)
    for name in w2:
        add(f"{name} + {ncpu} copy threads", name, "W2", [0], threads=ncpu)
        add(name, name, "W2", workers)
    if cold:
        for name in plain:
            add(name, name, "W1", [max(workers, default=0)], cold=True)
        for name in w2[:1]:
            add(name, name, "W2", workers or [0], cold=True)
    by_path = {p["path"]: p["data"] for p in packed.values()}
    for cfg in runs:  # which limit a run is measured against: what its loader has to decode
        cfg["data"] = by_path.get(cfg["path"], "original")
        cfg["limit_key"] = limit_key(cfg, ncpu)
    return _limits_needed(packed, plain, w2, {cfg["limit_key"] for cfg in runs}, ncpu), runs


def _webdataset_runs(packed: dict[str, dict[str, Any]], plain: list[str], workers: list[int],
                     quick: bool) -> list[dict[str, Any]]:
    """The webdataset library reading packio's shards (packio[bench]), when installed."""
    tar = next((n for n in plain if packed[n]["format"] == "tar"), None)
    try:
        import webdataset  # noqa: F401  (packio[bench]: the reference loader on packio's shards)
    except ImportError:
        return []
    return [{"label": "webdataset lib on packio shards", "kind": "webdataset", "path": packed[tar]["path"],
             "workload": "W1", "workers": w, "cold": False} for w in (workers if tar and not quick else [])]


def _limits_needed(packed: dict[str, dict[str, Any]], plain: list[str], w2: list[str], needed: set[str],
                   ncpu: int) -> list[tuple[str, dict[str, Any]]]:
    """The machine's limits, each measured only when a run is compared with it (else kind
    "none": reported as not measured, drawn nowhere)."""
    encoded = next((n for n in plain if packed[n]["payload"] == "encoded"), None)
    arrays = next((n for n in w2 if packed[n]["format"] == "arrays"), None)
    pre = packed.get("lmdb-pre256", {}).get("path")
    # Limits run as children in every round too, so that they see the same machine
    # as the loaders (its speed drifts by ±20% over minutes here).
    table = {"L1_1proc": {"kind": "L1", "procs": 1, "path": packed[encoded]["path"]} if encoded else None,
             f"L1_{ncpu}proc": {"kind": "L1", "procs": ncpu, "path": packed[encoded]["path"]} if encoded else None,
             "L1_pre256_1proc": {"kind": "L1", "procs": 1, "path": pre} if pre else None,
             "L1_pre256": {"kind": "L1", "procs": ncpu, "path": pre} if pre else None,
             "L2": {"kind": "L2", "path": packed[arrays]["path"]} if arrays else None}
    return [(name, cfg if cfg and name in needed else {"kind": "none"}) for name, cfg in table.items()]


def limit_key(cfg: dict[str, Any], ncpu: int, parallel: bool | None = None) -> str:
    """The limit (a name of ``plan``'s limits) that bounds a run: decode + resize of the
    bytes its loader decodes, in as many processes as it uses (``parallel``: every core);
    per-sample memcpy for arrays."""
    if parallel is None:
        parallel = cfg["workers"] > 0 or cfg.get("threads", 0) > 0
    data = cfg.get("data", "original")
    if data == "arrays":
        return "L2"
    if data == "pre-resized":
        return "L1_pre256" if parallel else "L1_pre256_1proc"
    return f"L1_{ncpu}proc" if parallel else "L1_1proc"


def bare_lmdb_write(src: Path, work: Path) -> float:
    """Baseline for packing: read every file and put its bytes into LMDB, nothing else."""
    import shutil

    import lmdb

    dst = work / "bare.lmdb"
    shutil.rmtree(dst, ignore_errors=True)
    files = sorted(p for p in src.rglob("*") if p.is_file() and not p.name.startswith("."))
    warm_cache(src)
    t = time.perf_counter()
    env = lmdb.open(str(dst), map_size=1 << 40, sync=False, metasync=False)
    with env.begin(write=True) as txn:
        for i, p in enumerate(files):
            txn.put(b"%010d" % i, p.read_bytes(), append=True)
    env.sync(True)
    env.close()
    dt = time.perf_counter() - t
    shutil.rmtree(dst, ignore_errors=True)
    return dt


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="packio bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", help="image folder (default: generate --count photo-like JPEGs)")
    ap.add_argument("--csv", help="CSV of boxes for --src")
    ap.add_argument("--count", type=int, help="generated images (default 5000; 200 with --quick)")
    ap.add_argument("--work", default="bench-out", help="folder for packed data and results")
    ap.add_argument("--workers", help="num_workers settings (no decode threads) timed besides each format's default "
                                      "of num_workers=0 with a thread per CPU, comma-separated (default 0,2; none "
                                      "with --quick)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved passes; medians reported (default 3)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold page cache passes")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 200 images, 1 repeat, lmdb/tar/arrays each at its default setting, warm "
                         "cache only")
    ap.add_argument("--tune", metavar="PATH", help="only tune DataLoader settings for a packed dataset")
    ap.add_argument("--tune-seconds", type=float, default=3.0, help="seconds per tuning trial")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return 0
    if a.tune:
        import packio
        from packio.tuning import tune

        tune(packio.open_dataset(a.tune, resize=SIZE), batch_size=BATCH, seconds=a.tune_seconds)  # none: an error
        return 0
    if a.count is None:
        a.count = 200 if a.quick else 5000
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    src, csv_path, label = _source(a, work)
    workers = [int(w) for w in (a.workers or ("" if a.quick else "0,2")).split(",") if w.strip()]
    repeats = 1 if a.quick else a.repeats
    cold = not (a.no_cold or a.quick)
    ncpu = os.cpu_count() or 1
    print(f"== packio bench: {label}; {ncpu} CPUs; each format with num_workers=0 and {ncpu} threads (packio's "
          f"default){f', then num_workers {workers}' if workers else ''}; {repeats} interleaved "
          f"pass{'es' if repeats != 1 else ''}", flush=True)
    packed = _pack(src, csv_path, work, src.name, variants(QUICK_FORMATS if a.quick else None))
    bare = min(bare_lmdb_write(src, work) for _ in range(1 if a.quick else 2))
    report = run_all(packed, Setup(src, csv_path, label, workers, repeats, cold, a.quick, ncpu), bare)
    _write(report, work, src.name)
    return 0


@dataclass(frozen=True)
class Setup:
    """What a bench run measures besides the packed variants."""

    src: Path
    csv: Path | None
    label: str  # the source, in words
    workers: list[int]  # num_workers settings timed besides each variant's default
    repeats: int
    cold: bool
    quick: bool
    ncpu: int


def run_all(packed: dict[str, dict[str, Any]], s: Setup, bare: float, runner: Any = None) -> dict[str, Any]:
    """Measure the packed variants (each run by ``runner``, default a fresh probed process):
    the report ``render`` and ``plot`` draw."""
    limits, runs = plan(packed, s.workers, s.quick, s.cold, s.src, s.csv, s.ncpu)
    randoms = _random_plan(packed, s.quick, s.cold)
    progress = Progress(s.repeats * (sum(c["kind"] != "none" for _, c in limits) + len(runs)) + len(randoms),
                        s.repeats, runner=runner)
    others = OtherLoad()
    limit_runs, results = measure(limits, runs, s.repeats, progress)
    random_runs = [(name, c, progress.run(f"random access ds[i], {name}, {'cold' if c else 'warm'}", cfg))
                   for name, c, cfg in randoms]
    report = {"source": s.label, "cpus": s.ncpu, "workers": s.workers, "repeats": s.repeats, "busy": others.text(),
              "limits": _limits_summary(limit_runs, s.ncpu),
              "pack": {**{n: {k: v for k, v in p.items() if k != "path"} for n, p in packed.items()},
                       "bare_lmdb_write_s": bare},
              "runs": summarise(runs, results, limit_runs, packed),
              "random": [{"format": n, "cold": c, **r} for n, c, r in random_runs]}
    probed = next((r for rs in results for r in rs if "opens_method" in r), {})
    report.update(opens_method=probed.get("opens_method"), memory_kind=probed.get("memory_kind", "RSS"))
    return report


def _write(report: dict[str, Any], work: Path, tag: str) -> None:
    md = render(report)  # adds the ratios to each run
    (work / f"bench-{tag}.json").write_text(json.dumps(report, indent=1))
    (work / f"bench-{tag}.md").write_text(md)
    print(md)
    try:
        plot(report, work / f"bench-{tag}.png")
        print(f"plot: {work / f'bench-{tag}.png'}")
    except ImportError:
        print("plot skipped: pip install 'packio[bench]' for matplotlib")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


class Progress:
    """Says how many runs there are and roughly how long they take (from the first timed
    run, then from each finished pass), and prints one line per run."""

    def __init__(self, total: int, passes: int, runner: Any = None) -> None:
        self.total, self.passes, self.done, self.t0 = total, passes, 0, time.perf_counter()
        self.runner = runner or run_child
        print(f"{total} measured runs, each in a fresh process ({passes} interleaved "
              f"pass{'es' if passes != 1 else ''} of limits and loaders, then random access); "
              "the first run's time gives an estimate", flush=True)

    def run(self, label: str, cfg: dict[str, Any], extra: bool = False) -> dict[str, Any]:
        """One child run (``extra``: not counted in the plan, e.g. a limit measured again)."""
        self.total += extra
        t = time.perf_counter()
        res = self.runner(cfg)
        dt = time.perf_counter() - t
        self.done += 1
        figure = (f"error: {res['error']}" if "error" in res else f"{res['rate']:,.0f}/s" if "rate" in res
                  else f"p50 {res.get('p50_us', float('nan')):.0f} µs")
        print(f"[{self.done}/{self.total}] {label}: {figure} ({dt:.1f} s)", flush=True)
        if self.done == 1 and self.total > 1:
            print(f"  the first run took {dt:.1f} s: roughly {_duration(dt * self.total)} for all "
                  f"{self.total} runs", flush=True)
        return res

    def pass_done(self, k: int) -> None:
        elapsed = time.perf_counter() - self.t0
        left = elapsed / max(self.done, 1) * (self.total - self.done)
        print(f"pass {k}/{self.passes} done after {_duration(elapsed)}; about {_duration(left)} left", flush=True)


def _run_label(cfg: dict[str, Any]) -> str:
    extra = (f", {cfg['threads']} {'decode' if cfg['workload'] == 'W1' else 'copy'} threads" if cfg.get("threads")
             else "")
    return (f"{cfg['label']} {cfg['workload']} num_workers={cfg['workers']}{extra}, "
            f"{'cold' if cfg['cold'] else 'warm'}")


def measure(limits: list[tuple[str, dict[str, Any]]], runs: list[dict[str, Any]], repeats: int,
            progress: Progress) -> tuple[dict[str, list[dict[str, Any]]], list[list[dict[str, Any]]]]:
    """Every limit and run once per pass, the order reversed every other pass (a drift of
    the machine's speed cancels out): each limit comes from the same passes as the runs it
    bounds. A run faster than its limit in a pass has the limit measured again at once."""
    active = [(n, c) for n, c in limits if c["kind"] != "none"]
    limit_runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in limits}
    results: list[list[dict[str, Any]]] = [[] for _ in runs]
    steps: list[tuple[str | int, dict[str, Any]]] = [*active, *enumerate(runs)]
    for rep in range(repeats):
        for key, cfg in steps if rep % 2 == 0 else steps[::-1]:
            if isinstance(key, str):
                limit_runs[key].append(progress.run(f"limit {key}", _limit_cfg(cfg)))
            else:
                results[key].append(progress.run(_run_label(cfg), {k: v for k, v in cfg.items() if k != "label"}))
        _recheck(rep, dict(active), limit_runs, runs, results, progress)
        progress.pass_done(rep + 1)
    return limit_runs, results


def _limit_cfg(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"workload": "limit", "workers": 0, "cold": False, **cfg}


def _recheck(rep: int, active: dict[str, dict[str, Any]], limit_runs: dict[str, list[dict[str, Any]]],
             runs: list[dict[str, Any]], results: list[list[dict[str, Any]]], progress: Progress) -> None:
    """A run above its limit in pass ``rep`` means the limit was measured under other load:
    measure it again now and keep the higher figure (a limit is the most the machine does)."""
    done: set[str] = set()
    for cfg, rs in zip(runs, results):
        key = cfg.get("limit_key")
        if key not in active or key in done or len(limit_runs[key]) <= rep:
            continue
        lim, got = limit_runs[key][rep].get("rate", float("nan")), rs[rep].get("rate", float("nan"))
        if got > lim:
            done.add(key)
            again = progress.run(f"limit {key} again: {cfg['label']} ran above it ({got:,.0f}/s > {lim:,.0f}/s)",
                                 _limit_cfg(active[key]), extra=True)
            if again.get("rate", 0.0) > lim:
                limit_runs[key][rep] = again


def _med(rs: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rs if key in r]
    return statistics.median(vals) if vals else float("nan")


def _limits_summary(limit_runs: dict[str, list[dict[str, Any]]], ncpu: int) -> dict[str, float]:
    lim = {name: _med(rs, "rate") for name, rs in limit_runs.items()}
    return {"L1_1proc": lim["L1_1proc"], f"L1_{ncpu}proc": lim[f"L1_{ncpu}proc"], "L1_pre256": lim["L1_pre256"],
            "L1_pre256_1proc": lim["L1_pre256_1proc"], "L2_per_sample": lim["L2"],
            "L2_batched": _med(limit_runs["L2"], "batched")}


def summarise(runs: list[dict[str, Any]], results: list[list[dict[str, Any]]],
              limit_runs: dict[str, list[dict[str, Any]]], packed: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: medians over the passes, and ``x_limit_paired``: the median over the
    passes of the run's rate over its limit measured in the same pass."""
    summary = []
    for cfg, rs in zip(runs, results):
        errs = [r["error"] for r in rs if "error" in r]
        lims = [r.get("rate", float("nan")) for r in limit_runs.get(cfg.get("limit_key", ""), [])]
        paired = [r["rate"] / lim for r, lim in zip(rs, lims) if "rate" in r and lim == lim and lim > 0]
        row = {**{k: cfg[k] for k in ("label", "workload", "workers", "cold", "data")},
               "threads": cfg.get("threads", 0), "rate": _med(rs, "rate"),
               "first_batch_s": _med(rs, "first_batch_s"), "opens_per_sample": _med(rs, "opens_per_sample"),
               "cpu_us_per_sample": _med(rs, "cpu_us"), "x_limit_paired": statistics.median(paired) if paired
               else float("nan"), "peak_mb": _med(rs, "peak_mb"), "resident_after_evict": _med(rs, "resident_after_evict"),
               "error": errs[0] if errs else None, "runs": [r.get("rate") for r in rs],
               "samples_ok": all(r.get("samples") == r.get("expected") or r.get("expected") is None
                                 or cfg["kind"] == "naive" for r in rs)}
        name = next((n for n in packed if packed[n]["path"] == cfg["path"]), None)
        per_sample_bytes = packed[name]["bytes"] / packed[name]["count"] if name else None
        row["mb_s"] = row["rate"] * per_sample_bytes / 1e6 if per_sample_bytes else float("nan")
        summary.append(row)
    return summary


def _random_plan(packed: dict[str, dict[str, Any]], quick: bool, cold: bool) -> list[tuple[str, bool, dict]]:
    """Random-access latency runs: each format's default variant, warm (and cold)."""
    per_format: dict[str, str] = {}  # each format's default variant (they come before the levers)
    for name, facts in packed.items():
        per_format.setdefault(facts["format"], name)
    return [(name, c, {"kind": "packio", "path": packed[name]["path"], "workload": "random", "workers": 0,
                       "cold": c})
            for name in list(per_format.values())[:1 if quick else None] for c in ([False, True] if cold else [False])]


def limit_for(row: dict[str, Any], r: dict[str, Any], parallel: bool | None = None) -> tuple[str, float]:
    """The machine's limit a run is compared with (:func:`limit_key`; ``parallel``: with every
    core, the run's ceiling): its label and samples/s."""
    parallel = row["workers"] > 0 or row.get("threads", 0) > 0 if parallel is None else parallel
    key = limit_key(row, r["cpus"], parallel)
    label = {"L2": "L2", "L1_pre256": "L1pre", "L1_pre256_1proc": "L1pre·1"}.get(key, "L1" if parallel else "L1·1")
    return label, r["limits"]["L2_per_sample" if key == "L2" else key]


def ratios(r: dict[str, Any]) -> None:
    """Add to each run: ``x_limit`` (over the limit with the same cores: 1 process for
    no workers and no decode threads, else all; the median over the passes of the ratio to
    the limit measured in the same pass), ``above_limit``, ``x_ceiling`` (over the limit with
    every core) and ``x_best`` (over the fastest run of the same workload, data and
    cache state): what the peers harness reports, so a regression shows here too."""
    ok = [row for row in r["runs"] if not row["error"]]
    best: dict[tuple[Any, ...], float] = {}
    for row in ok:
        k = (row["workload"], row.get("data"), row["cold"])
        best[k] = max(best.get(k, 0.0), row["rate"])
    for row in ok:
        paired = row.get("x_limit_paired", float("nan"))  # over the limit of the same pass: drift cancels
        row["x_limit"] = paired if paired == paired else row["rate"] / limit_for(row, r)[1]
        row["above_limit"] = row["x_limit"] > 1.0  # a measurement error, never a ratio to print
        row["x_ceiling"] = row["rate"] / limit_for(row, r, parallel=True)[1]
        row["x_best"] = row["rate"] / best[(row["workload"], row.get("data"), row["cold"])]


def render(r: dict[str, Any]) -> str:
    L = r["limits"]
    ncpu = r["cpus"]
    ratios(r)
    naive = {row["workers"]: row["rate"] for row in r["runs"] if row["label"].startswith("naive")}
    pre = ", ".join(n for n, p in r["pack"].items() if isinstance(p, dict) and p.get("data") == "pre-resized")

    def rate(key: str) -> str:  # --quick leaves some limits unmeasured: say so, never "nan/s"
        v = L.get(key)
        return "not measured" if v is None or v != v else f"{v:.0f}/s"

    lines = [f"### packio bench — {r['source']}, {ncpu} CPUs, median of {r['repeats']}",
             "",
             *([f"**Busy machine:** {r['busy']} while this ran (on average): samples/s run lower, and vary more, "
                "than on a quiet machine; the ratios to limits measured in the same passes are steadier. Run "
                "again on a quiet machine for figures to quote.", ""] if r.get("busy") else []),
             f"- **W1**: {WORKLOADS['W1']}, from the original bytes or from bytes stored pre-resized "
             f"(short side 256: {pre or 'none in this run'}).",
             f"- **W2**: {WORKLOADS['W2']}.",
             f"- Limits (this machine, same rounds): **L1** decode + resize {SIZE}² of in-memory original bytes: "
             f"{rate('L1_1proc')} in 1 process (L1·1), {rate(f'L1_{ncpu}proc')} in {ncpu}; "
             f"**L1pre** the same on pre-resized bytes: {rate('L1_pre256_1proc')} in 1 "
             f"(L1pre·1), {rate('L1_pre256')} in {ncpu}; **L2** uint8 {SIZE}² copy from a page-cached memmap: "
             f"{rate('L2_per_sample')} per sample, {rate('L2_batched')} {BATCH} at a time.",
             "- **× limit**: samples/s over the limit for the same data and number of processes "
             "(workers = 0 and no decode threads: the 1-process limit). "
             f"**× ceiling**: over the limit with all {ncpu} cores. **× best**: over the fastest run "
             "of the same workload, data and cache state.",
             "",
             "| loader | workload | data | workers | cache | samples/s | MB/s | × limit | × ceiling | × best "
             f"| ×naive | opens/sample | peak MB ({r['memory_kind']}, process tree) | first batch s |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in r["runs"]:
        head = f"| {row['label']} | {row['workload']} | {row.get('data', '')} | {row['workers']} | "
        if row["error"]:
            lines.append(head + f"{'cold' if row['cold'] else 'warm'} | error: {row['error']} |||||||||")
            continue
        name, _ = limit_for(row, r)
        same = row["workers"] or row.get("threads", 0)  # the naive loader on as many CPUs
        xn = f"{row['rate'] / naive[same]:.1f}" if naive.get(same) and row["workload"] == "W1" else ""
        cold = "warm" if not row["cold"] else f"cold ({row['resident_after_evict'] * 100:.0f}% resident)"
        mbs = "" if row["mb_s"] != row["mb_s"] else f"{row['mb_s']:.0f}"
        xl = (f"above {name}: measurement error" if row["above_limit"] else
              "not measured" if row["x_limit"] != row["x_limit"] else f"{row['x_limit']:.2f} ({name})")
        lines.append(head + f"{cold} | {row['rate']:.0f} | {mbs} | {xl} | "
                     f"{row['x_ceiling']:.2f} | {row['x_best']:.2f} | {xn} | "
                     f"{row['opens_per_sample']:.4f} | {row['peak_mb']:.0f} | {row['first_batch_s']:.2f} |")
    above = [f"{x['label']} (num_workers={x['workers']}, {'cold' if x['cold'] else 'warm'})"
             for x in r["runs"] if x.get("above_limit")]
    if above:
        lines += ["", f"**Measurement error:** {', '.join(above)} ran above the limit measured in the same passes "
                      "(even after measuring it again): the machine's load changed during the run or the limit "
                      "does not measure what that loader does. Run again on a quiet machine before reading ratios."]
    lines += ["", f"Opens counted by {r['opens_method']}; memory: peak {r['memory_kind']} summed over the "
              f"loader process and its workers, sampled while they run."]
    return "\n".join(lines + _side_tables(r)) + "\n"


def _side_tables(r: dict[str, Any]) -> list[str]:
    """The pack table and the random-access table of the report."""
    lines: list[str] = []
    lines += ["", "| format | pack s | MB on disk | samples |", "|---|---:|---:|---:|"]
    for n, p in r["pack"].items():
        if isinstance(p, dict):
            lines.append(f"| {n} | {p['pack_s']:.1f} | {p['bytes'] / 1e6:.1f} | {p['count']} |")
    lines.append(f"| bare LMDB write of the same files | {r['pack']['bare_lmdb_write_s']:.1f} | | |")
    lines += ["", "| random access ds[i] (decode=False) | cache | p50 µs | p99 µs | opens/sample |", "|---|---|---:|---:|---:|"]
    for x in r["random"]:
        if "error" in x:
            lines.append(f"| {x['format']} | {'cold' if x['cold'] else 'warm'} | error: {x['error']} | | |")
        else:
            lines.append(f"| {x['format']} | {'cold' if x['cold'] else 'warm'} | {x['p50_us']:.0f} | "
                         f"{x['p99_us']:.0f} | {x['opens_per_sample']:.3f} |")
    return lines


# One chart per workload and data kind, each with the limits that apply to it.
PANELS = (("W1", "original", f"W1 from original bytes: {WORKLOADS['W1']}"),
          ("W1", "pre-resized", "W1 from pre-resized bytes (short side 256): decode + resize to "
                                f"{SIZE}x{SIZE}, batches of {BATCH}"),
          ("W2", "arrays", f"W2: {WORKLOADS['W2']}"))


def limit_lines(r: dict[str, Any], data: str) -> list[tuple[str, float, str]]:
    """The limits drawn on the panel of ``data`` as (legend label, samples/s, line style):
    only those measured (a --quick run leaves some out; they are never drawn as nan)."""
    L, n = r["limits"], r["cpus"]
    table = {"original": [("L1 decode+resize limit, 1 process", "L1_1proc", ":"),
                          (f"L1 decode+resize limit, {n} processes", f"L1_{n}proc", "--")],
             "pre-resized": [("L1pre limit (pre-resized bytes), 1 process", "L1_pre256_1proc", ":"),
                             (f"L1pre limit (pre-resized bytes), {n} processes", "L1_pre256", "--")],
             "arrays": [("L2 memcpy limit, per sample", "L2_per_sample", ":"),
                        (f"L2 memcpy limit, {BATCH} at a time", "L2_batched", "--")]}
    out = []
    for label, key, style in table.get(data, []):
        v = L.get(key)
        if isinstance(v, (int, float)) and v == v and v > 0:
            out.append((f"{label}: {v:,.0f}/s", float(v), style))
    return out


def legend(sel: list[dict[str, Any]], r: dict[str, Any], data: str) -> list[tuple[str, Any]]:
    """One panel's legend, (label, what it names): each kind of run drawn ((num_workers,
    threads)), "cold" when a cold-cache run is drawn, each measured limit ((samples/s, line style))."""
    kinds = sorted({(x["workers"], x.get("threads", 0)) for x in sel}, key=lambda k: (k[1] > 0, k[0]))
    return ([(_kind_label(k), k) for k in kinds] + ([("cold page cache", "cold")] if any(x["cold"] for x in sel)
                                                     else [])
            + [(label, (value, style)) for label, value, style in limit_lines(r, data)])


def _kind_label(k: tuple[int, int]) -> str:
    w, t = k
    return f"num_workers=0, {t} threads in 1 process" if t else "num_workers=0 (1 process)" if w == 0 else f"num_workers={w}"


def plot(r: dict[str, Any], path: Path) -> None:
    """The report's chart: horizontal bars (samples/s, value on each bar), colour = workers
    or decode threads, hatched = cold page cache, red lines = the machine's limits for that data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = [x for x in r["runs"] if not x["error"]]
    panels = [(wl, data, title, [x for x in rows if x["workload"] == wl and x.get("data", "original") == data])
              for wl, data, title in PANELS]
    panels = [p for p in panels if p[3]]
    heights = [len(p[3]) + 2.5 for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(15, 0.34 * sum(heights) + 1.2),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    ncpu = r["cpus"]
    palette = ["#4c72b0", "#dd8452", "#55a868", "#8172b2", "#937860"]
    kinds = sorted({(x["workers"], x.get("threads", 0)) for x in rows}, key=lambda k: (k[1] > 0, k[0]))
    colours = {k: palette[i % len(palette)] for i, k in enumerate(kinds)}

    for ax, (wl, data, title, sel) in zip(axes[:, 0], panels):
        sel = sorted(sel, key=lambda x: (x["label"], x["workers"], x["cold"]))
        y = list(range(len(sel)))[::-1]
        keys = [(x["workers"], x.get("threads", 0)) for x in sel]
        bars = ax.barh(y, [x["rate"] for x in sel], color=[colours[k] for k in keys],
                       hatch=["//" if x["cold"] else "" for x in sel], edgecolor="white", height=0.7)
        ax.bar_label(bars, labels=[f"{x['rate']:,.0f}" + ("  above its limit: measurement error"
                                                           if x.get("above_limit") else "") for x in sel],
                     padding=3, fontsize=8)
        ax.set_yticks(y, [x["label"] + ("" if x.get("threads") else f"  ·  num_workers={x['workers']}")
                          + ("  ·  cold" if x["cold"] else "") for x in sel], fontsize=8)
        top = max([x["rate"] for x in sel] + [v for _, v, _ in limit_lines(r, data)])
        handles = []
        for label, what in legend(sel, r, data):  # only what this panel draws
            if what == "cold":
                handles.append(Patch(facecolor="white", edgecolor="grey", hatch="//", label=label))
            elif isinstance(what[1], str):  # a limit: (samples/s, line style)
                handles.append(ax.axvline(what[0], color="#c44e52", ls=what[1], lw=1.2, label=label))
            else:
                handles.append(Patch(color=colours[what], label=label))
        ax.set_xlim(0, top * 1.18)
        ax.set_xlabel("samples per second (higher is better)")
        ax.set_title(title, fontsize=10, loc="left")
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        ax.grid(axis="x", alpha=0.3)
    runs = f"median of {r['repeats']} runs" if r["repeats"] > 1 else "1 run"
    fig.suptitle(f"packio bench — {r['source']}, {ncpu} CPUs, {runs} each"
                 + (f"\nbusy machine: {r['busy']}" if r.get("busy") else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
