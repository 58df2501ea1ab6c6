"""W1 on original bytes (decode + resize 224, batches of 64) against the machine's
decode limit L1, in interleaved rounds, each measurement a fresh process
(``packio.bench.runner.run_child``): L1 in 1 and 2 processes, then packio LMDB
with 0 workers (1 and 2 decode threads) and 2 workers. Prints medians and
× L1 with the same cores (nw=0 no threads: 1 process; else 2).

    python tools/bench_w1.py --src /tmp/synth1k/images --csv /tmp/synth1k/annotations.csv
    python tools/bench_w1.py --path packed.lmdb --rounds 5 --settings 0/0,0/2,2/0
    python tools/bench_w1.py --path packed.lmdb --compare /tmp/old   # A/B: also packio from /tmp/old/packio

Timings on a shared machine are noisy: compare ratios from one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packio.bench.runner import run_child  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", help="a packed LMDB dataset (else packed from --src)")
    ap.add_argument("--src", help="image folder to pack first")
    ap.add_argument("--csv", help="CSV of boxes for --src")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settings", default="0/0,0/2,2/0", help="workers/threads pairs, comma-separated")
    ap.add_argument("--compare", help="a folder holding another packio/ to time in the same rounds (A/B)")
    ap.add_argument("--count", type=int, default=1000, help="images generated when neither --path nor --src")
    a = ap.parse_args()
    path = a.path
    if path is None:
        import tempfile

        import packio

        src, csv = a.src, a.csv
        if src is None:
            from packio.bench.synth import make_photo_folder

            root, csv_path = make_photo_folder(Path(tempfile.mkdtemp(prefix="bench-w1-")) / "synth", a.count)
            src, csv = str(root), str(csv_path)
        path = str(Path(src).resolve().parent / "packio-w1.lmdb")
        packio.convert(src, path, csv=csv, progress=False, overwrite=True)
    variants = {"": os.environ.get("PYTHONPATH", "")}
    if a.compare:
        variants["B "] = os.pathsep.join(p for p in (str(Path(a.compare).resolve()), variants[""]) if p)
    settings = [tuple(int(v) for v in s.split("/")) for s in a.settings.split(",")]
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    for r in range(a.rounds):
        for procs in (1, 2):
            res = run_child({"kind": "L1", "procs": procs, "path": path, "workload": "limit", "workers": 0})
            rates.setdefault(f"L1 x{procs}", []).append(res.get("rate", float("nan")))
            cpus.setdefault(f"L1 x{procs}", []).append(res.get("cpu_us", float("nan")))
        for w, t in settings:
            for tag, pythonpath in variants.items():  # A and B back to back: they see the same machine
                os.environ["PYTHONPATH"] = pythonpath
                res = run_child({"kind": "packio", "path": path, "workload": "W1", "workers": w, "threads": t,
                                 "cold": False})
                rates.setdefault(f"{tag}nw={w} threads={t}", []).append(res.get("rate", float("nan")))
                cpus.setdefault(f"{tag}nw={w} threads={t}", []).append(res.get("cpu_us", float("nan")))
            os.environ["PYTHONPATH"] = variants[""]
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()), flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    cpu = {k: statistics.median(v) for k, v in cpus.items()}
    best = max(v for k, v in med.items() if not k.startswith("L1"))
    for k, v in med.items():
        if k.startswith("L1"):
            print(f"{k:24s} {v:7.0f}/s  CPU {cpu[k]:5.0f} us/sample")
            continue
        w, t = (int(x.split("=")[1]) for x in k.split()[-2:])
        lim = med["L1 x1"] if (w == 0 and t <= 1) else med["L1 x2"]
        l1cpu = cpu["L1 x1"] if (w == 0 and t <= 1) else cpu["L1 x2"]
        print(f"{k:24s} {v:7.0f}/s  x L1(same cores) {v / lim:.3f}  x L1x2 {v / med['L1 x2']:.3f}  "
              f"x best {v / best:.3f}  CPU {cpu[k]:5.0f} us/sample (L1/this {l1cpu / cpu[k]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
