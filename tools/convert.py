"""Packing costs (``python tools/convert.py COMMAND --help``).

    workers  does ``convert --workers auto`` pick well? 0, 2 and auto workers on the shared photo sets
    check    what ``--check decode`` costs at pack time vs ``header`` and ``auto``
    dask     single process vs local pool vs a Dask LocalCluster, per format
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DATA, interleaved, median, need, parser, subcommands, table  # noqa: E402


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _pack_seconds(src: Path, dst: Path, **kw: Any) -> tuple[float, Any]:
    """Seconds to pack ``src`` into a fresh ``dst`` (removed before and after), and the summary."""
    import packio

    _remove(dst)
    t = time.perf_counter()
    s = packio.convert(src, dst, progress=False, **kw)
    dt = time.perf_counter() - t
    _remove(dst)
    return dt, s


def _warm(src: Path) -> None:
    for p in src.rglob("*"):
        if p.is_file():
            p.read_bytes()


def workers(argv: list[str]) -> int:
    """Does ``packio convert --workers auto`` pick well? Times conversions to LMDB with 0
    (one process), 2 and ``auto`` workers, as found and pre-resized (short side 256), in
    interleaved rounds; prints medians, auto's choice and auto / best fixed setting.

        python tools/convert.py workers                  # raccoon + hymenoptera from ../shared/data
        python tools/convert.py workers --src DIR --rounds 5
    """
    ap = parser(workers.__doc__)
    ap.add_argument("--src", action="append", help="image folder (repeatable; default raccoon + hymenoptera)")
    ap.add_argument("--workers", default="0,2,auto", help="settings to compare, comma-separated")
    a = ap.parse_args(argv)
    from packio.decode import ResizeSpec

    srcs = [Path(p) for p in a.src] if a.src else [DATA / "raccoon" / "images",
                                                   DATA / "hymenoptera" / "hymenoptera_data"]
    found = [s for s in srcs if s.is_dir()]
    need(found, "image folder (looked for " + ", ".join(map(str, srcs)) + ")", "pass one with --src DIR")
    settings: list[int | str] = [w if w == "auto" else int(w) for w in a.workers.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    chosen: dict[str, str] = {}
    cases = {}
    for src in found:
        _warm(src)  # every setting reads from the page cache
        for label, spec in (("as found", None), ("short side 256", ResizeSpec(short_side=256))):
            for w in settings:
                def run(src: Path = src, spec: Any = spec, w: Any = w, key: str = f"{src.name}|{label}") -> float:
                    dt, s = _pack_seconds(src, work / "out.lmdb", workers=w, resize=spec)
                    if w == "auto":
                        chosen[key] = str(s.info.get("workers"))
                    return dt
                cases[f"{src.name}|{label}|{w}"] = run
    got = interleaved(cases, a.rounds)
    shutil.rmtree(work, ignore_errors=True)
    rows = []
    for key in dict.fromkeys(k.rsplit("|", 1)[0] for k in got):
        med = {str(w): median(got[f"{key}|{w}"]) for w in settings}
        fixed = [v for k, v in med.items() if k != "auto"]
        ratio = f"{med['auto'] / min(fixed):.2f}" if "auto" in med and fixed else ""
        rows.append((*key.split("|"), *(f"{med[str(w)]:.2f}" for w in settings), chosen.get(key, ""), ratio))
    table(("source", "images", *(f"workers={w} s" for w in settings), "auto chose", "auto / best"), rows,
          f"convert → LMDB, seconds (median of {a.rounds})")
    return 0


def _synth(root: Path, n: int) -> Path:
    """``n`` generated photo-like JPEGs of 400-640 px, q90 4:2:0."""
    import numpy as np
    import simplejpeg

    from packio.bench.synth import photo

    rng = np.random.default_rng(0)
    (root / "c").mkdir(parents=True)
    for k in range(n):
        h, w = int(rng.integers(300, 480)), int(rng.integers(400, 640))
        (root / "c" / f"{k:05d}.jpg").write_bytes(simplejpeg.encode_jpeg(photo(h, w, rng), 90,
                                                                         colorsubsampling="420"))
    return root


def _check_one(name: str, src: Path, tmp: Path, rounds: int) -> None:
    import packio
    from packio import decode as dec

    blobs = [p.read_bytes() for p in sorted(src.rglob("*")) if p.is_file() and p.suffix.lower() in (".jpg", ".jpeg")]
    per = interleaved({"full decode": lambda: _each(dec.decode, blobs),
                       "strict decode at 1/8": lambda: _each(dec.check_decode, blobs)}, 2 * rounds + 1, False)
    full, eighth = median(per["full decode"]), median(per["strict decode at 1/8"])
    rows = [("per image (ms)", f"{eighth * 1e3:.2f} (1/8 strict)", f"{full * 1e3:.2f} (full decode)", "",
             f"{eighth / full:.2f}")]
    for label, resize in (("pass-through", None), ("short side 224", packio.ResizeSpec(short_side=224))):
        _pack_seconds(src, tmp / "warm.lmdb", check="header", resize=resize, workers=0)  # page cache, imports
        got = interleaved({c: (lambda c=c: _pack_seconds(src, tmp / "o.lmdb", check=c, resize=resize, workers=0)[0])
                           for c in ("header", "auto", "decode")}, rounds, False)
        m = {k: median(v) for k, v in got.items()}
        rows.append((f"pack {label} (s)", *(f"{m[c]:.2f} ({100 * (m[c] - m['header']) / m['header']:+.0f} %)"
                                            for c in ("header", "auto", "decode")), ""))
    table(("", "check=header", "check=auto", "check=decode", "1/8 ÷ full"), rows,
          f"{name}: {len(blobs)} JPEGs, {sum(map(len, blobs)) / len(blobs) / 1e3:.0f} KB mean")


def _each(fn: Any, blobs: list[bytes]) -> float:
    t = time.perf_counter()
    for b in blobs:
        fn(b)
    return (time.perf_counter() - t) / len(blobs)


def check(argv: list[str]) -> int:
    """What ``--check decode`` costs at pack time: LMDB packs with check ``header``, ``auto``
    and ``decode``, pass-through and pre-resized (short side 224), single process; and the
    per-image cost of the strict 1/8-scale decode against a full decode. A strict decode is
    on by default only where it costs under 15 % of pack time."""
    ap = parser(check.__doc__)
    ap.add_argument("--src", default=str(DATA / "hymenoptera"))
    ap.add_argument("--synth", type=int, default=400, help="generated JPEGs (0: none)")
    a = ap.parse_args(argv)
    import cv2

    cv2.setNumThreads(1)
    with tempfile.TemporaryDirectory() as tmp:
        sources = {Path(a.src).name: Path(a.src)} if Path(a.src).is_dir() else {}
        if a.synth:
            sources[f"synth-{a.synth}"] = _synth(Path(tmp) / "synth", a.synth)
        need(list(sources), "source", f"{a.src} is absent: pass --src DIR or --synth N")
        for name, src in sources.items():
            _check_one(name, src, Path(tmp), a.rounds)
    return 0


def dask(argv: list[str]) -> int:
    """Conversion seconds per format: single process, local pool (--workers) and a Dask
    LocalCluster (one thread per worker process). On 2 cores the point is correctness and
    the path to a real cluster, not speed."""
    ap = parser(dask.__doc__)
    ap.add_argument("--src", default=str(DATA / "hymenoptera" / "hymenoptera_data"))
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args(argv)
    need([a.src] if Path(a.src).is_dir() else [], f"image folder at {a.src}", "pass one with --src DIR")
    from dask.distributed import Client, LocalCluster

    import packio

    src, out = Path(a.src), Path(tempfile.mkdtemp())
    formats = {".lmdb": {}, ".h5": {}, ".wds": {}, ".arrays": {"resize": packio.ResizeSpec(size=(224, 224))}}
    rows = []
    with LocalCluster(n_workers=a.workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                      silence_logs=40) as cluster, Client(cluster) as client:
        client.run(lambda: __import__("packio.pack"))  # warm the workers' imports
        for suffix, kw in formats.items():
            modes = {"single": {}, "pool": {"workers": a.workers}, "dask": {"scheduler": client}}
            got = interleaved({m: (lambda m=m, x=x: _warm(src) or _pack_seconds(src, out / f"{m}{suffix}",
                                                                                 **kw, **x)[0])
                               for m, x in modes.items()}, a.rounds, False)
            med = {k: median(v) for k, v in got.items()}
            rows.append((suffix, *(f"{med[m]:.2f}" for m in modes), f"{med['dask'] / med['single']:.2f}"))
    shutil.rmtree(out, ignore_errors=True)
    table(("format", "single process s", "local pool s", "Dask LocalCluster s", "Dask / single"), rows,
          f"source {src}; {a.workers} workers; median of {a.rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(subcommands({"workers": workers, "check": check, "dask": dask}, __doc__))
