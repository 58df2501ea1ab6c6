"""Packing at scale: per-sample CPU, converter peak RSS, open time and reader RSS for N samples.

Generates N tiny 64x64 q90 JPEGs (``--distinct`` of them encoded, the rest hard links, in
one flat folder, or ``--per-folder`` to a sub-folder) and a CSV with an image label and one
box per image, then packs them into each format in a fresh child process (so each peak RSS
is that run's own) and opens and reads the result in another. Prints one row per (N,
format): pack CPU per sample (getrusage: user + system, less load-sensitive than wall
time), converter peak RSS and its growth per sample, GC passes, output size, open time,
reader RSS and read CPU per sample; then the ratios of the per-sample figures at the
largest N to those at the smallest.

    python tools/scale.py --n 10000 100000 1000000
    python tools/scale.py --n 10000 100000 --tree /work/main      # the same run on another tree
    python tools/scale.py --n 10000 100000 1000000 --formats lmdb --per-folder 1000 --scheduler local

``--tree`` puts that tree's ``packio`` first on the children's path (before/after
comparisons: run once per tree with the same ``--work`` folder; the images are reused).
Read CPU of two trees side by side (the same files, interleaved rounds, every format):
``tools/read_cpu.py --tree . OTHER``; here, the read column is this tree's, for its
scaling with N. Before each pack the free disk is checked
against the output size per sample measured at a smaller N (or a guess). Figures for
claims come from a quiet machine (``flock /tmp/packio-timing.lock``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SUFFIX = {"lmdb": ".lmdb", "wds": ".wds", "arrays": ".arrays", "h5": ".h5"}
# bytes per sample on disk before any was measured: 1 KB JPEGs (LMDB 3 a 4 KiB page; tar a
# header and a JSON member each, 512-byte blocks); arrays and h5 hold 64x64x3 pixels
GUESS_BYTES = {"lmdb": 1500, "wds": 3000, "arrays": 12600, "h5": 12600}

PACK = r"""
import gc, json, os, resource, sys, time
src, csv_path, dst, fmt, workers, dask_workers = sys.argv[1:7]
import packio
try:
    from packio.options import ResizeSpec
except ImportError:  # older trees (b8708ae) kept it in packio.decode
    from packio.decode import ResizeSpec
def rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
def worker_cpu(client):  # the Dask worker processes' CPU so far, summed
    if client is None:
        return 0.0
    used = lambda: (lambda r: r.ru_utime + r.ru_stime)(__import__("resource").getrusage(0))  # noqa: E731
    return sum(client.run(used).values())
client = cluster = None
if int(dask_workers):  # --scheduler local: a LocalCluster; its scheduler runs in this (the driver's) process
    from dask import distributed
    cluster = distributed.LocalCluster(n_workers=int(dask_workers), threads_per_worker=1, processes=True,
                                       dashboard_address=":0", silence_logs=50)
    client = distributed.Client(cluster)
base = rss_kib()
gc.collect()
before = [dict(s) for s in gc.get_stats()]
ru0, w0 = resource.getrusage(resource.RUSAGE_SELF), worker_cpu(client)
t0 = time.perf_counter()
s = packio.convert(src, dst, csv=csv_path, workers=int(workers), progress=False, scheduler=client,
                   resize=ResizeSpec(size=(64, 64)) if fmt == "arrays" else None)
wall = time.perf_counter() - t0
ru, w1 = resource.getrusage(resource.RUSAGE_SELF), worker_cpu(client)
after = gc.get_stats()
with open("/proc/self/status") as f:  # this process's own peak (ru_maxrss keeps the forking parent's across exec)
    hwm = int(next(line for line in f if line.startswith("VmHWM:")).split()[1])
print(json.dumps({"packio": packio.__file__, "packed": s.packed, "skipped": sum(s.skipped.values()),
                  "cpu_s": ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime, "wall_s": wall,
                  "base_rss_kib": base, "peak_rss_kib": hwm, "worker_cpu_s": w1 - w0,
                  "gc_collections": [a["collections"] - b["collections"] for a, b in zip(after, before)]}))
