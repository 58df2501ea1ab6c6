"""A/B: every packio loader setting, timed with two packio trees in the same rounds.

Each measurement is a fresh process importing packio from tree A or tree B (PYTHONPATH),
alternating A, B per setting and round, so both trees see the same machine state. The
datasets are packed once, by tree A. Prints each setting's median samples/s and B / A.

    python tools/ab.py --a /work/main --b /work/wt-h22 --src /tmp/synth5k/images \\
        --csv /tmp/synth5k/annotations.csv --work /tmp/packio-ab --rounds 5

Run it on a quiet machine (under ``flock /tmp/packio-timing.lock``); ratios from one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import median, table

# (name, dataset file, open_dataset keywords, DataLoader keywords)
SETTINGS = [
    ("lmdb nw=0", "d.lmdb", {"resize": 224}, {"num_workers": 0}),
    ("lmdb nw=0 threads=2", "d.lmdb", {"resize": 224, "threads": 2}, {"num_workers": 0}),
    ("lmdb nw=2", "d.lmdb", {"resize": 224}, {"num_workers": 2}),
    ("tar iterable nw=0", "d.wds", {"resize": 224, "iterable": True}, {"num_workers": 0}),
    ("tar iterable nw=2", "d.wds", {"resize": 224, "iterable": True}, {"num_workers": 2}),
    ("hdf5 nw=0", "d.h5", {"resize": 224}, {"num_workers": 0}),
    ("hdf5 nw=2", "d.h5", {"resize": 224}, {"num_workers": 2}),
    ("hdf5 fixed nw=0", "f.h5", {}, {"num_workers": 0}),
    ("arrays nw=0", "d.arrays", {}, {"num_workers": 0}),
    ("arrays nw=0 threads=2", "d.arrays", {"threads": 2}, {"num_workers": 0}),
    ("arrays nw=2", "d.arrays", {}, {"num_workers": 2}),
    ("arrays iterable nw=0", "d.arrays", {"iterable": True}, {"num_workers": 0}),
]

CHILD = r"""
import json, sys, time
import packio
cfg = json.loads(sys.argv[1])
ds = packio.open_dataset(cfg["path"], **cfg["open"])
loader = packio.DataLoader(ds, batch_size=cfg["batch"], **cfg["loader"])
n, t0, start = 0, None, time.perf_counter()
while True:
    for b in loader:
        if t0 is None:  # the first batch pays for worker start-up: not timed
            t0 = time.perf_counter()
            continue
        n += len(b["key"])
        if time.perf_counter() - t0 > cfg["seconds"]:
            break
    if t0 is not None and time.perf_counter() - t0 > cfg["seconds"]:
        break
print(json.dumps({"rate": n / (time.perf_counter() - t0), "packio": packio.__file__}))
"""


def pack(tree: Path, src: Path, csv: Path | None, work: Path) -> None:
    """The datasets every setting reads, packed once with tree A's packio."""
    code = (
        "import sys, packio\n"
        "src, csv, work = sys.argv[1], sys.argv[2] or None, sys.argv[3]\n"
        "fixed = packio.ResizeSpec(size=(224, 224))\n"
        "for name, kw in (('d.lmdb', {}), ('d.wds', {}), ('d.h5', {}), ('f.h5', {'resize': fixed}),\n"
        "                 ('d.arrays', {'resize': fixed})):\n"
        "    import os\n"
        "    if not os.path.exists(f'{work}/{name}'):\n"
        "        packio.convert(src, f'{work}/{name}', csv=csv, progress=False, **kw)\n")
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", code, str(src), str(csv or ""), str(work)], check=True, cwd=work,
                   env={**os.environ, "PYTHONPATH": str(tree)})


def measure(tree: Path, cfg: dict) -> float:
    # cwd: not a tree (python -c puts the cwd first on sys.path, ahead of PYTHONPATH)
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True,
                         cwd=Path(cfg["path"]).parent,
                         env={**os.environ, "PYTHONPATH": str(tree), "PYTHONWARNINGS": "ignore"}, timeout=600)
    if out.returncode:
        print(f"  {tree}: failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}", flush=True)
        return float("nan")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if not got["packio"].startswith(str(tree)):
        raise SystemExit(f"{tree}: the child imported packio from {got['packio']}")
    return float(got["rate"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="tree A (holds packio/), e.g. /work/main")
    ap.add_argument("--b", required=True, help="tree B, e.g. this branch's worktree")
    ap.add_argument("--src", required=True, help="image folder")
    ap.add_argument("--csv", help="CSV of boxes for --src")
    ap.add_argument("--work", default="/tmp/packio-ab", help="where the packed datasets go (kept between runs)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=8.0, help="timed seconds per measurement")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--only", default="", help="comma list of substrings of setting names to run")
    a = ap.parse_args()
    trees = {"A": Path(a.a).resolve(), "B": Path(a.b).resolve()}
    work = Path(a.work)
    pack(trees["A"], Path(a.src), Path(a.csv) if a.csv else None, work)
    chosen = [s for s in SETTINGS if not a.only or any(k in s[0] for k in a.only.split(","))]
    rates: dict[tuple[str, str], list[float]] = {}
    for r in range(a.rounds):
        for name, file, open_kw, loader_kw in chosen:
            cfg = {"path": str(work / file), "open": open_kw, "loader": loader_kw, "batch": a.batch,
                   "seconds": a.seconds}
            for side in ("AB" if r % 2 == 0 else "BA"):  # alternate who goes first
                rates.setdefault((name, side), []).append(measure(trees[side], cfg))
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    rows = []
    for name, *_ in chosen:
        ma, mb = (median(rates[(name, s)]) for s in "AB")
        rows.append((name, f"{ma:.0f}", f"{mb:.0f}", f"{mb / ma:.3f}"))
    table(("setting", "A /s", "B /s", "B / A"), rows, title=f"A={trees['A']}, B={trees['B']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
