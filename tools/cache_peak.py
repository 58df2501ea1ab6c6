"""The remote cache's peak on disk ÷ its limit under concurrency (issue 38), measured from
outside: a thread of this script sums every file under the cache folder (partial
downloads and the journal included) every 2 ms, never packio's own counters.

    python tools/cache_peak.py                      # this tree
    python tools/cache_peak.py --tree /work/main    # another packio tree, e.g. before a change

Self-contained: two datasets of noise JPEGs (shards of 4, about 200 KB each) packed here,
and 12 foreign tar shards of the shared raccoon photos (0.8-1.6 MB each), served over
HTTP by the test server (tests/servers.py) in a process of its own. The children run
outside this checkout with ``PYTHONPATH=TREE`` and say which packio they imported.

- ``mix``: two processes at once, each mixing the two URL ``.wds`` sources (window 2, the
  default prefetch of 2) with 2 DataLoader workers, one ``cache_dir``; the limit holds
  what is read at once (8 readers x 5 shards) and a fifth more.
- ``foreign``: one process opens the 12 foreign shards at a URL (8 download threads);
  the limit is 3 of the largest shard.

Prints, per case, the peak ÷ limit (largest and median over ``--rounds``), the peak over
the limit in shards, and what is left ÷ limit once every process is done. Packio's own
bound: the limit plus one file in flight per downloader. The race this measures shows
most on a busy machine: compare trees in one run, and say how busy the machine was.
"""

from __future__ import annotations

import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DATA, ROOT, need, parser, table  # noqa: E402

MIX = r"""
import sys
import packio
a, b, cache, limit = sys.argv[1:5]
sources = [packio.open_dataset(u, iterable=True, cache_dir=cache, cache_limit=int(limit), decode=False)
           for u in (a, b)]
mixed = packio.mix(sources, window=2, seed=int(sys.argv[5]))
print(sum(len(batch["key"]) for batch in packio.DataLoader(mixed, batch_size=8, num_workers=2)), packio.__file__)
"""

FOREIGN = r"""
import sys
import packio
ds = packio.open_dataset(sys.argv[1], cache_dir=sys.argv[2], cache_limit=int(sys.argv[3]), decode=False)
print(len(ds), packio.__file__)
"""


def _noise(n: int, seed: int, side: int) -> list[bytes]:
    import numpy as np
    import simplejpeg

    rng = np.random.default_rng(seed)
    return [simplejpeg.encode_jpeg(rng.integers(0, 256, (side, side, 3), np.uint8), 90) for _ in range(n)]


def make_data(www: Path) -> dict[str, int]:
    """``a.wds``, ``b.wds`` (200 samples, 4 per shard: about 200 KB) and ``theirs/`` (12 foreign
    shards of 16 samples: about 2.4 MB) under ``www``; the largest shard's bytes of each kind."""
    import packio

    for k, name in enumerate(("a", "b")):
        folder = www / f"src-{name}" / "c"
        folder.mkdir(parents=True)
        for i, data in enumerate(_noise(200, k, 160)):
            (folder / f"{name}{i:03d}.jpg").write_bytes(data)
        packio.convert(folder.parent, www / f"{name}.wds", shard_samples=4, progress=False)
    (www / "theirs").mkdir()
    photos = sorted((DATA / "raccoon" / "images").glob("*.jpg"))
    need(photos, "raccoon photos", f"the shared photo sets belong in {DATA} (see its README)")
    for s in range(12):
        with tarfile.open(www / "theirs" / f"shard-{s:06d}.tar", "w") as tf:
            for j, path in enumerate(photos[s::12]):
                for ext, data in (("cls", str(j % 3).encode()), ("jpg", path.read_bytes())):
                    info = tarfile.TarInfo(f"s{s}-{j}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    return {"wds": max(p.stat().st_size for p in www.glob("*.wds/shard-*.tar")),
            "foreign": max(p.stat().st_size for p in (www / "theirs").iterdir())}


def _usage(root: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def sampled(root: Path, commands: list[list[str]], env: dict[str, str]) -> tuple[int, int, list[str]]:
    """Run ``commands`` at once while sampling the folder; (peak bytes, bytes left, outputs)."""
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            peak[0] = max(peak[0], _usage(root))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                  cwd=root.parent)  # not this checkout: "-c" imports packio from its folder first
                 for c in commands]
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        stop.set()
        thread.join()
    bad = [err.strip().splitlines()[-1:] for p, (_, err) in zip(procs, outs) if p.returncode]
    if bad:
        raise SystemExit(f"a child failed: {bad}")
    left = _usage(root)
    return max(peak[0], left), left, [out.strip() for out, _ in outs]


def _check(outs: list[str], case: str, tree: Path) -> None:
    """Each child read what it should, with the packio of ``tree``."""
    want = {"mix": "400", "foreign": "200"}[case]
    for out in outs:
        count, _, where = out.partition(" ")
        if count != want or not Path(where).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"{case}: a child read {count} samples (not {want}) with {where}")


def one_round(case: str, url: str, sizes: dict[str, int], work: Path, tree: Path, r: int) -> dict[str, Any]:
    cache = work / f"cache-{case}-{r}"
    if case == "mix":
        shard, limit = sizes["wds"], int(8 * 5 * sizes["wds"] * 1.2)
        cmd = [sys.executable, "-c", MIX, f"{url}/a.wds", f"{url}/b.wds", str(cache), str(limit)]
        commands = [cmd + [str(r * 2)], cmd + [str(r * 2 + 1)]]
    else:
        shard, limit = sizes["foreign"], 3 * sizes["foreign"]
        commands = [[sys.executable, "-c", FOREIGN, f"{url}/theirs/shard-{{000000..000011}}.tar", str(cache),
                     str(limit)]]
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "PYTHONWARNINGS": "ignore"}
    peak, left, outs = sampled(cache, commands, env)
    _check(outs, case, tree)
    shutil.rmtree(cache, ignore_errors=True)
    return {"peak": peak / limit, "over": (peak - limit) / shard, "left": left / limit}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, rounds=3)
    ap.add_argument("--tree", type=Path, default=ROOT, help="the packio tree the children import (default: this)")
    ap.add_argument("--cases", nargs="+", default=["mix", "foreign"], choices=["mix", "foreign"])
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="packio-cache-peak-") as tmp:
        work = Path(tmp)
        sizes = make_data(work / "www")
        server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "servers.py"), "http", str(work / "www")],
                                  stdout=subprocess.PIPE, text=True)  # the test server, in a process of its own
        try:
            url = server.stdout.readline().strip()
            rows = []
            for case in args.cases:
                got = [one_round(case, url, sizes, work, args.tree, r) for r in range(args.rounds)]
                print(f"{case}: " + "; ".join(f"peak {g['peak']:.2f}x, left {g['left']:.2f}x" for g in got),
                      flush=True)
                rows.append([case, f"{max(g['peak'] for g in got):.2f}",
                             f"{statistics.median(g['peak'] for g in got):.2f}",
                             f"{max(g['over'] for g in got):.1f}", f"{max(g['left'] for g in got):.2f}"])
        finally:
            server.terminate()
            server.wait(10)
    table(["case", "peak ÷ limit (max)", "peak ÷ limit (median)", "over the limit, shards (max)",
           "left ÷ limit (max)"], rows, title=f"cache peak, packio from {args.tree.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
