"""Read CPU per sample of packio trees side by side: ``ds[i]`` (one sample) and
``ds.__getitems__`` (batches of 64), map-style, every format, tiny and 224 px JPEGs.

Packs ``--n`` generated JPEGs per size (64 and 224 px, q90, a label and one box each)
into LMDB, ``.wds``, HDF5, arrays (pixels) and bmp with this checkout, once, then
reads them in a fresh child process per (case, tree, round) with each ``--tree``'s
``packio`` first on the path; rounds interleave the trees (order reversed every other
round). The figure is CPU time (``time.process_time``) per sample, the best of the
rounds (contention on a shared machine inflates CPU time, never deflates it), and each
tree's ratio to the first tree::

    python tools/read_cpu.py --tree . /tmp/old /work/main
    python tools/read_cpu.py --tree . --profile lmdb-64      # cProfile of one case's ds[i]

CPU time is far less load-sensitive than wall time, but take figures for claims on a
quiet machine (``flock /tmp/packio-timing.lock``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from common import ROOT, interleaved, parser, table

# case: (format suffix, stored size, read-time resize or None)
CASES = {
    "lmdb-64": (".lmdb", 64, None), "wds-64": (".wds", 64, None), "h5-64": (".h5", 64, None),
    "arrays-64": (".arrays", 64, None), "bmp-64": (".bmpdir", 64, None),
    "lmdb-224": (".lmdb", 224, None), "wds-224": (".wds", 224, None), "h5-224": (".h5", 224, None),
    "arrays-224": (".arrays", 224, None), "bmp-224": (".bmpdir", 224, None),
    "lmdb-224-resize112": (".lmdb", 224, 112),
}

CHILD = r"""
import cProfile, gc, json, pstats, sys, time
path, resize, calls, batch, profile = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
import packio, torch
torch.set_num_threads(1)
kw = {"resize": resize} if resize else {}
ds = packio.open_dataset(path, threads=1, **kw)
n = len(ds)
for i in range(min(n, 200)):
    ds[i]
def singles():
    for k in range(calls):
        ds[k % n]
if profile == "1":
    pr = cProfile.Profile(); pr.enable(); singles(); pr.disable()
    pstats.Stats(pr, stream=sys.stderr).sort_stats("tottime").print_stats(25)
gc.collect()  # a full collection the imports left pending would land in one tree's short window (~100 ms)
t = time.process_time(); singles(); one = (time.process_time() - t) / calls
starts = list(range(0, n - batch + 1, batch)) or [0]
for a in starts[:2]:  # warm the batch path too (its first batches cost more)
    ds.__getitems__(list(range(a, min(n, a + batch))))
gc.collect()
t, got = time.process_time(), 0
for r in range(max(1, calls // batch)):
    a = starts[r % len(starts)]
    got += len(ds.__getitems__(list(range(a, min(n, a + batch)))))
many = (time.process_time() - t) / got
print(json.dumps({"packio": packio.__file__, "one_us": one * 1e6, "batch_us": many * 1e6}))
"""


def make_images(work: Path, n: int, size: int) -> tuple[Path, Path]:
    """``work/src-SIZE/`` with n JPEGs (blocky noise: real JPEG work) and a CSV (label, one box)."""
    import numpy as np
    import simplejpeg

    src, csv_path = work / f"src-{size}", work / f"src-{size}.csv"
    if csv_path.exists():
        return src, csv_path
    src.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(size)
    rows = ["filename,label,class,xmin,ymin,xmax,ymax"]
    for i in range(n):
        img = rng.integers(0, 256, (size // 8, size // 8, 3), np.uint8).repeat(8, 0).repeat(8, 1)
        (src / f"img{i:06d}.jpg").write_bytes(simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=90))
        x, y = i % (size // 3), i % (size // 4)
        rows.append(f"img{i:06d}.jpg,c{i % 10},b{i % 5},{x},{y},{x + size // 2},{y + size // 2}")
    csv_path.write_text("\n".join(rows) + "\n")
    return src, csv_path


def pack(work: Path, n: int, case: str) -> Path:
    import packio
    from packio.options import ResizeSpec

    suffix, size, _ = CASES[case]
    dst = work / f"ds-{size}{suffix}"
    if not dst.exists():
        src, csv_path = make_images(work, n, size)
        kw: dict = {"resize": ResizeSpec(size=(size, size))} if suffix == ".arrays" else {}
        if suffix == ".bmpdir":
            kw = {"encode": "bmp"}
        packio.convert(src, dst, csv=csv_path, progress=False, **kw)
    return dst


def read(tree: Path, dst: Path, case: str, calls: int, profile: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    resize = CASES[case][2] or 0
    out = subprocess.run([sys.executable, "-c", CHILD, str(dst), str(resize), str(calls), "64", str(int(profile))],
                         env=env, capture_output=True, text=True, cwd="/")
    if out.returncode:
        raise SystemExit(f"{tree} {case}: child failed:\n{out.stderr[-3000:]}")
    if profile:
        print(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, rounds=5)
    ap.add_argument("--tree", type=Path, nargs="+", default=[ROOT],
                    help="packio checkouts (first: the base; default this one)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--n", type=int, default=1000, help="images per size")
    ap.add_argument("--calls", type=int, default=3000, help="ds[i] calls per measurement")
    ap.add_argument("--work", type=Path, default=Path("/tmp/packio-read-cpu"))
    ap.add_argument("--profile", choices=list(CASES), help="print a cProfile of ds[i] for this case per tree")
    a = ap.parse_args(argv)
    a.work = a.work / f"n{a.n}"  # packed once per image count, then reused
    a.work.mkdir(parents=True, exist_ok=True)
    if a.profile:
        for tree in a.tree:
            print(f"== {tree} {a.profile}")
            read(tree, pack(a.work, a.n, a.profile), a.profile, a.calls, profile=True)
        return 0
    rows = []
    for case in a.cases:
        dst = pack(a.work, a.n, case)
        runs = {str(t): (lambda t=t: read(t, dst, case, a.calls)) for t in a.tree}
        got: dict[str, list[dict]] = {k: [] for k in runs}
        interleaved({k: (lambda k=k: got[k].append(runs[k]()) or got[k][-1]["one_us"]) for k in runs},
                    a.rounds, progress=False)
        one = {k: min(r["one_us"] for r in v) for k, v in got.items()}
        many = {k: min(r["batch_us"] for r in v) for k, v in got.items()}
        base = str(a.tree[0])
        for k in runs:
            rows.append([case, k, f"{one[k]:.1f}", f"{one[k] / one[base]:.2f}", f"{many[k]:.1f}",
                         f"{many[k] / many[base]:.2f}"])
        print(f"{case} done", file=sys.stderr, flush=True)
    table(["case", "tree", "ds[i] CPU us/sample", "x first", "getitems(64) CPU us/sample", "x first"], rows,
          title=f"read CPU per sample, best of {a.rounds} rounds, {a.calls} ds[i] calls each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
