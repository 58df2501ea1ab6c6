"""What ``--check decode`` costs at pack time (figures and ratios).

    python tools/bench_check_decode.py [--src ../shared/data/hymenoptera] [--synth 400] [--rounds 3]

For each source (a real photo folder, and generated photo-like JPEGs of 400-640 px),
packs into LMDB with ``check="header"``, ``"auto"`` and ``"decode"``, both as
pass-through (the stored bytes are the input files) and pre-resized (short side 224,
re-encoded), single process, interleaved rounds, median. Also the per-image cost of the
pass-through check: a strict decode at 1/8 scale against a full-size decode.

A strict decode is on by default only where it costs under 15 % of pack time.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import packio  # noqa: E402
from packio import decode as dec  # noqa: E402


def synth(root: Path, n: int) -> Path:
    import simplejpeg

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import photo

    rng = np.random.default_rng(0)
    (root / "c").mkdir(parents=True)
    for k in range(n):
        h, w = int(rng.integers(300, 480)), int(rng.integers(400, 640))
        (root / "c" / f"{k:05d}.jpg").write_bytes(simplejpeg.encode_jpeg(photo(h, w, k), 90, colorsubsampling="420"))
    return root


def pack_seconds(src: Path, dst: Path, check: str, resize: packio.ResizeSpec | None) -> float:
    if dst.exists():
        shutil.rmtree(dst)
    t = time.perf_counter()
    packio.convert(src, dst, check=check, resize=resize, progress=False, workers=0)
    return time.perf_counter() - t


def per_image(fns: dict, blobs: list[bytes], rounds: int) -> dict[str, float]:
    """Median seconds per image of each function, interleaved over rounds."""
    got: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for b in blobs:
                fn(b)
            got[name].append((time.perf_counter() - t) / len(blobs))
    return {name: statistics.median(v) for name, v in got.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "hymenoptera"))
    ap.add_argument("--synth", type=int, default=400, help="generated JPEGs (0: none)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    import cv2

    cv2.setNumThreads(1)
    with tempfile.TemporaryDirectory() as tmp:
        sources = {}
        if Path(a.src).is_dir():
            sources[Path(a.src).name] = Path(a.src)
        if a.synth:
            sources[f"synth-{a.synth}"] = synth(Path(tmp) / "synth", a.synth)
        for name, src in sources.items():
            blobs = [p.read_bytes() for p in sorted(src.rglob("*")) if p.is_file() and p.suffix.lower() in
                     (".jpg", ".jpeg")]
            t = per_image({"full": lambda b: dec.decode(b), "eighth": dec.check_decode}, blobs, 2 * a.rounds + 1)
            full, eighth = t["full"], t["eighth"]
            print(f"{name}: {len(blobs)} JPEGs, {sum(map(len, blobs)) / len(blobs) / 1e3:.0f} KB mean")
            print(f"  strict decode at 1/8 (the check) {eighth * 1e3:.2f} ms/img; full decode {full * 1e3:.2f} "
                  f"ms/img; ratio {eighth / full:.2f}")
            for label, resize in (("pass-through", None), ("short side 224", packio.ResizeSpec(short_side=224))):
                times: dict[str, list[float]] = {"header": [], "auto": [], "decode": []}
                pack_seconds(src, Path(tmp) / "warm.lmdb", "header", resize)  # page cache, imports
                for _ in range(a.rounds):
                    for check in times:
                        times[check].append(pack_seconds(src, Path(tmp) / "o.lmdb", check, resize))
                med = {k: statistics.median(v) for k, v in times.items()}
                h = med["header"]
                print(f"  pack {label}: " + ", ".join(f"check={k} {v:.2f} s ({100 * (v - h) / h:+.0f} %)"
                                                       for k, v in med.items()) + " vs header")
    return 0


if __name__ == "__main__":
    sys.exit(main())
