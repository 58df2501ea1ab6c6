"""A conversion planned: the request checked (output name and format, run numbers,
paths that would eat the source), the source opened (a packed dataset's reader, or an
image folder's listing) and the job every part shares (format, shards, what the
manifest records) with the function that prepares one input."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from packio import census, limits
from packio.errors import FormatError, PackioError, SourceError, is_url
from packio.formats import format_for_path, formats, get_format, is_packed, open_reader
from packio.formats.base import FormatSpec, WriteOptions
from packio.formats.reader import Reader
from packio.manifest import Manifest
from packio.options import PackOptions
from packio.pack.commit import check_not_inside_dataset, check_output, remove, temp_name
from packio.pack.prepare import Prep, Result, prepare_file, prepare_packed
from packio.pack.report import history_of
from packio.pack.workers import cpus
from packio.pack.write import Job
from packio.sources import scan_source

__all__ = ["Source", "check_request", "readable_csv", "open_source", "plan", "output_format", "plan_shards",
           "declared_shape", "MIN_SHARD_SAMPLES", "MAX_SHARD_SAMPLES"]

# Tar shards per dataset: max(8, 2 x CPUs here, samples / MAX), but no shard under MIN samples.
MIN_SHARD_SAMPLES, MAX_SHARD_SAMPLES = 8, 10_000


@dataclass
class Source:
    """What a conversion packs: its inputs (image files, or a packed dataset's indices) and
    what the listing found on the way."""

    path: Path | str  # a URL source stays a string
    kind: str  # for the history: "image folder" or "lmdb dataset", ...
    tasks: list[Any]
    classes: list[str]
    box_classes: list[str] | None
    info: dict[str, Any]  # the manifest's "source" entry
    history: list[dict[str, Any]] = field(default_factory=list)  # a packed source's recorded steps
    reader: Reader | None = None  # set for a packed source
    shape: tuple[int, int] | None = None  # a packed source's fixed image shape, if it declares one
    skipped: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    notes: Counter[str] = field(default_factory=Counter)


def check_request(src: str | Path | Reader, dst: str | Path, options: PackOptions, *, csv: str | Path | None,
                  columns: dict[str, str] | None, workers: int | str, parts: int | None,
                  overwrite: bool, append: bool = False, scheduler: Any = None) -> tuple[Path | Reader, Path, FormatSpec, bool]:
    """``src`` (a path, or a reader opened already: a URL, opened by packio.convert) and
    ``dst`` as a path, the output's format and whether ``src`` is a packed dataset, once
    every check that needs no lock passed."""
    if is_url(str(dst)):
        raise PackioError(f"{dst}: a URL; convert to it with packio.convert (it packs locally, then uploads)")
    given = src if isinstance(src, Reader) else None
    src, dst = Path(str(src)), Path(str(dst).rstrip("/"))
    spec = output_format(dst, options.format)
    _check_numbers(workers=workers, parts=parts)
    encode = options.encode
    if encode not in ("keep", spec.payload) and spec.payload != "encoded":
        raise PackioError(f"the {spec.name} format stores {'BMP' if spec.payload == 'bmp' else 'decoded uint8 pixels'}"
                          f" only; drop --encode {encode} (or choose another output format)")
    try:
        packed_src = given is not None or src.is_file() or is_packed(src)
    except OSError as exc:  # a name too long, a folder without permission
        raise SourceError(f"{src}: cannot be read ({exc.strerror or exc})") from exc
    if packed_src and (csv or columns):
        raise SourceError(f"{src} is a packed dataset: its annotations are already stored, and a CSV "
                          f"(--csv / --csv-columns) applies only to an image folder; drop the CSV, or "
                          f"give the image folder it describes")
    if not packed_src and not src.exists():
        raise SourceError(f"{src}: no such file or folder")
    if given is None:
        _check_paths(src, dst, csv)
    if append and (overwrite or scheduler is not None):
        raise PackioError(f"{dst}: --append adds to the dataset; it cannot be combined with "
                          f"{'--overwrite' if overwrite else '--scheduler'} (drop one of them)")
    check_not_inside_dataset(dst)
    if not append:
        check_output(dst, overwrite)
    if not dst.parent.is_dir():
        raise PackioError(f"{dst.parent}: the output's folder does not exist; create it first")
    return src if given is None else given, dst, spec, packed_src


@contextlib.contextmanager
def readable_csv(csv: str | Path | None, dst: Path) -> Iterator[str | Path | None]:
    """``csv``, or, when it is a pipe or FIFO (``--csv <(zcat a.csv.gz)``), a copy of what it
    held, read once into a temporary file beside the output (where a Dask worker reads it
    too), removed when the block ends. Errors inside name ``csv``, never the copy."""
    try:
        piped = csv is not None and stat.S_ISFIFO(os.stat(csv).st_mode)
    except OSError:
        piped = False  # the CSV reader names the problem
    if not piped:
        yield csv
        return
    tmp = temp_name(dst)
    tmp = tmp.with_name(f"{tmp.name}.csv")  # cleaned as the output's temporaries are, once its process is gone
    try:
        try:
            with open(csv, "rb") as pipe, open(tmp, "xb") as out:  # type: ignore[arg-type]
                shutil.copyfileobj(pipe, out, 1 << 20)
        except OSError as exc:
            raise SourceError(f"{csv}: the CSV stream could not be read or copied beside {dst} "
                              f"({exc.strerror or exc}); save it to a file and give that") from None
        yield tmp
    except PackioError as exc:
        if str(tmp) not in str(exc):
            raise
        raise type(exc)(str(exc).replace(str(tmp), str(csv))) from None
    finally:
        remove(tmp)


def open_source(src: Path | Reader, packed: bool, csv: str | Path | None, columns: dict[str, str] | None, *,
                strict: bool, follow_symlinks: bool, folder_classes: bool = False) -> Source:
    """The inputs of ``src``: a packed dataset's samples, or an image folder's listing
    (``folder_classes``: see :func:`packio.sources.scan_source`)."""
    if packed:
        reader = src if isinstance(src, Reader) else open_reader(src)
        # str, not Path: Path folds a URL's "//"; a remote reader's str never holds credentials
        src = str(src)
        m = reader.manifest
        source = Source(src, f"{m.format} dataset", list(range(len(reader))), list(m.classes), m.box_classes,
                        {"path": str(src), "packed_format": m.format}, history_of(m), reader, declared_shape(m))
        if not source.tasks:
            raise SourceError(f"{src}: the packed dataset holds no samples; nothing to convert")
        return source
    scan = scan_source(src, csv, columns, strict=strict, follow_symlinks=follow_symlinks,
                       folder_classes=folder_classes)
    info = {"path": str(src), "csv": str(csv) if csv else None, **scan.info}
    info["csv_unused_text"] = census.unused_text_columns(csv, scan.info.get("csv_columns"))
    if not scan.items:
        skipped = sum(scan.skipped.values())
        raise SourceError(f"{src}: no image files found" + (f" ({skipped} entries skipped: "
                          + "; ".join(scan.problems[:3]) + ")" if skipped else "")
                          + "; give a folder holding images (class sub-folders or flat)")
    return Source(src, "image folder", scan.items, scan.classes, scan.box_classes, info,
                  skipped=Counter(scan.skipped), problems=list(scan.problems), notes=Counter(scan.notes))


def plan(spec: FormatSpec, options: PackOptions, source: Source, strict: bool) -> tuple[Job, Callable[[Any], Result]]:
    """What every part of the conversion shares (format, writer options, what the manifest
    records) and the function that prepares one input."""
    o = options
    fixed = o.resize.fixed_shape
    if fixed is None and not o.resize.active:  # a fixed-shape source keeps its shape (e.g. arrays → hdf5)
        fixed = source.shape
    if spec.needs_fixed_shape and fixed is None:
        raise PackioError(f"the {spec.name} format stores one image shape: give --size HxW, "
                          f"or --short-side N with --crop HxW")
    payload = "encoded" if spec.payload == "encoded" and o.encode != "keep" else spec.payload_for(fixed)
    max_pixels = limits.MAX_PIXELS if o.max_pixels is None else o.max_pixels
    prep = Prep(payload, o.resize, o.quality, max_pixels, reader=source.reader, encode=o.encode,
                shape=fixed if payload == "raw" else None, check=o.check)
    fn = functools.partial(prepare_file if source.reader is None else prepare_packed, prep)
    resize = o.resize.to_json() if o.resize.active else None
    history = [*source.history, {"from": source.kind, "source": str(source.path), "to": spec.name,
                                 "resize": resize, "encode": o.encode, "quality": o.quality}]
    image = {"payload": payload, "resize": resize, "quality": o.quality, "encode": o.encode, "check": o.check,
             "shape": list(fixed) + [3] if fixed else None, "history": history}
    n_shards = plan_shards(len(source.tasks), o.shards) if o.shard_samples is None else 0
    write = WriteOptions(shard_samples=o.shard_samples or MAX_SHARD_SAMPLES, shard_bytes=o.shard_bytes,
                         fixed_shape=fixed if payload == "raw" else None, shards=n_shards, expected=len(source.tasks))
    return Job(spec.name, write, source.classes, source.box_classes, image, source.info, strict), fn


def plan_shards(count: int, shards: int | None = None) -> int:
    """How many tar shards ``count`` samples get: ``shards`` when given (at most one per
    sample), else max(8, 2 x CPUs here, count / MAX_SHARD_SAMPLES) so that every
    DataLoader worker of a few ranks has shards of its own, but none under
    MIN_SHARD_SAMPLES samples (a dataset that small gets fewer shards)."""
    if shards is None:
        shards = min(max(8, 2 * cpus(), math.ceil(count / MAX_SHARD_SAMPLES)), count // MIN_SHARD_SAMPLES)
    return max(1, min(shards, count))


def output_format(dst: Path, format: str | None = None) -> FormatSpec:
    """The format ``dst`` is written in, refusing names that promise something else:
    a folder named ``out.tar`` breaks ``tar tf out.tar``, one named ``x.npy`` breaks
    ``np.load`` (each format lists such suffixes: ``FormatSpec.refused_suffixes``)."""
    suffix = dst.suffix.lower()
    spec = get_format(format) if format else None
    table = formats()
    refusing = next((f for f in table.values() if suffix in dict(f.refused_suffixes)), None)
    if refusing is not None and (spec is None or suffix not in spec.suffixes):
        if spec is not None and spec.name != refusing.name:
            raise FormatError(f"{dst}: '{suffix}' names a {suffix[1:]} file, not the {spec.name} format; "
                              f"name the output {dst.with_suffix(spec.suffixes[0])}")
        inside = f" (it will hold {refusing.folder_holds})" if refusing.folder_holds else ""
        raise FormatError(f"{dst}: '{suffix}' names one file, but the {refusing.name} format writes a folder "
                          f"(a folder named {dst.name} breaks {dict(refusing.refused_suffixes)[suffix]}); name the "
                          f"output {dst.with_suffix(refusing.suffixes[0])}{inside}")
    if spec is None:
        return format_for_path(dst)
    owner = next((f.name for f in table.values() if suffix in f.suffixes), None)
    if owner not in (None, spec.name):
        raise FormatError(f"{dst}: the suffix {suffix} means the {owner} format, not {spec.name}; "
                          f"name the output {dst.with_suffix(spec.suffixes[0])}")
    return spec


def _check_numbers(**values: Any) -> None:
    """Reject numbers outside the range each run parameter accepts (the CLI checks the same)."""
    ranges = {"workers": (0, 1024), "parts": (1, 10**6)}
    for name, v in values.items():
        if v is None or (name == "workers" and v == "auto"):
            continue
        lo, hi = ranges[name]
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise PackioError(f"{name} must be an integer from {lo} to {hi}"
                              + (" or 'auto'" if name == "workers" else "") + f", got {v!r}")


def declared_shape(m: Manifest) -> tuple[int, int] | None:
    shape = m.image.get("shape")
    if (isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and v > 0 for v in shape)):
        return shape[0], shape[1]
    return None


def _check_paths(src: Path, dst: Path, csv: str | Path | None) -> None:
    """Refuse an output that is, holds or lies inside the source, or holds the CSV
    (symlinks resolved): replacing it would delete inputs, and a later run would
    pack this output as input."""
    base = src.parent if "{" in str(src) else src  # a brace pattern of shards: their folder
    forms = lambda p: {Path(os.path.abspath(p)), Path(os.path.realpath(p))}  # noqa: E731
    for d in forms(dst):
        for s in forms(base):
            if s == d:
                raise PackioError(f"{dst}: source and destination are the same; write the output elsewhere")
            if s in d.parents:
                raise PackioError(f"{dst} lies inside the source {src}: a later run would pack this output as "
                                  f"input; write it outside the source folder")
            if d in s.parents:
                raise PackioError(f"{dst} holds the source {src}: replacing it would delete the input; "
                                  f"write the output elsewhere")
        if csv and any(c == d or d in c.parents for c in forms(csv)):
            raise PackioError(f"{dst} holds the CSV {csv}: replacing it would delete it; write the output elsewhere")