"""

READ = r"""
import json, os, resource, sys, time
dst, limit = sys.argv[1], int(sys.argv[2])
import packio, packio.read.datasets, torch  # imports are not the open time
t0 = time.perf_counter()
ds = packio.open_dataset(dst)
open_ms = (time.perf_counter() - t0) * 1e3
ru0 = resource.getrusage(resource.RUSAGE_SELF)
n = min(len(ds), limit)
step = max(1, len(ds) // n)
for i in range(0, step * n, step):
    ds[i]
ru = resource.getrusage(resource.RUSAGE_SELF)
idx = list(range(0, step * n, step))
for k in range(0, n, 64):  # the DataLoader's route: one __getitems__ call per batch of 64
    ds.__getitems__(idx[k:k + 64])
rb = resource.getrusage(resource.RUSAGE_SELF)
with open("/proc/self/status") as f:
    hwm = int(next(line for line in f if line.startswith("VmHWM:")).split()[1])
print(json.dumps({"open_ms": open_ms, "read": n, "read_cpu_s": ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime,
                  "batch_cpu_s": rb.ru_utime + rb.ru_stime - ru.ru_utime - ru.ru_stime,
                  "reader_rss_kib": hwm}))
"""


def make_source(work: Path, n: int, distinct: int, per_folder: int = 0) -> tuple[Path, Path]:
    """``work/src-N/`` with N JPEGs (hard links to ``distinct`` encoded ones; ``per_folder``
    to a sub-folder, 0: flat) and ``work/src-N.csv``. Costs one directory entry and one
    CSV row per sample (no inode: ext4 allows 65,000 links to a file)."""
    import numpy as np
    import simplejpeg

    tag = f"{n}" + (f"-f{per_folder}" if per_folder else "")
    src, csv_path = work / f"src-{tag}", work / f"src-{tag}.csv"
    if csv_path.exists():
        return src, csv_path
    if n // distinct >= 65_000:
        raise SystemExit(f"--distinct {distinct}: {n} samples need at least {n // 65_000 + 1} (ext4 link limit)")
    pool = work / "pool"
    pool.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for k in range(distinct):
        p = pool / f"{k}.jpg"
        if not p.exists():
            img = rng.integers(0, 256, (8, 8, 3), np.uint8).repeat(8, 0).repeat(8, 1)
            p.write_bytes(simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=90))
    src.mkdir(exist_ok=True)
    tmp = csv_path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filename", "label", "class", "xmin", "ymin", "xmax", "ymax"])
        for i in range(n):
            name = f"d{i // per_folder:05d}/img{i:08d}.jpg" if per_folder else f"img{i:08d}.jpg"
            if per_folder and i % per_folder == 0:
                (src / name).parent.mkdir(exist_ok=True)
            if not (src / name).exists():
                os.link(pool / f"{i % distinct}.jpg", src / name)
            w.writerow([name, f"c{i % 10}", f"b{i % 5}", i % 20, i % 17, 40 + i % 20, 45 + i % 17])
    tmp.rename(csv_path)
    return src, csv_path


def child(code: str, args: list[str], tree: Path | None) -> dict:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # cwd outside any checkout: 'python -c' puts the working folder first on the path
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, cwd="/")
    if out.returncode:
        raise SystemExit(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _disk_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _check_disk(work: Path, n: int, fmt: str, per_sample: dict[str, float]) -> None:
    """Refuse a pack the free disk cannot hold (per sample: measured at a smaller N, else a guess)."""
    need = n * per_sample.get(fmt, GUESS_BYTES[fmt]) * 1.1
    free = shutil.disk_usage(work).free
    if need > free:
        raise SystemExit(f"{fmt} at {n}: needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free in {work}; "
                         f"leave this format out (--formats) or free some space")


def run(work: Path, n: int, fmt: str, tree: Path | None, workers: int, read_limit: int,
        per_sample: dict[str, float]) -> dict:
    src, csv_path = make_source(work, n, ARGS.distinct, ARGS.per_folder)
    dst = work / f"out-{n}{SUFFIX[fmt]}"
    if dst.exists():
        subprocess.run(["rm", "-rf", str(dst)], check=True)
    _check_disk(work, n, fmt, per_sample)
    pack = child(PACK, [str(src), str(csv_path), str(dst), fmt, str(workers), str(ARGS.dask_workers)], tree)
    out_bytes = _disk_bytes(dst)
    per_sample[fmt] = out_bytes / n
    read = child(READ, [str(dst), str(read_limit)], tree)
    subprocess.run(["rm", "-rf", str(dst)], check=True)
    return {"n": n, "format": fmt, "out_bytes": out_bytes, **pack, **read}


def row(r: dict) -> str:
    growth = (r["peak_rss_kib"] - r["base_rss_kib"]) * 1024 / r["n"]
    return (f"{r['n']:>9} {r['format']:>7} {r['cpu_s'] / r['n'] * 1e6:9.1f} {r['peak_rss_kib'] / 1024:9.0f} "
            f"{growth:8.0f} {str(r['gc_collections']):>16} {r['open_ms']:8.1f} {r['reader_rss_kib'] / 1024:9.0f} "
            f"{r['read_cpu_s'] / r['read'] * 1e6:9.1f} {r['batch_cpu_s'] / r['read'] * 1e6:9.1f} "
            f"{r['out_bytes'] / 2**20:9.0f}" + (f" {r['worker_cpu_s'] / r['n'] * 1e6:10.1f}" if ARGS.dask_workers else ""))


def main(argv: list[str] | None = None) -> int:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--formats", nargs="+", default=["lmdb", "wds", "arrays"], choices=sorted(SUFFIX))
    ap.add_argument("--tree", type=Path, help="a packio checkout whose packio/ the children import")
    ap.add_argument("--work", type=Path, default=Path("/tmp/packio-scale"), help="where images and outputs go")
    ap.add_argument("--distinct", type=int, default=1000, help="distinct JPEGs (the rest are hard links)")
    ap.add_argument("--workers", type=int, default=0, help="convert(workers=...): 0 packs in the measured process")
    ap.add_argument("--read", type=int, default=20_000, help="samples read per dataset for the read figure")
    ap.add_argument("--json", type=Path, help="also write every result here")
    ap.add_argument("--per-folder", type=int, default=0, help="images per sub-folder (0: one flat folder)")
    ap.add_argument("--scheduler", choices=["local"], help="pack with Dask: a LocalCluster started in the child "
                    "(peak RSS is then the driver's, scheduler included; 'wcpu us/s': the workers' CPU per sample)")
    ap.add_argument("--dask-workers", type=int, default=2, help="LocalCluster worker processes (--scheduler local)")
    ARGS = a = ap.parse_args(argv)
    a.dask_workers = a.dask_workers if a.scheduler else 0
    a.work.mkdir(parents=True, exist_ok=True)
    print(f"tree: {a.tree or 'this checkout / installed packio'}; {a.distinct} distinct 64x64 q90 JPEGs; "
          f"workers={a.workers}; " + (f"{a.per_folder} per sub-folder" if a.per_folder else "one flat folder")
          + (f"; Dask LocalCluster of {a.dask_workers} worker processes" if a.scheduler else ""))
    print(f"{'N':>9} {'format':>7} {'cpu us/s':>9} {'peak MiB':>9} {'B/sample':>8} {'gc gen0/1/2':>16} "
          f"{'open ms':>8} {'read MiB':>9} {'read us/s':>9} {'batch us/s':>9} {'out MiB':>9}"
          + (f" {'wcpu us/s':>10}" if a.scheduler else ""))
    results: list[dict] = []
    per_sample: dict[str, float] = {}  # output bytes per sample, measured
    for n in sorted(a.n):
        for fmt in a.formats:
            t = time.perf_counter()
            results.append(run(a.work, n, fmt, a.tree, a.workers, a.read, per_sample))
            if len(results) == 1:
                print(f"packio imported from {results[0]['packio']}")
            print(row(results[-1]) + f"   ({time.perf_counter() - t:.0f} s)", flush=True)
    lo, hi = min(a.n), max(a.n)
    if lo != hi:
        for fmt in a.formats:
            r0 = next(r for r in results if r["n"] == lo and r["format"] == fmt)
            r1 = next(r for r in results if r["n"] == hi and r["format"] == fmt)
            grow = (r1["peak_rss_kib"] - r0["peak_rss_kib"]) * 1024 / (hi - lo)
            print(f"{fmt}: pack CPU/sample at {hi} = {r1['cpu_s'] / hi / (r0['cpu_s'] / lo):.2f} x at {lo}; "
                  f"read CPU/sample {r1['read_cpu_s'] / r1['read'] / (r0['read_cpu_s'] / r0['read']):.2f} x; "
                  f"converter peak RSS grows {grow:.0f} B per sample from {lo} to {hi}" + (
                      f"; Dask workers' CPU/sample {r1['worker_cpu_s'] / hi / (r0['worker_cpu_s'] / lo):.2f} x"
                      if a.scheduler else ""))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


ARGS: argparse.Namespace

if __name__ == "__main__":
    sys.exit(main())
