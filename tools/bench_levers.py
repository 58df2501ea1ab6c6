"""Micro-benchmarks behind the read-path choices in packio (figures and ratios).

    python tools/bench_levers.py [--npy bench-out/synth-5000-arrays-224.npy]

1. resize 540x480 → 224²: OpenCV INTER_AREA vs packio's 2x2 box halving + bilinear
2. batching 64 decoded images: stacking CHW views vs stacking HWC memory (channels_last)
3. gathering 64 random samples from a memory-mapped uint8 array: np.take(out=) on the
   np.memmap vs fancy indexing a plain ndarray view
4. a 64x224x224x3 batch: sent from DataLoader workers (torch shared memory) vs
   gathered in the main process
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packio import decode as dec  # noqa: E402


def per_call(fn, n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


class _Batches(torch.utils.data.Dataset):
    def __init__(self, path: str) -> None:
        self.path = path

    def __len__(self) -> int:
        return 10_000

    def __getitems__(self, idx: list[int]) -> torch.Tensor:
        a = np.load(self.path, mmap_mode="r")
        return torch.from_numpy(np.asarray(a)[np.asarray(idx) % len(a)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--npy", help="an images.npy of a packed arrays dataset (default: a generated 2,000-sample one)")
    a = ap.parse_args()
    import cv2

    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    img = np.random.default_rng(0).integers(0, 255, (480, 540, 3), dtype=np.uint8)
    t_area = per_call(lambda: cv2.resize(img, (224, 224), interpolation=cv2.INTER_AREA), 300)
    t_fast = per_call(lambda: dec.resize(img, (224, 224)), 300)
    print(f"1. resize 540x480→224²: INTER_AREA {t_area * 1e3:.2f} ms, packio {t_fast * 1e3:.2f} ms "
          f"({t_area / t_fast:.1f}x faster)")

    hwc = [torch.from_numpy(np.ascontiguousarray(img[:224, :224])) for _ in range(64)]
    chw = [x.permute(2, 0, 1) for x in hwc]
    t_views = per_call(lambda: torch.stack(chw), 30)
    t_hwc = per_call(lambda: torch.stack(hwc).permute(0, 3, 1, 2), 30)
    print(f"2. batch of 64: stack CHW views {t_views / 64 * 1e6:.0f} µs/sample, stack HWC {t_hwc / 64 * 1e6:.0f} "
          f"µs/sample ({t_views / t_hwc:.1f}x)")

    path = a.npy
    if path is None:
        path = str(Path(tempfile.mkdtemp()) / "images.npy")
        arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(2000, 224, 224, 3))
        arr[:] = 7
        arr.flush()
        del arr
    mm = np.load(path, mmap_mode="r")
    view = np.asarray(mm)
    np.array(view)  # page cache warm
    rng = np.random.default_rng(1)
    out = np.empty((64, 224, 224, 3), np.uint8)
    idx = lambda: rng.integers(0, len(mm), 64)  # noqa: E731
    t_take = per_call(lambda: np.take(mm, idx(), axis=0, out=out), 50)
    t_view = per_call(lambda: view[idx()], 50)
    print(f"3. gather 64 from a memmap: np.take(out=) {64 / t_take:.0f} samples/s, ndarray view "
          f"{64 / t_view:.0f} samples/s ({t_take / t_view:.1f}x)")

    loader = torch.utils.data.DataLoader(_Batches(path), batch_size=64, num_workers=2, collate_fn=lambda b: b,
                                         persistent_workers=True, sampler=range(64 * 60))
    for _ in loader:
        pass
    t = time.perf_counter()
    n = sum(len(b) for b in loader)
    ipc = n / (time.perf_counter() - t)
    print(f"4. 64x224x224x3 batches: from 2 workers via shared memory {ipc:.0f} samples/s, "
          f"gathered in the main process {64 / t_view:.0f} samples/s ({ipc and (64 / t_view) / ipc:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
