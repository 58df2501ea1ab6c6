"""Does ``packio convert --workers auto`` pick well? Times conversions with 0 (one
process), 2 and ``auto`` workers on the shared photo sets, with and without a
pre-resize, in interleaved rounds; prints medians and ratios.

    python tools/bench_workers.py                   # raccoon + hymenoptera, 3 rounds
    python tools/bench_workers.py --rounds 5 --src ../shared/data/raccoon/images
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import packio  # noqa: E402
from packio.decode import ResizeSpec  # noqa: E402


def one(src: Path, dst: Path, workers: int | str, resize: ResizeSpec | None) -> tuple[float, str]:
    shutil.rmtree(dst, ignore_errors=True)
    t = time.perf_counter()
    s = packio.convert(src, dst, workers=workers, resize=resize, progress=False)
    dt = time.perf_counter() - t
    shutil.rmtree(dst, ignore_errors=True)
    return dt, str(s.info.get("workers"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = ROOT.parent / "shared" / "data"
    ap.add_argument("--src", action="append", help="image folder (repeatable; default raccoon + hymenoptera)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", default="0,2,auto", help="settings to compare, comma-separated")
    a = ap.parse_args()
    srcs = [Path(p) for p in a.src] if a.src else [data / "raccoon" / "images", data / "hymenoptera" / "hymenoptera_data"]
    settings: list[int | str] = [w if w == "auto" else int(w) for w in a.workers.split(",")]
    cases = [(src, label, spec) for src in srcs if src.is_dir()
             for label, spec in (("as found", None), ("short side 256", ResizeSpec(short_side=256)))]
    work = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    times: dict[tuple[str, str, str], list[float]] = {}
    chosen: dict[tuple[str, str], str] = {}
    for src, _, _ in cases:  # warm the page cache: every setting reads from memory
        for p in src.rglob("*"):
            if p.is_file():
                p.read_bytes()
    for r in range(a.rounds):
        for src, label, spec in cases:
            for w in settings:
                dt, note = one(src, work / "out.lmdb", w, spec)
                times.setdefault((src.name, label, str(w)), []).append(dt)
                if w == "auto":
                    chosen[(src.name, label)] = note
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    print(f"\nconvert → LMDB, seconds (median of {a.rounds}); auto's choice; auto / best fixed setting")
    print(f"| source | images | {' | '.join(f'workers={w}' for w in settings)} | auto chose | auto / best |")
    print("|---|---|" + "---:|" * len(settings) + "---|---:|")
    for src, label, _ in cases:
        med = {str(w): statistics.median(times[(src.name, label, str(w))]) for w in settings}
        fixed = [v for k, v in med.items() if k != "auto"]
        ratio = f"{med['auto'] / min(fixed):.2f}" if "auto" in med and fixed else ""
        print(f"| {src.name} | {label} | " + " | ".join(f"{med[str(w)]:.2f}" for w in settings)
              + f" | {chosen.get((src.name, label), '')} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
