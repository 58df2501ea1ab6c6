"""Loader throughput of packio's read paths, for comparing two versions of packio.

    python tools/bench_loader.py --work bench-out/loader            # this checkout
    PYTHONPATH=/path/to/other/checkout python tools/bench_loader.py --work bench-out/loader

Packs (once, into --work) generated photos as LMDB (decoded + resized at read) and as
pre-resized arrays (memory-mapped gather), then times whole epochs through
``packio.DataLoader`` (batch 64, shuffled, persistent workers) in interleaved
rounds and prints the median samples/s per path. Uses only API both versions have.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path



def epoch_rate(loader) -> tuple[float, float]:
    """(samples/s wall, µs of this process's CPU per sample): the CPU figure is what
    a busy shared machine disturbs least, and with 0 workers it is the whole cost."""
    t, c, n = time.perf_counter(), time.process_time(), 0
    for b in loader:
        n += len(b["label"])
    return n / (time.perf_counter() - t), (time.process_time() - c) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="bench-out/loader")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    import packio
    from packio.bench.synth import make_photo_folder

    work = Path(a.work)
    src = work / "src"
    if not src.exists():
        make_photo_folder(src, a.count, size=(240, 320), with_csv=False)
    paths = {"lmdb": work / "d.lmdb", "arrays": work / "d.arrays"}
    if not paths["lmdb"].exists():
        packio.convert(src, paths["lmdb"], progress=False)
    if not paths["arrays"].exists():
        packio.convert(src, paths["arrays"], resize=packio.ResizeSpec(size=(128, 128)), progress=False)
    print(f"packio from {Path(packio.__file__).parent}")
    cases = {
        "lmdb decode+resize 128, 0 workers": (paths["lmdb"], {"resize": 128}, 0),
        "lmdb decode+resize 128, 2 workers": (paths["lmdb"], {"resize": 128}, 2),
        "arrays 128 gather, 0 workers": (paths["arrays"], {}, 0),
        "arrays 128 gather, 2 workers": (paths["arrays"], {}, 2),
        "lmdb iterable decode+resize, 0 workers": (paths["lmdb"], {"resize": 128, "iterable": True}, 0),
        "lmdb iterable decode+resize, 2 workers": (paths["lmdb"], {"resize": 128, "iterable": True}, 2),
    }
    loaders = {}
    for name, (path, kw, workers) in cases.items():
        ds = packio.open_dataset(path, **kw)
        extra = {"persistent_workers": True} if workers else {}
        shuffle = {} if kw.get("iterable") else {"shuffle": True}
        loaders[name] = packio.DataLoader(ds, batch_size=64, num_workers=workers, **shuffle, **extra)
        epoch_rate(loaders[name])  # warm-up: workers, page cache, lazy opens
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(a.rounds):
        for name, loader in loaders.items():
            rates[name].append(epoch_rate(loader))
    print(f"{'':42s} {'samples/s':>10s} {'main-process CPU µs/sample':>27s}  (medians of {a.rounds} epochs)")
    for name, r in rates.items():
        print(f"{name:42s} {statistics.median(x[0] for x in r):10.0f} {statistics.median(x[1] for x in r):27.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
