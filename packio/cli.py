"""Command line: a thin layer over convert / info / verify / show / doctor / bench."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import sys
from typing import Any, Callable, Iterator, NoReturn, Sequence

MAX_SIDE = 16384  # pixels: the largest --size / --short-side / --crop side accepted
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, ``packio: error: ...``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"packio: error: {message} (see '{self.prog} --help')\n")


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer from {lo} to {hi}, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is out of range: give an integer from {lo} to {hi}")
        return v

    return parse


def _float_in(lo: float, hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = float("nan")
        if not lo <= v <= hi:  # nan and inf fail here too
            raise argparse.ArgumentTypeError(f"expected a number from {lo:g} to {hi:g}, got {text!r}")
        return v

    return parse


def _workers(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return _int_in(0, 1024)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer from 0 to 1024, got {text!r}") from None


def _bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)i?b?\s*", text.lower())
    v = int(m[1]) * _UNITS[m[2]] if m else 0
    if not m or not 1 << 20 <= v <= 1 << 50:
        raise argparse.ArgumentTypeError(f"expected a size from 1M to 1024T, like 512M or 1G, got {text!r}")
    return v

__all__ = ["build_parser", "main"]


def _parse_hw(text: str) -> tuple[int, int]:
    h, sep, w = text.lower().partition("x")
    side = _int_in(1, MAX_SIDE)
    try:
        return (side(h), side(w)) if sep else (side(h), side(h))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected HxW like 224x224 (or one number), each side an integer "
                                         f"from 1 to {MAX_SIDE}, got {text!r}") from None


def _address(text: str) -> str:
    if not re.fullmatch(r"(?:(?:tcp|tls|ucx|inproc|ws|wss)://)?(?:\[[0-9A-Fa-f:]+\]|[\w.-]+):\d{1,5}", text):
        raise argparse.ArgumentTypeError(f"expected a Dask scheduler address like tcp://host:8786, got {text!r}")
    return text


def _cmd_convert(a: argparse.Namespace) -> int:
    from packio.api import convert
    from packio.decode import ResizeSpec
    from packio.options import PackOptions
    from packio.sources import parse_columns

    try:
        resize = ResizeSpec(size=a.size, short_side=a.short_side, crop=a.crop)
    except ValueError as exc:
        raise SystemExit(f"packio: error: {exc}") from None
    options = PackOptions(format=a.format, resize=resize, encode=a.encode, quality=a.quality, check=a.check,
                          shards=a.shards, shard_samples=a.shard_samples, shard_bytes=a.shard_bytes)
    columns = parse_columns(a.csv_columns)
    if a.label_column:
        columns["label"] = a.label_column
    summary = convert(a.src, a.dst, options=options, csv=a.csv, columns=columns, workers=a.workers,
                      strict=a.strict, overwrite=a.overwrite, progress=False if a.quiet else None,
                      scheduler=a.scheduler, parts=a.parts, follow_symlinks=a.follow_symlinks, append=a.append)
    shown = summary.problems if a.verbose else summary.problems[:20]
    for line in shown:
        print(f"skipped: {line}", file=sys.stderr)
    if len(summary.problems) > len(shown):
        print(f"... and {len(summary.problems) - len(shown)} more (--verbose lists all)", file=sys.stderr)
    if a.quiet:  # one line; what needs attention still said, on stderr
        print(summary.line())
        for line in summary.warnings():
            kind, _, text = line.partition(":")
            print(f"packio: {kind}: {text.strip()}", file=sys.stderr)
    else:
        print(summary.text())
    return 0


def _printable(text: str) -> str:
    """``text`` with the characters a terminal would act on (escapes, control and format
    characters, as a hostile manifest's names may hold) written as Python escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _boxes_counted(m: Any) -> bool:
    """Does the manifest's annotation summary count boxes (its census line then says so)?"""
    a = m.summary.get("annotations")
    return isinstance(a, dict) and bool(a.get("boxes"))


def _cmd_info(a: argparse.Namespace) -> int:
    from packio.api import describe
    from packio.errors import is_url, redact
    from packio.manifest import count_text
    from packio.pack.report import describe_history, describe_output

    m, size, where = describe(a.path)
    if a.json:
        print(json.dumps({"path": a.path, **json.loads(m.to_json())}, indent=1))
        return 0
    say = lambda text: print(_printable(text))  # noqa: E731  (stored names may hold terminal escapes)
    say(f"path:     {a.path}")
    say(f"format:   {m.format} (layout version {m.version})")
    say(f"samples:  {count_text(m.count)}")
    say(f"bytes:    {size} ({size / 1e6:.1f} MB {'stored' if is_url(a.path) else 'on disk'})")
    parts = m.extra.get("parts")
    if isinstance(parts, list) and all(isinstance(x, dict) for x in parts):
        listed = [f"{x.get('path')} ({count_text(x.get('count'))} samples)" for x in parts[:20]]
        say(f"parts:    {len(parts)}: {', '.join(listed)}{' ...' if len(parts) > 20 else ''}")
    say(f"classes:  {len(m.classes)}: {', '.join(m.classes[:20])}{' ...' if len(m.classes) > 20 else ''}"
        if m.classes else "classes:  none (no image labels)")
    if m.box_classes:
        bc = m.box_classes
        say(f"boxes:    {len(bc)} classes: {', '.join(bc[:20])}{' ...' if len(bc) > 20 else ''}")
    elif not _boxes_counted(m):  # a dataset without boxes (said once: the census line gives boxes without classes)
        say("boxes:    none")
    for line in describe_output(redact(where), m):  # where the files lie: a folder, or the URL they are served at
        say(line)
    shape = m.image.get("shape")
    say(f"shape:    {'x'.join(map(str, shape)) if shape else 'as found (varies per image)'}")
    say(f"source:   {m.source.get('path')}" + (f" + {m.source['csv']}" if m.source.get("csv") else ""))
    for i, line in enumerate(describe_history(m)):
        say(f"{'history:' if i == 0 else '':9s} {line}")
    from packio.census import describe as describe_annotations

    for line in describe_annotations(m):
        say(line)
    say(f"skipped:  {_skipped_text(m.summary.get('skipped'))}")
    say(_checksums_text(m))
    return 0


def _skipped_text(skipped: Any) -> str:
    """``3 (corrupt image data 2, unsupported image type (gif) 1)``, or ``none``."""
    from packio.manifest import count_text

    if not isinstance(skipped, dict) or not skipped:
        return "none" if skipped in (None, {}) else "invalid"
    ok = [n for n in skipped.values() if count_text(n) != "invalid"]
    listed = ", ".join(f"{why} {count_text(n)}" for why, n in list(skipped.items())[:20])
    return f"{count_text(sum(ok))} ({listed}{' ...' if len(skipped) > 20 else ''})"


def _checksums_text(m: Any) -> str:
    """What the checksums cover: the files the manifest lists, or (one file, which cannot list
    its own checksum) every sample's record and the arrays the manifest holds digests of."""
    digests = m.extra.get("digests")
    if m.files or not isinstance(digests, dict):
        return f"files:    {len(m.files)} listed with checksums"
    return (f"files:    one, holding every checksum (a file cannot list its own): each sample's, and the digests "
            f"of its {len(digests)} arrays ({', '.join(map(str, list(digests)[:10]))}); 'packio verify' checks them")


def _cmd_verify(a: argparse.Namespace) -> int:
    from packio.api import verify

    report = verify(a.path)
    print(report.text())
    return 0 if report.ok else 1


def _cmd_doctor(a: argparse.Namespace) -> int:
    import packio.doctor.report as doctor_report
    from packio.doctor.offline import diagnose

    d = diagnose(a.path, size=a.size, batch_size=a.batch_size, seconds=a.seconds, fraction=a.sample,
                 min_samples=a.min_samples, max_samples=a.max_samples, step_ms=a.step_ms,
                 gpu_decode_ms=a.gpu_decode_ms, csv=a.csv, csv_columns=a.csv_columns, work=a.work, keep=a.keep,
                 cgroup_root=a.cgroup_root, cpus=a.cpus,
                 log=None if a.quiet else lambda m: print(m, file=sys.stderr, flush=True))
    print(doctor_report.text(d))
    if a.report:
        md, png = doctor_report.write(d, a.report)
        print(f"report: {md}" + (f", {png}" if png else " (no PNG: pip install 'packio[bench]' for matplotlib)"))
    return 0


def _resize_arg(text: str) -> int | tuple[int, int]:
    h, w = _parse_hw(text)
    return h if "x" not in text.lower() else (h, w)


def _cmd_show(a: argparse.Namespace) -> int:
    from packio.preview import show

    out = show(a.path, a.index, a.output, resize=a.resize, count=a.count, cell=a.cell)
    print(f"wrote {out}")
    return 0


def _add_show(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("show", help="draw samples (boxes, class names, labels, keys) into a PNG grid",
                       description="Draw samples of DATASET (any format, or a URL) as stored and, with --resize, "
                                   "as read: boxes with their class names, the image label and key under each.")
    s.add_argument("path", metavar="DATASET")
    s.add_argument("index", nargs="*", type=int, help="sample indices (default: --count spread over the dataset)")
    s.add_argument("-o", "--output", default="grid.png", help="PNG to write (default grid.png)")
    s.add_argument("--resize", type=_resize_arg, metavar="N|HxW",
                   help="also draw each sample as read with resize= (N: squashed to NxN, aspect not kept)")
    s.add_argument("--count", type=_int_in(1, 64), default=8, help="samples when no index is given (default 8)")
    s.add_argument("--cell", type=_int_in(32, 2048), default=256, help="tile side in pixels (default 256)")
    s.set_defaults(fn=_cmd_show)


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("doctor", help="does training wait on data? measure a dataset, rank storage layouts",
                       description="Measure per-stage costs of PATH (image folder or packed dataset), pack a sample "
                                   "into candidate layouts, time each with packio.tune's settings, and print a ranked "
                                   "recommendation with the packio convert and reader lines.")
    d.add_argument("path", help="image folder (class sub-folders or flat), or a packed dataset")
    from packio.doctor.limits import RANGES as R

    d.add_argument("--size", type=_int_in(*R["size"]), default=224, help="training image size (default 224)")
    d.add_argument("--batch-size", type=_int_in(*R["batch_size"]), default=64,
                   help="training batch size (default 64)")
    d.add_argument("--seconds", type=_float_in(*R["seconds"]), default=60.0,
                   help="time budget for the whole run (default 60)")
    d.add_argument("--sample", type=_float_in(*R["fraction"]), default=0.02,
                   help="fraction of the dataset to pack (default 0.02)")
    d.add_argument("--min-samples", type=_int_in(*R["min_samples"]), default=256,
                   help="sample at least this many (default 256)")
    d.add_argument("--max-samples", type=_int_in(*R["max_samples"]), default=1000,
                   help="sample at most this many (default 1000)")
    d.add_argument("--step-ms", type=_float_in(*R["step_ms"]),
                   help="your training step time per batch, to say which layouts keep up")
    d.add_argument("--gpu-decode-ms", type=_float_in(*R["gpu_decode_ms"]),
                   help="without CUDA: a GPU decode time per batch you declare (labelled as declared)")
    d.add_argument("--csv", help="CSV of annotations, passed on to the packio convert line")
    d.add_argument("--csv-columns", metavar="MAP", help="map fields to the CSV's columns, as packio convert takes "
                                                        "it (class=cell_type), passed on to the convert line")
    d.add_argument("--report", metavar="DIR", help="write DIR/doctor.md and DIR/doctor.png")
    d.add_argument("--work", metavar="DIR", help="where to pack the samples (default: the system temp folder)")
    d.add_argument("--keep", action="store_true", help="keep the packed samples")
    d.add_argument("--cpus", type=_int_in(*R["cpus"]), help="CPUs to use (default: what affinity and the cgroup quota allow)")
    d.add_argument("--cgroup-root", default="/sys/fs/cgroup", help=argparse.SUPPRESS)
    d.add_argument("--quiet", action="store_true", help="no progress lines")
    d.set_defaults(fn=_cmd_doctor)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="packio", description="Pack image datasets once; read them fast.")
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_convert(sub)

    i = sub.add_parser("info", help="show what a packed dataset holds, how to open it, and its history")
    i.add_argument("path")
    i.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    i.set_defaults(fn=_cmd_info)

    v = sub.add_parser("verify", help="re-read everything and check checksums (exit 1 when damaged, or when empty: "
                                      "nothing verified)")
    v.add_argument("path")
    v.set_defaults(fn=_cmd_verify)

    _add_show(sub)
    _add_doctor(sub)
    sub.add_parser("bench", help="compare formats on one dataset; 'packio bench --help' for its options")
    return p


def _add_convert(sub: argparse._SubParsersAction) -> None:
    from packio.formats import formats
    from packio.options import CHECKS, ENCODE_CHOICES, RANGES

    table = formats()  # format names and suffixes: whatever the registry holds
    suffixes = " ".join(s for spec in table.values() for s in spec.suffixes)
    c = sub.add_parser("convert", help="pack an image folder (+ CSV) or a packed dataset into a format",
                       description="Pack SRC into DST. The format comes from DST's suffix: "
                                   + ", ".join(f"x{spec.suffixes[0]} ({name})" for name, spec in table.items())
                                   + ", or from --format.")
    c.add_argument("src", help="image folder (class sub-folders or flat), or a packed dataset")
    c.add_argument("dst", help=f"output path; its suffix picks the format ({suffixes})")
    c.add_argument("--format", choices=list(table), help="the output format (default: from DST's suffix)")
    c.add_argument("--csv", help="CSV of annotation rows (filename,class,xmin,ymin,xmax,ymax,...)")
    c.add_argument("--csv-columns", metavar="MAP",
                   help="map fields to your CSV's columns, e.g. filename=path,class=cell_type")
    c.add_argument("--label-column", metavar="COL",
                   help="the CSV column that labels the images (default: 'label'; without box columns, "
                        "'label' or else 'class')")
    c.add_argument("--workers", type=_workers, default="auto", metavar="N|auto",
                   help="local processes reading/checking inputs, 0 to 1024; 'auto' (default) times the first "
                        "inputs and uses processes only when they pay off")
    c.add_argument("--scheduler", metavar="ADDR", type=_address,
                   help="Dask scheduler (tcp://host:8786): pack partitions as parts on the cluster (packio[dask])")
    c.add_argument("--parts", type=_int_in(1, 10**6), help="with --scheduler: number of parts (default 4 per "
                                                            "Dask worker)")
    c.add_argument("--strict", action="store_true", help="fail on any skipped input instead of counting it")
    c.add_argument("--size", type=_parse_hw, metavar="HxW", help=f"pre-resize every image to HxW (sides 1 to {MAX_SIDE})")
    c.add_argument("--short-side", type=_int_in(1, MAX_SIDE), metavar="N",
                   help=f"pre-resize so the short side is N, 1 to {MAX_SIDE} (keeps aspect)")
    c.add_argument("--crop", type=_parse_hw, metavar="HxW", help="center-crop to HxW after resizing")
    c.add_argument("--encode", choices=ENCODE_CHOICES, default="keep",
                   help="image encoding stored: 'keep' (default) stores each image's bytes as found when the "
                        "format can hold them (resized images keep their encoding); jpeg/png/bmp re-encode")
    c.add_argument("--quality", type=_int_in(*RANGES["quality"]), default=90, help="JPEG quality 1 to 100 when encoding JPEG")
    c.add_argument("--check", choices=CHECKS, default="auto",
                   help="damaged JPEGs (libjpeg's 'corrupt data' warnings) are skipped where images are decoded "
                        "strictly: 'auto' (default) those decoded anyway (resized, re-encoded), at no extra cost; "
                        "'decode' every image (a decode each); 'header' none (headers and end markers only)")
    c.add_argument("--overwrite", action="store_true", help="replace DST if it is a packio dataset (atomically)")
    c.add_argument("--append", action="store_true",
                   help="add SRC's samples to the packio dataset DST as one more part, with DST's stored settings "
                        "(new classes appended; readers opened before keep their version)")
    c.add_argument("--follow-symlinks", action="store_true",
                   help="follow symlinks in SRC leading outside it, and symlinked folders (default: skipped, counted)")
    c.add_argument("--shards", type=_int_in(*RANGES["shards"]), metavar="N",
                   help="tar: number of shards (default: max(8, 2 x CPUs), at least 8 samples each)")
    c.add_argument("--shard-samples", type=_int_in(*RANGES["shard_samples"]), metavar="N",
                   help="tar: samples per shard instead of --shards")
    c.add_argument("--shard-bytes", type=_bytes, default=1 << 30, metavar="SIZE",
                   help="tar: a shard ends at this size too, like 512M (default 1G)")
    c.add_argument("--quiet", action="store_true",
                   help="no progress bar, and the summary in one line (warnings still on stderr)")
    c.add_argument("--verbose", action="store_true", help="list every skipped input")
    c.set_defaults(fn=_cmd_convert)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        rc = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # here, not at exit: a reader gone by now is handled below
        return rc
    except BrokenPipeError:  # `packio info x | head -1`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes nowhere, without a second error
        os.close(devnull)
        return 128 + signal.SIGPIPE  # what `cat` and other tools killed by SIGPIPE report


def _run(argv: list[str]) -> int:
    from packio.errors import PackioError

    with _escaping_output():
        try:
            if argv[:1] == ["bench"]:  # its own parser: argparse's REMAINDER drops leading options
                from packio.bench import main as bench_main

                return bench_main(argv[1:])
            args = build_parser().parse_args(argv)
            return args.fn(args)
        except PackioError as exc:
            print(f"packio: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("packio: interrupted; no output was committed", file=sys.stderr)
            return 130


@contextlib.contextmanager
def _escaping_output() -> Iterator[None]:
    """stdout and stderr write what they cannot encode as escapes while a command runs:
    a name's bytes that are not UTF-8 (a lone surrogate in Python) ended a command in a
    UnicodeEncodeError under a strict UTF-8 locale (en_US.UTF-8)."""
    streams = [(s, s.errors) for s in (sys.stdout, sys.stderr) if isinstance(s, io.TextIOWrapper)]
    for stream, _ in streams:
        stream.reconfigure(errors="backslashreplace")
    try:
        yield
    finally:
        for stream, errors in streams:
            stream.reconfigure(errors=errors)


if __name__ == "__main__":
    sys.exit(main())
