"""Conversion time: single process vs a Dask LocalCluster, same data, same format.

    python tools/bench_dask.py [--src ../shared/data/hymenoptera/hymenoptera_data] [--workers 2]

Prints seconds per format for: single process, local pool (--workers), Dask
LocalCluster (one thread per worker process), and the ratios. On 2 cores the point
is correctness and the path to a real cluster, not speed.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import packio  # noqa: E402
from packio.bench.runner import warm_cache  # noqa: E402


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=str(root.parent / "shared/data/hymenoptera/hymenoptera_data"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from dask.distributed import Client, LocalCluster

    src = Path(a.src)
    out = Path(tempfile.mkdtemp())
    formats = {".lmdb": {}, ".h5": {}, ".wds": {}, ".arrays": {"resize": packio.ResizeSpec(size=(224, 224))}}
    print(f"source {src}; {a.workers} workers; median of {a.repeats}")
    print("| format | single process s | local pool s | Dask LocalCluster s | Dask / single |")
    print("|---|---:|---:|---:|---:|")
    with LocalCluster(n_workers=a.workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                      silence_logs=40) as cluster, Client(cluster) as client:
        client.run(lambda: __import__("packio.converter"))  # warm the workers' imports
        for suffix, kw in formats.items():
            times: dict[str, list[float]] = {"single": [], "pool": [], "dask": []}
            for _ in range(a.repeats):
                for mode in times:
                    dst = out / f"{mode}{suffix}"
                    shutil.rmtree(dst, ignore_errors=True) if dst.is_dir() else dst.unlink(missing_ok=True)
                    warm_cache(src)
                    extra = {"workers": a.workers} if mode == "pool" else {"scheduler": client} if mode == "dask" else {}
                    t = time.perf_counter()
                    s = packio.convert(src, dst, progress=False, **kw, **extra)
                    times[mode].append(time.perf_counter() - t)
                    assert s.packed > 0
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"| {suffix} | {med['single']:.2f} | {med['pool']:.2f} | {med['dask']:.2f} | "
                  f"{med['dask'] / med['single']:.2f} |", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
