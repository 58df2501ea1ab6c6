"""W2 (pre-resized uint8 arrays) against the memcpy limit L2, interleaved rounds:

    python tools/bench_w2.py [--path DATA.arrays] [--rounds 3] [--seconds 2]

L2: per-sample ``np.copyto`` out of ``np.load(images.npy, mmap_mode="r")`` in one process
(the peers harness' L2). packio: ``packio.DataLoader(ArrayDataset, batch_size=64)`` with
num_workers 0 and 2 (2: two threads share each copy), shuffled or not; items: torch's DataLoader over the same dataset
with ``packio.collate`` (per-sample items of one gathered block). Each consumer touches
the batch's labels and boxes as the peers harness does (boxes padded to [B, 8, 4]).
Without ``--path`` a synthetic 2,000-sample 224x224 dataset is packed first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import packio

BATCH, SIZE = 64, 224


def pad(boxes: list[torch.Tensor]) -> torch.Tensor:
    out = torch.full((len(boxes), 8, 4), -1.0)
    for j, b in enumerate(boxes):
        k = min(len(b), 8)
        if k:
            out[j, :k] = b[:k]
    return out


def rate(epoch: Callable[[], int], seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += epoch()
    return n / (time.perf_counter() - t0)


PAD = [True]  # --no-pad: time packio alone, without the consumer's per-sample box padding


def loader_epoch(loader: Any) -> Callable[[], int]:
    def run() -> int:
        n = 0
        for b in loader:
            if PAD[0]:
                pad(b["boxes"])
            n += len(b["label"])
        return n
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", help="a packed .arrays dataset (default: a generated one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--no-pad", action="store_true",
                    help="consumers skip the harness-style box padding (a Python loop per sample)")
    a = ap.parse_args()
    PAD[0] = not a.no_pad
    tmp = None
    if a.path is None:
        from packio.bench.synth import make_photo_folder

        tmp = tempfile.TemporaryDirectory(prefix="packio-w2-")
        src, csv = make_photo_folder(Path(tmp.name) / "src", 2000, size=(240, 320))
        a.path = str(Path(tmp.name) / "d.arrays")
        packio.convert(src, a.path, csv=csv, resize=packio.ResizeSpec(size=(SIZE, SIZE)), progress=False)
    arr = np.load(Path(a.path) / "images.npy", mmap_mode="r")
    one = np.empty(arr.shape[1:], np.uint8)

    def l2() -> int:
        for i in range(len(arr)):
            np.copyto(one, arr[i])
        return len(arr)

    flat, block = np.asarray(arr), np.empty((BATCH, *arr.shape[1:]), np.uint8)
    starts = range(0, len(arr) - BATCH + 1, BATCH)
    runs_of = [np.arange(s, s + BATCH) for s in starts]

    def memcpy_runs() -> int:  # sequential batches, one memcpy each
        for s in starts:
            np.copyto(block, flat[s:s + BATCH])
        return len(starts) * BATCH

    def take_runs() -> int:  # the same batches with np.take (what packio does)
        for idx in runs_of:
            np.take(flat, idx, axis=0, out=block, mode="clip")
        return len(starts) * BATCH

    ds = packio.open_dataset(a.path)
    runs: dict[str, Callable[[], int]] = {"L2": l2, "copy batch: memcpy": memcpy_runs, "copy batch: np.take": take_runs}
    for shuffle in (False, True):
        for nw in (0, 2):
            loader = packio.DataLoader(ds, batch_size=BATCH, shuffle=shuffle, num_workers=nw)
            runs[f"packio nw={nw} shuffle={shuffle}"] = loader_epoch(loader)
        items = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=shuffle, collate_fn=packio.collate)
        runs[f"items nw=0 shuffle={shuffle}"] = loader_epoch(items)
    got: dict[str, list[float]] = {k: [] for k in runs}
    for run in runs.values():  # warm-up: page cache, this process' page tables
        run()
    for r in range(a.rounds):
        for name, run in runs.items():
            got[name].append(rate(run, a.seconds))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in got.items()), flush=True)
    l2_rate = statistics.median(got["L2"])
    print(f"\n{len(arr)} samples of {arr.shape[1:]} uint8; medians of {a.rounds} interleaved rounds:")
    for name, v in got.items():
        print(f"  {name:28s} {statistics.median(v):8.0f} samples/s  {statistics.median(v) / l2_rate:.2f} x L2")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
