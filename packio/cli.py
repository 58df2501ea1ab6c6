"""Command line: a thin layer over convert / info / verify / bench."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def _hw(text: str) -> tuple[int, int]:
    h, sep, w = text.lower().partition("x")
    try:
        return (int(h), int(w)) if sep else (int(h), int(h))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxW like 224x224 (or one number), got {text!r}") from None


def _cmd_convert(a: argparse.Namespace) -> int:
    from packio.converter import convert
    from packio.decode import ResizeSpec
    from packio.sources import parse_columns

    try:
        spec = ResizeSpec(size=a.size, short_side=a.short_side, crop=a.crop)
    except ValueError as exc:
        raise SystemExit(f"packio: error: {exc}") from None
    summary = convert(a.src, a.dst, format=a.format, csv=a.csv, columns=parse_columns(a.csv_columns),
                      workers=a.workers, strict=a.strict, resize=spec, quality=a.quality,
                      overwrite=a.overwrite, shard_samples=a.shard_samples, shard_bytes=a.shard_bytes,
                      progress=False if a.quiet else None, scheduler=a.scheduler, parts=a.parts,
                      follow_symlinks=a.follow_symlinks)
    shown = summary.problems if a.verbose else summary.problems[:20]
    for line in shown:
        print(f"skipped: {line}", file=sys.stderr)
    if len(summary.problems) > len(shown):
        print(f"... and {len(summary.problems) - len(shown)} more (--verbose lists all)", file=sys.stderr)
    print(summary.text())
    return 0


def _cmd_info(a: argparse.Namespace) -> int:
    from pathlib import Path

    from packio.formats import open_reader

    reader = open_reader(a.path)
    m = reader.manifest
    if a.json:
        print(json.dumps({"path": a.path, **json.loads(m.to_json())}, indent=1))
        return 0
    p = Path(a.path)
    size = p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    print(f"path:     {a.path}")
    print(f"format:   {m.format} (layout version {m.version})")
    print(f"samples:  {m.count}")
    print(f"bytes:    {size} ({size / 1e6:.1f} MB on disk)")
    print(f"classes:  {len(m.classes)}: {', '.join(m.classes[:20])}{' ...' if len(m.classes) > 20 else ''}")
    print(f"images:   {json.dumps(m.image)}")
    print(f"source:   {m.source.get('path')}" + (f" + {m.source['csv']}" if m.source.get("csv") else ""))
    print(f"skipped:  {json.dumps(m.summary.get('skipped', {}))}")
    print(f"files:    {len(m.files)} listed with checksums")
    return 0


def _cmd_verify(a: argparse.Namespace) -> int:
    from packio.verifier import verify

    report = verify(a.path)
    print(report.text())
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="packio", description="Pack image datasets once; read them fast.")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("convert", help="pack an image folder (+ CSV) or a packed dataset into a format",
                       description="Pack SRC into DST. The format comes from DST's suffix "
                                   "(.lmdb .h5 .tar .bmp .npy) or --format.")
    c.add_argument("src", help="image folder (class sub-folders or flat), or a packed dataset")
    c.add_argument("dst", help="output path; its suffix picks the format")
    c.add_argument("--format", help="lmdb, hdf5, tar, bmp or arrays (default: from DST's suffix)")
    c.add_argument("--csv", help="CSV of annotation rows (filename,class,xmin,ymin,xmax,ymax,...)")
    c.add_argument("--csv-columns", metavar="MAP",
                   help="map fields to your CSV's columns, e.g. filename=path,class=cell_type")
    c.add_argument("--workers", type=int, default=0, help="local processes reading/checking inputs (default 0)")
    c.add_argument("--scheduler", metavar="ADDR",
                   help="Dask scheduler (tcp://host:8786): pack partitions as parts on the cluster (packio[dask])")
    c.add_argument("--parts", type=int, help="with --scheduler: number of parts (default 4 per Dask worker)")
    c.add_argument("--strict", action="store_true", help="fail on any skipped input instead of counting it")
    c.add_argument("--size", type=_hw, metavar="HxW", help="pre-resize every image to HxW")
    c.add_argument("--short-side", type=int, metavar="N", help="pre-resize so the short side is N (keeps aspect)")
    c.add_argument("--crop", type=_hw, metavar="HxW", help="center-crop to HxW after resizing")
    c.add_argument("--quality", type=int, default=90, help="JPEG quality when re-encoding resized images")
    c.add_argument("--overwrite", action="store_true", help="replace DST if it is a packio dataset (atomically)")
    c.add_argument("--follow-symlinks", action="store_true",
                   help="follow symlinks in SRC leading outside it, and symlinked folders (default: skipped, counted)")
    c.add_argument("--shard-samples", type=int, default=10_000, help="tar: samples per shard")
    c.add_argument("--shard-bytes", type=int, default=1 << 30, help="tar: bytes per shard")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--verbose", action="store_true", help="list every skipped input")
    c.set_defaults(fn=_cmd_convert)

    i = sub.add_parser("info", help="show what a packed dataset holds")
    i.add_argument("path")
    i.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    i.set_defaults(fn=_cmd_info)

    v = sub.add_parser("verify", help="re-read everything and check checksums (exit 1 when damaged)")
    v.add_argument("path")
    v.set_defaults(fn=_cmd_verify)

    sub.add_parser("bench", help="compare formats on one dataset; 'packio bench --help' for its options")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser: argparse's REMAINDER drops leading options
        from packio.bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    from packio.errors import PackioError

    try:
        return args.fn(args)
    except PackioError as exc:
        print(f"packio: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("packio: interrupted; no output was committed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
