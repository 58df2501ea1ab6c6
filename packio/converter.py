"""convert(src, dst): an image folder (+ CSV) or any packed dataset → any format.

Inputs are read, checked and (optionally) resized in worker processes; the main
process writes. The output is built under a temporary name beside ``dst`` and
renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import math
import multiprocessing
import os
import re
import shutil
import signal
import stat
import threading
import time
import uuid
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from packio import census
from packio import decode as dec
from packio import geometry as geo
from packio import limits
from packio.errors import (DatasetReplacedError, FormatError, OutputBusyError, OutputExistsError, PackioError,
                           SourceError)
from packio.formats import format_for_path, formats, get_format, is_packed, open_reader
from packio.formats.base import FormatSpec, Reader, WriteOptions
from packio.manifest import MANIFEST_NAME, Manifest, describe_files, disk_bytes
from packio.options import PackOptions, merge_options
from packio.sample import Sample, checksum, unstorable
from packio.sources import SourceItem, boxes_to_stored_frame, read_image_file, scan_source

__all__ = ["Summary", "convert", "Packed", "Skipped", "output_format"]

TMP_MARK = ".packio-tmp-"
REORIENTED = "EXIF-rotated image stored upright (pixels and boxes turned, re-encoded)"
# Tar shards per dataset: max(8, 2 x CPUs here, samples / MAX), but no shard under MIN samples.
MIN_SHARD_SAMPLES, MAX_SHARD_SAMPLES = 8, 10_000
# workers="auto": time the first inputs here, then use processes only when each input costs at
# least AUTO_MIN_TASK_S and the rest at least AUTO_MIN_REST_S in one process: starting a pool
# cost 0.7-0.8 s here, and 2 workers lost to 1 on small photos (benchmarks/convert.py workers).
AUTO_PROBE, AUTO_PROBE_S, AUTO_MIN_TASK_S, AUTO_MIN_REST_S = 16, 0.3, 0.002, 3.0


@dataclass
class Summary:
    output: str
    format: str
    packed: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    manifest: Manifest | None = None

    def text(self) -> str:
        skipped = sum(self.skipped.values())
        lines = [f"packed {self.packed} samples into {self.output} ({self.format}, "
                 f"{self.bytes / 1e6:.1f} MB) in {self.seconds:.1f} s"]
        if self.manifest is not None and "://" not in self.output:  # a URL: 'packio info URL' describes it
            lines += describe_output(Path(self.output), self.manifest)
        if self.manifest is not None:
            lines += census.describe(self.manifest)
        if self.info.get("workers"):
            w = self.info["workers"]  # packing processes, not a DataLoader's workers: said apart
            lines.append(f"packing:  {w if 'Dask' in w else '--workers ' + w}")
        lines.append(f"skipped {skipped}" + (":" if skipped else ""))
        lines += [f"  {n:6d}  {reason}" for reason, n in sorted(self.skipped.items())]
        if self.info.get("duplicate_content"):
            lines.append(f"note: {self.info['duplicate_content']} samples are byte-identical to another (kept)")
        lines += [f"note: {n} x {what}" for what, n in sorted(self.info.get("notes", {}).items())]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Prep:
    """What each worker needs to turn one input into a stored Sample."""

    payload: str  # target format's payload kind: "encoded", "raw" or "bmp"
    resize: dec.ResizeSpec
    quality: int
    max_pixels: int
    reader: Reader | None = None  # set when the source is a packed dataset
    encode: str = "keep"  # "keep" or the encoding every stored image gets
    shape: tuple[int, int] | None = None  # (h, w) every stored image must have
    check: str = "auto"  # see convert(); "auto": images decoded anyway are decoded strictly


@dataclass(frozen=True)
class Packed:
    """An input made into the sample to store."""

    sample: Sample
    found: str  # the encoding the input had ("raw": pixels)
    kept: bool  # its bytes are stored as found (else decoded, and re-encoded unless stored raw)
    where: str  # the input, for messages
    notes: tuple[str, ...] = ()  # facts for the summary, e.g. REORIENTED

    @property
    def done(self) -> str:
        """What was done to the image, as the manifest counts it: "jpeg kept", "bmp→jpeg"."""
        return f"{self.found} kept" if self.kept else f"{self.found}→{self.sample.encoding}"


@dataclass(frozen=True)
class Skipped:
    """An input left out, and why."""

    reason: str  # what the summary counts, e.g. "corrupt image data"
    where: str  # the input, with the detail


Result = Packed | Skipped


def _native_errors() -> tuple[type[BaseException], ...]:
    """What OpenCV, simplejpeg and numpy raise on an image they cannot handle."""
    return (ValueError, MemoryError, RuntimeError, OverflowError, dec._cv2().error)


def _target_encoding(prep: _Prep, found: str) -> str:
    """The stored encoding: the target's only one, else what was asked, else the one found
    (raw pixels into an encoded format: lossless PNG, said in the summary)."""
    if prep.payload in ("raw", "bmp"):
        return prep.payload
    if prep.encode != "keep":
        return prep.encode
    return "png" if found == "raw" else found


def _finish(prep: _Prep, s: Sample, where: str, orientation: int | None = None) -> Result:
    """Keep the sample's bytes when the target stores them as they are; otherwise decode,
    resize and encode it as the target asks.

    Stored images are always upright: an EXIF orientation is applied here to the
    pixels and the boxes together (``s.boxes`` are in the frame of ``s.payload`` as
    stored), and the image re-encoded even when it would otherwise be kept as found."""
    if orientation is None:
        orientation = 1 if isinstance(s.payload, np.ndarray) else dec.exif_orientation(s.payload)
    found = s.encoding
    to = _target_encoding(prep, found)
    if orientation == 1 and not prep.resize.active and to == found and (
            prep.shape is None or (s.height, s.width) == prep.shape):
        if prep.check == "decode" and not isinstance(s.payload, np.ndarray):
            try:
                dec.check_decode(s.payload)
            except _native_errors() as exc:
                return Skipped("corrupt image data", f"{where} ({exc})")
        return _storable(Packed(s, found, True, where))
    if isinstance(s.payload, np.ndarray):
        img = s.payload
    else:
        try:  # pixels as stored; the orientation is applied below, with the boxes
            img = dec.decode(s.payload, strict=prep.check != "header", max_pixels=prep.max_pixels)
        except _native_errors() as exc:
            return Skipped("corrupt image data", f"{where} ({exc})")
    if prep.resize.active and (why := dec.output_problem(prep.resize, *img.shape[:2], to, prep.max_pixels)):
        return Skipped("resize target too large", f"{where} ({why})")
    boxes, box_labels = s.boxes, s.box_labels
    try:
        if orientation != 1:
            boxes = geo.orient(boxes, orientation, img.shape[1], img.shape[0])
            img = np.ascontiguousarray(geo.orient_image(img, orientation))
        if prep.resize.active:
            img, boxes, box_labels = dec.apply_spec(img, boxes, box_labels, prep.resize)
        if prep.shape is not None and img.shape[:2] != prep.shape:
            return Skipped("image shape differs from the dataset's fixed shape", f"{where} ({img.shape[1]}x{img.shape[0]})")
        # only turned upright (same encoding, no resize): a lossy source is re-encoded at high quality
        quality = max(prep.quality, 95) if to == found and not prep.resize.active else prep.quality
        payload = img if to == "raw" else dec.encode(img, to, quality)
    except _native_errors() as exc:
        return Skipped("cannot resize or encode", f"{where} ({type(exc).__name__}: {exc})")
    meta = dict(s.meta, exif_orientation=orientation) if orientation != 1 else s.meta
    out = Sample(key=s.key, payload=payload, encoding=to, label=s.label, boxes=boxes,
                 box_labels=box_labels, width=img.shape[1], height=img.shape[0], meta=meta)
    out.checksum = checksum(out.payload)
    return _storable(Packed(out, found, False, where, (REORIENTED,) if orientation != 1 else ()))


def _storable(p: Packed) -> Result:
    """``p``, or a skip when a reader would refuse what it stores."""
    problem = unstorable(p.sample)
    if problem is not None:
        return Skipped(problem[0], f"{p.where} ({problem[1]})")
    return p


def _prepare_file(prep: _Prep, item: SourceItem) -> Result:
    data, reason, detail = read_image_file(item.path, limits.MAX_INPUT_BYTES)
    if data is None:
        return Skipped(reason, f"{item.path} ({detail})" if detail else item.path)
    enc = dec.sniff(data)
    try:
        w, h = dec.image_size(data, enc)
    except Exception as exc:  # header parsers raise many types on garbage
        return Skipped("corrupt image header", f"{item.path} ({exc})")
    if w <= 0 or h <= 0 or w * h > prep.max_pixels:
        return Skipped("image too large (decompression bomb guard)", f"{item.path} ({w}x{h})")
    if enc == "jpeg" and b"\xff\xd9" not in data[-4096:]:
        return Skipped("truncated JPEG (no end marker)", item.path)
    orientation = dec.exif_orientation(data)
    placed = boxes_to_stored_frame(item, w, h, orientation)
    if isinstance(placed, str):
        return Skipped("CSV width/height fit neither the image nor its EXIF-upright view", f"{item.path} ({placed})")
    boxes, notes = placed
    s = Sample(key=item.key, payload=data, encoding=enc, label=item.label, boxes=boxes,
               box_labels=np.asarray(item.box_labels, np.int64), width=w, height=h)
    s.checksum = checksum(data)
    out = _finish(prep, s, item.path, orientation)
    return dataclasses.replace(out, notes=(*out.notes, *filter(None, notes))) if isinstance(out, Packed) else out


def _prepare_packed(prep: _Prep, index: int) -> Result:
    assert prep.reader is not None
    try:
        s = prep.reader.read(index)
    except DatasetReplacedError:
        raise  # not one bad sample: the whole source changed under us, so the conversion stops, nothing committed
    except PackioError as exc:
        return Skipped("corrupt sample in the source dataset", f"#{index} ({exc})")
    if s.checksum and checksum(s.payload) != s.checksum:  # never launder damage into a fresh checksum
        return Skipped("corrupt sample in the source dataset", f"#{index} {s.key} (checksum mismatch)")
    return _finish(prep, s, s.key)


_WORKER_FN: Callable[[Any], Result] | None = None  # set once in each pool process by _init_worker


def _init_worker(fn: Callable[[Any], Result]) -> None:
    global _WORKER_FN
    _WORKER_FN = fn


def _call(task: Any) -> Result:
    assert _WORKER_FN is not None, "pool process started without _init_worker"
    return _WORKER_FN(task)


def _results(fn: Callable[[Any], Result], tasks: list[Any], workers: int | str,
             chosen: dict[str, Any] | None = None) -> Iterator[Result]:
    """``fn`` over ``tasks``, in this process or a pool. ``workers="auto"`` times the first
    inputs here and starts processes only where they pay off (``chosen["workers"]`` says why)."""
    chosen = {} if chosen is None else chosen
    if workers == "auto":
        spent, done = 0.0, 0
        while done < min(len(tasks), AUTO_PROBE) and (done < 3 or spent < AUTO_PROBE_S):
            t = time.perf_counter()
            result = fn(tasks[done])
            if done:  # the first input pays one-time costs (imports, decoder set-up): not counted
                spent += time.perf_counter() - t
            done += 1
            yield result
        per, rest = spent / max(done - 1, 1), len(tasks) - done
        free = _free_cpus()
        workers = auto_workers(per, rest, free)
        why = ("processes pay off" if workers > 1 else
               f"the CPUs are busy: fewer than 2 idle of {_cpus()}" if free < 2 and per * rest >= AUTO_MIN_REST_S
               and per >= AUTO_MIN_TASK_S else "one process is fastest for inputs this quick")
        chosen["workers"] = f"auto → {workers} ({per * 1e3:.1f} ms per input measured; {why})"
        tasks = tasks[done:]
    else:
        chosen["workers"] = f"{workers}" + (" (inputs read in this process)" if workers <= 1 else " processes")
    if workers <= 1:
        yield from map(fn, tasks)
        return
    # forkserver, not fork: the caller may run threads (Dask, decode pools, OpenCV) whose
    # locks a forked child would inherit held (seen here: a worker hanging in OpenCV).
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    # fn (with a packed source's reader and its index) goes to each process once, not with every chunk
    with ctx.Pool(workers, initializer=_init_worker, initargs=(fn,)) as pool:
        yield from pool.imap(_call, tasks, chunksize=8)


def auto_workers(per_task_s: float, rest: int, free_cpus: float | None = None) -> int:
    """Processes for ``rest`` more inputs that each took ``per_task_s`` here: 0 (this
    process) unless each input is slow enough to outweigh sending it between processes,
    the rest long enough to outweigh starting them, and at least two CPUs are idle
    (``free_cpus``: CPUs minus the load of other processes; on a busy machine
    processes only queue behind each other)."""
    if free_cpus is None:
        free_cpus = _free_cpus()
    if per_task_s < AUTO_MIN_TASK_S or per_task_s * rest < AUTO_MIN_REST_S or free_cpus < 2:
        return 0
    return int(free_cpus)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _free_cpus() -> float:
    try:
        others = max(0.0, os.getloadavg()[0] - 1.0)  # this process is one of the running ones
    except (AttributeError, OSError):
        others = 0.0
    return _cpus() - others


def plan_shards(count: int, shards: int | None = None) -> int:
    """How many tar shards ``count`` samples get: ``shards`` when given (at most one per
    sample), else max(8, 2 x CPUs here, count / MAX_SHARD_SAMPLES) so that every
    DataLoader worker of a few ranks has shards of its own, but none under
    MIN_SHARD_SAMPLES samples (a dataset that small gets fewer shards)."""
    if shards is None:
        shards = min(max(8, 2 * _cpus(), math.ceil(count / MAX_SHARD_SAMPLES)), count // MIN_SHARD_SAMPLES)
    return max(1, min(shards, count))


def _progress(total: int, enabled: bool | None) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="img", disable=(None if enabled is None else not enabled), leave=False)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _clean_stale(dst: Path) -> None:
    """Remove temporaries left by killed runs (their pid is gone)."""
    for p in dst.parent.glob(f".{dst.name}{TMP_MARK}*"):
        pid = p.name.rsplit(TMP_MARK, 1)[-1].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _remove(p)


def convert(src: str | Path | Reader, dst: str | Path, *, options: PackOptions | None = None,
            csv: str | Path | None = None, columns: dict[str, str] | None = None, workers: int | str = "auto",
            strict: bool = False, overwrite: bool = False, progress: bool | None = None, scheduler: Any = None,
            parts: int | None = None, follow_symlinks: bool = False, **fields: Any) -> Summary:
    """Pack ``src`` (image folder + optional CSV, or a packed dataset) into ``dst``.

    What the output holds comes from ``options`` (:class:`packio.PackOptions`) and
    its fields given as keywords (``format``, ``resize``, ``encode``, ``quality``,
    ``check``, ``max_pixels``, ``shards``, ``shard_samples``, ``shard_bytes``), a
    keyword winning over ``options``; the other parameters say how to run.

    The format comes from ``format`` or ``dst``'s suffix (``.lmdb`` ``.h5`` ``.wds``
    ``.bmpdir`` ``.arrays``; see the README's naming conventions). Bad inputs are
    skipped and counted in the returned Summary; ``strict=True`` turns any skip into a
    ``SourceError``; a source with nothing to pack is a ``SourceError``. ``dst``
    appears only when complete.

    ``encode="keep"`` stores each image's bytes as found when the target can hold
    them (re-encoding in the same encoding only when resized); ``"jpeg"`` (at
    ``quality``), ``"png"`` or ``"bmp"`` re-encode every image that is not already
    so. The manifest records what was done (``image.history``, ``image.encodings``).

    Tar: ``shards`` (default: see ``plan_shards``) or ``shard_samples`` per shard;
    a shard also ends at ``shard_bytes``.

    ``workers``: ``"auto"`` (time the first inputs, then use processes only when they
    pay off), or N local processes reading and checking inputs; one process writes.
    ``scheduler``: a Dask scheduler address (``"tcp://host:8786"``), ``Client`` or
    cluster: the listing is split into ``parts`` contiguous partitions, each packed
    by one task into its own part; the parts are committed under one manifest once
    all of them are complete (needs ``pip install 'packio[dask]'``).

    ``check``: a JPEG that libjpeg decodes only with warnings (garbage entropy data, a
    cut scan) is skipped and counted as "corrupt image data" wherever it is decoded
    strictly. ``"auto"`` (default): images decoded anyway (to resize, re-encode or turn
    upright) are decoded strictly, at no extra cost; images stored as found get the
    header checks only. ``"decode"``: every image is decoded strictly, stored as found
    or not (costs a decode per image). ``"header"``: headers and JPEG end markers only,
    lenient decoding (a damaged image is re-encoded with made-up pixels).
    ``max_pixels`` defaults to ``packio.limits.MAX_PIXELS``.

    ``dst`` may not be, hold or lie inside ``src``; a lock beside it makes a second
    conversion to the same path fail at once. ``overwrite`` replaces only a packio
    dataset, atomically. Symlinks in ``src`` are followed only where they stay inside
    it, unless ``follow_symlinks``; every skipped entry is counted. SIGTERM / SIGHUP
    remove the temporary output as Ctrl-C does.
    """
    options = merge_options(PackOptions, options, fields, "convert")
    run = dict(csv=csv, columns=columns, workers=workers, strict=strict, progress=progress, scheduler=scheduler,
               parts=parts, follow_symlinks=follow_symlinks)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*://", str(dst)):
        raise PackioError(f"{dst}: a URL; convert to it with packio.convert (it packs locally, then uploads)")
    t0 = time.perf_counter()
    given = src if isinstance(src, Reader) else None  # opened already (a URL: packio.convert opens it)
    src, dst = Path(str(src)), Path(str(dst).rstrip("/"))
    spec = output_format(dst, options.format)
    _check_numbers(workers=workers, parts=parts)
    encode = options.encode
    if encode not in ("keep", spec.payload) and spec.payload != "encoded":
        raise PackioError(f"the {spec.name} format stores {'BMP' if spec.payload == 'bmp' else 'decoded uint8 pixels'}"
                          f" only; drop --encode {encode} (or choose another output format)")
    packed_src = given is not None or src.is_file() or is_packed(src)
    if packed_src and (csv or columns):
        raise SourceError(f"{src} is a packed dataset: its annotations are already stored, and a CSV "
                          f"(--csv / --csv-columns) applies only to an image folder; drop the CSV, or "
                          f"give the image folder it describes")
    if not packed_src and not src.exists():
        raise SourceError(f"{src}: no such file or folder")
    if given is None:
        _check_paths(src, dst, csv)
    _check_output(dst, overwrite)
    if not dst.parent.is_dir():
        raise PackioError(f"{dst.parent}: the output's folder does not exist; create it first")
    with _terminate_cleanly(), _output_lock(dst):
        _check_output(dst, overwrite)  # again, under the lock
        return _convert(src if given is None else given, dst, spec, options, packed_src, t0, overwrite=overwrite,
                        **run)


def _convert(src: Path | Reader, dst: Path, spec: FormatSpec, options: PackOptions, packed_src: bool, t0: float, *,
             csv: str | Path | None, columns: dict[str, str] | None, workers: int | str, strict: bool,
             overwrite: bool, progress: bool | None, scheduler: Any, parts: int | None,
             follow_symlinks: bool) -> Summary:
    """convert() once its arguments are checked and the output is locked."""
    o = options
    resize, encode, quality, check = o.resize, o.encode, o.quality, o.check
    max_pixels = limits.MAX_PIXELS if o.max_pixels is None else o.max_pixels
    summary = Summary(output=str(dst), format=spec.name)
    notes: Counter[str] = Counter()
    history: list[dict[str, Any]] = []
    fixed = resize.fixed_shape
    if packed_src:
        reader = open_reader(src)
        classes, box_classes = list(reader.manifest.classes), reader.manifest.box_classes
        tasks: list[Any] = list(range(len(reader)))
        history = _history_of(reader.manifest)
        if fixed is None and not resize.active:  # a fixed-shape source keeps its shape (e.g. arrays → hdf5)
            fixed = _declared_shape(reader.manifest)
        source_info: dict[str, Any] = {"path": str(src), "packed_format": reader.manifest.format}
        if not tasks:
            raise SourceError(f"{src}: the packed dataset holds no samples; nothing to convert")
    else:
        scan = scan_source(src, csv, columns, strict=strict, follow_symlinks=follow_symlinks)
        summary.skipped.update(scan.skipped)
        summary.problems += scan.problems
        notes.update(scan.notes)
        classes, box_classes, tasks = scan.classes, scan.box_classes, scan.items
        source_info = {"path": str(src), "csv": str(csv) if csv else None, **scan.info}
        source_info["csv_unused_text"] = census.unused_text_columns(csv, scan.info.get("csv_columns"))
        if not tasks:
            skipped = sum(scan.skipped.values())
            raise SourceError(f"{src}: no image files found" + (f" ({skipped} entries skipped: "
                              + "; ".join(scan.problems[:3]) + ")" if skipped else "")
                              + "; give a folder holding images (class sub-folders or flat)")
    if spec.needs_fixed_shape and fixed is None:
        raise PackioError(f"the {spec.name} format stores one image shape: give --size HxW, "
                          f"or --short-side N with --crop HxW")
    payload = "encoded" if spec.payload == "encoded" and encode != "keep" else spec.payload_for(fixed)
    prep = _Prep(payload, resize, quality, max_pixels, encode=encode,
                 shape=fixed if payload == "raw" else None, check=check)
    if packed_src:
        fn = functools.partial(_prepare_packed, dataclasses.replace(prep, reader=reader))
    else:
        fn = functools.partial(_prepare_file, prep)
    history.append({"from": (f"{reader.manifest.format} dataset" if packed_src else "image folder"),
                    "source": str(src), "to": spec.name, "resize": resize.to_json() if resize.active else None,
                    "encode": encode, "quality": quality})
    image = {"payload": payload, "resize": resize.to_json() if resize.active else None,
             "quality": quality, "encode": encode, "check": check,
             "shape": list(fixed) + [3] if fixed else None, "history": history}
    n_shards = plan_shards(len(tasks), o.shards) if o.shard_samples is None else 0
    job = _Job(spec.name, WriteOptions(shard_samples=o.shard_samples or MAX_SHARD_SAMPLES, shard_bytes=o.shard_bytes,
                                       fixed_shape=fixed if payload == "raw" else None,
                                       shards=n_shards, expected=len(tasks)),
               classes, box_classes, image, source_info, strict)

    _clean_stale(dst)
    tmp = dst.with_name(f".{dst.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        if scheduler is None:
            part = _write_part(job, fn, tasks, tmp, workers=workers, progress=progress,
                               skipped=Counter(summary.skipped), notes=Counter(notes))
        else:
            part = _write_parts(job, fn, tasks, tmp, scheduler, parts, progress, Counter(summary.skipped),
                                Counter(notes))
        if not part["count"]:
            raise SourceError(f"{src}: none of its {len(tasks)} inputs could be packed ("
                              + "; ".join(f"{n} {r}" for r, n in sorted(part["skipped"].items()))
                              + "); nothing was written")
        summary.skipped = Counter(part["skipped"])
        summary.problems += part["problems"]
        summary.packed = part["count"]
        summary.info["duplicate_content"] = part["duplicate_content"]
        summary.info["notes"] = dict(part["notes"])
        summary.info["workers"] = part.get("workers")
        summary.manifest = part["manifest"]
        _fsync_tree(tmp)
        _commit(tmp, dst, overwrite)
    except OSError as exc:
        _remove(tmp)
        raise PackioError(f"{dst}: writing failed ({exc.strerror or exc}); the partial output was removed"
                          + ("; free some disk space and run again" if exc.errno == errno.ENOSPC else "")) from None
    except BaseException:
        _remove(tmp)
        raise
    summary.bytes = disk_bytes(dst)
    summary.seconds = time.perf_counter() - t0
    return summary


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


def _history_of(m: Manifest) -> list[dict[str, Any]]:
    """The source dataset's recorded steps (datasets from before packio kept them get one summary step)."""
    steps = m.image.get("history")
    if isinstance(steps, list) and all(isinstance(x, dict) for x in steps):
        return [dict(x) for x in steps[-31:]]
    return [{"from": "unrecorded (packed before packio kept a history)", "to": m.format,
             "resize": m.image.get("resize"), "payload": m.image.get("payload")}]


def _declared_shape(m: Manifest) -> tuple[int, int] | None:
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


def _is_dataset(path: Path) -> bool:
    """A packio dataset: a folder whose manifest parses, or a file a format claims that
    carries packio's manifest (an HDF5 file written by packio; not foreign tar shards)."""
    try:
        if path.is_dir():
            Reader.read_manifest(path)
            return True
        return path.is_file() and not open_reader(path).manifest.source.get("foreign")
    except (FormatError, OSError):
        return False


def _check_output(dst: Path, overwrite: bool) -> None:
    if not os.path.lexists(dst):
        return
    if not overwrite:
        raise OutputExistsError(f"{dst} exists; pass --overwrite to replace it, or choose another name")
    if not _is_dataset(dst):
        raise OutputExistsError(f"{dst} exists and is not a packio dataset; --overwrite replaces only a packio "
                                f"dataset (a folder with {MANIFEST_NAME}, or a packio HDF5 file): remove it "
                                f"yourself or choose another name")


@contextlib.contextmanager
def _output_lock(dst: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``dst`` for the whole conversion (a lock file beside
    it): a second conversion to the same path fails at once instead of racing this one."""
    import fcntl

    path = dst.with_name(f".{dst.name}.packio-lock")
    while True:
        try:
            # never through a planted symlink (it would create a file where it points), never blocking
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise PackioError(f"{path}: cannot create the output's lock file ({exc.strerror}); if it is a "
                              f"symlink or not a regular file, remove it") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise PackioError(f"{path}: the output's lock file is not a regular file; remove it")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException as exc:
            os.close(fd)
            if not isinstance(exc, BlockingIOError):
                raise
            raise OutputBusyError(f"{dst}: another packio conversion is writing it now (it holds {path}); "
                                  f"wait for it to finish, or choose another output") from None
        try:  # the file on disk, not one its last holder removed after we opened it
            if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still holding it: a waiter then sees a fresh file
        os.close(fd)


class _Terminated(BaseException):
    """SIGTERM / SIGHUP during a conversion: unwinds like Ctrl-C so the temporary output goes."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def _terminate_cleanly() -> Iterator[None]:
    """While converting in the main thread, turn SIGTERM / SIGHUP (where they would kill
    the process outright) into an exception; after the clean-up, die of the signal."""
    saved: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        def handler(signum: int, frame: Any) -> None:
            raise _Terminated(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                saved[sig] = signal.signal(sig, handler)
    try:
        yield
    except _Terminated as exc:
        for sig, old in saved.items():
            signal.signal(sig, old)
        saved.clear()
        os.kill(os.getpid(), exc.signum)
        raise
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


@functools.lru_cache(maxsize=1)
def _renameat2() -> Any:
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:
        return None


def _rename2(src: Path, dst: Path, flag: int) -> bool:
    """Linux ``renameat2`` with RENAME_NOREPLACE or RENAME_EXCHANGE (atomic); False where
    the C library or the file system lacks it, and the caller falls back."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(-100, os.fsencode(src), -100, os.fsencode(dst), flag) == 0:  # -100: AT_FDCWD
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _commit(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Move the finished output into place: swapped atomically with an existing packio
    dataset (overwrite), else renamed, never over something that appeared meanwhile."""
    if overwrite and os.path.lexists(dst):
        _check_output(dst, overwrite)  # still a packio dataset
        if _rename2(tmp, dst, _RENAME_EXCHANGE):
            _remove(tmp)  # tmp now names the old dataset
            return
        old = dst.with_name(f".{dst.name}{TMP_MARK}{os.getpid()}-old")
        os.rename(dst, old)
        os.rename(tmp, dst)
        _remove(old)
        return
    try:
        if _rename2(tmp, dst, _RENAME_NOREPLACE):
            return
    except FileExistsError:
        pass
    else:
        if not os.path.lexists(dst):
            os.rename(tmp, dst)
            return
    raise OutputExistsError(f"{dst} appeared while converting (written by another program); it was left as it "
                            f"is and this output dropped: pass --overwrite to replace it, or choose another name")


@dataclass(frozen=True)
class _Job:
    """What every part of one conversion shares."""

    format: str
    write_options: WriteOptions  # what the format's writer gets
    classes: list[str]
    box_classes: list[str] | None  # None: a source packed before box_classes, whose box labels index classes
    image: dict[str, Any]
    source: dict[str, Any]
    strict: bool


def _write_part(job: _Job, fn: Callable[[Any], Result], tasks: list[Any], path: Path, *,
                workers: int | str = 0, progress: bool | None = False, skipped: Counter[str] | None = None,
                notes: Counter[str] | None = None) -> dict[str, Any]:
    """Write ``tasks`` as one complete, self-describing dataset at ``path``."""
    spec = get_format(job.format)
    skipped = Counter(skipped or {})
    notes = Counter(notes or {})
    problems: list[str] = []
    writer = spec.writer(path, job.write_options)
    sums = array("Q")  # each sample's checksum (xxh3-64): duplicates counted in numpy at the end
    done: Counter[str] = Counter()  # "jpeg kept", "bmp→jpeg", ...
    stored: Counter[str] = Counter()  # encodings stored
    jpeg_encoded = False  # whether this step encoded any JPEG (the manifest then records the quality)
    chosen: dict[str, Any] = {}
    tally = census.Tally()
    try:
        with _progress(len(tasks), progress) as bar:
            for r in _results(fn, tasks, workers, chosen):
                bar.update(1)
                if isinstance(r, Skipped):
                    if job.strict:
                        raise SourceError(f"{r.where}: {r.reason} (--strict)")
                    skipped[r.reason] += 1
                    problems.append(f"{r.where}: {r.reason}")
                    continue
                sample = r.sample
                sums.append(_sum64(sample))
                done[r.done] += 1
                stored[sample.encoding] += 1
                jpeg_encoded |= not r.kept and sample.encoding == "jpeg"
                notes.update(r.notes)
                tally.add(sample)
                writer.add(sample)
        if job.strict and skipped:
            raise SourceError(f"{sum(skipped.values())} inputs were skipped (--strict): " + "; ".join(problems[:5]))
        extra = writer.close()
    except BaseException:
        writer.abort()
        raise
    dup = len(sums) - len(np.unique(np.frombuffer(sums, np.uint64))) if sums else 0
    manifest = Manifest(format=job.format, count=writer.count, id=uuid.uuid4().hex, classes=job.classes,
                        box_classes=job.box_classes,
                        image=_image_facts(job.image, done, stored, jpeg_encoded), source=job.source, extra=extra,
                        summary={"packed": writer.count, "skipped": dict(skipped), "duplicate_content": dup,
                                 "notes": dict(notes), "annotations": tally.to_json(job.classes, job.box_classes)})
    writer.write_manifest(manifest)
    return {"count": writer.count, "skipped": dict(skipped), "problems": problems, "duplicate_content": dup,
            "notes": dict(notes), "done": dict(done), "stored": dict(stored), "jpeg_encoded": jpeg_encoded,
            "workers": chosen.get("workers"), "manifest": manifest, "annotations": manifest.summary["annotations"]}


def _sum64(sample: Sample) -> int:
    """The sample's checksum as a number (a foreign record's may be no xxh3-64 hex)."""
    text = sample.checksum or checksum(sample.payload)
    try:
        return int(text, 16) if len(text) == 16 else _xxh64(text)
    except ValueError:
        return _xxh64(text)


def _xxh64(text: str) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogateescape"))


def _image_facts(image: dict[str, Any], done: Counter[str], stored: Counter[str], jpeg: bool) -> dict[str, Any]:
    """The manifest's ``image`` entry once written: what this step did (``done``), the
    encodings stored, and the JPEG quality when it encoded any JPEG."""
    history = [*image["history"][:-1], {**image["history"][-1], "quality": image["quality"] if jpeg else None,
                                        "result": dict(sorted(done.items()))}]
    return {**image, "quality": image["quality"] if jpeg else None, "encodings": dict(sorted(stored.items())),
            "history": history}


def _pack_part(job: _Job, fn: Callable[[Any], Result], tasks: list[Any], path: str) -> dict[str, Any]:
    """One Dask task: write one part under a temporary name beside its final one. The
    driver commits the returned temporary; those of killed attempts it removes."""
    final = Path(path)
    if not final.parent.is_dir():
        raise PackioError(f"{final.parent}: the conversion's output is gone (cancelled); nothing written")
    tmp = final.with_name(f".{final.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        out = _write_part(job, fn, tasks, tmp)
        _fsync_tree(tmp)
    except BaseException:
        _remove(tmp)
        raise
    return {**out, "tmp": tmp.name}


def _client(scheduler: Any) -> tuple[Any, bool]:
    try:
        from dask.distributed import Client
    except ImportError:
        raise PackioError("distributed conversion needs Dask: pip install 'packio[dask]'") from None
    if isinstance(scheduler, Client):
        return scheduler, False
    try:
        return Client(scheduler), True
    except (OSError, ValueError, TypeError) as exc:  # bad address, unreachable, timed out
        raise PackioError(f"cannot use the Dask scheduler {scheduler!r} ({exc}); give its address like "
                          f"tcp://host:8786 (start one with 'dask scheduler')") from None


def _write_parts(job: _Job, fn: Callable[[Any], Result], tasks: list[Any], root: Path, scheduler: Any,
                 parts: int | None, progress: bool | None, skipped: Counter[str],
                 notes: Counter[str]) -> dict[str, Any]:
    """Pack contiguous partitions as Dask tasks into ``root/part-NNNNN<suffix>``,
    then write the top manifest that lists them (only when every part is done)."""
    from dask.distributed import as_completed

    client, owned = _client(scheduler)
    try:
        nworkers = max(1, len(client.scheduler_info().get("workers", {})))
        k = max(1, min(parts or 4 * nworkers, len(tasks) or 1))
        bounds = np.linspace(0, len(tasks), k + 1).astype(int)
        suffix = get_format(job.format).suffixes[0]
        root.mkdir(parents=True)
        names = [f"part-{i:05d}{suffix}" for i in range(k)]
        futures = [client.submit(_pack_part, _part_job(job, b - a), fn, tasks[a:b], str(root / name), pure=False,
                                 retries=2, key=f"packio-{root.name}-{name}")
                   for (a, b), name in zip(zip(bounds[:-1], bounds[1:]), names)]
        try:
            with _progress(k, progress) as bar:
                for _ in as_completed(futures):
                    bar.update(1)
            results = client.gather(futures)  # raises the first task error: nothing gets committed
        except BaseException:
            client.cancel(futures)
            raise
    finally:
        if owned:
            client.close()
    for name, r in zip(names, results):  # parts enter the output only under their final names
        os.rename(root / r.pop("tmp"), root / name)
    for p in root.iterdir():
        if p.name not in names:  # temporaries of attempts on workers that died
            _remove(p)
    count = sum(r["count"] for r in results)
    for r in results:
        skipped.update(r["skipped"])
        notes.update(r["notes"])
    dup = sum(r["duplicate_content"] for r in results)
    done = sum((Counter(r["done"]) for r in results), Counter())
    stored = sum((Counter(r["stored"]) for r in results), Counter())
    jpeg = any(r["jpeg_encoded"] for r in results)
    manifest = Manifest(format=job.format, count=count, classes=job.classes, box_classes=job.box_classes,
                        image=_image_facts(job.image, done, stored, jpeg),
                        source=job.source,
                        extra={"parts": [{"path": n, "count": r["count"]} for n, r in zip(names, results)]},
                        summary={"packed": count, "skipped": dict(skipped), "duplicate_content": dup,
                                 "notes": dict(notes), "note": "duplicate_content counts within each part",
                                 "annotations": census.merge([r["annotations"] for r in results])},
                        files=describe_files(root), id=uuid.uuid4().hex)
    (root / MANIFEST_NAME).write_text(manifest.to_json())
    return {"count": count, "skipped": dict(skipped), "notes": dict(notes),
            "problems": [p for r in results for p in r["problems"]],
            "duplicate_content": dup, "done": dict(done), "manifest": manifest,
            "workers": f"{k} parts on {nworkers} Dask worker{'s' if nworkers != 1 else ''}"}


def _part_job(job: _Job, count: int) -> _Job:
    """One part's share of the planned tar shards."""
    o = job.write_options
    if not o.shards:
        return job
    share = max(1, math.ceil(o.shards * count / max(o.expected, 1)))
    return dataclasses.replace(job, write_options=dataclasses.replace(o, shards=share, expected=count))


def describe_output(path: Path, m: Manifest) -> list[str]:
    """Lines telling how to open ``path`` with the neighbours' tools, and what its images are."""
    spec = formats().get(m.format)
    lines: list[str] = spec.reader.describe(path, m) if spec is not None else []
    enc = m.image.get("encodings") or {}
    if enc:
        step = (m.image.get("history") or [{}])[-1]
        lines.append(f"images:   {', '.join(f'{v} {k}' for k, v in enc.items())}: ".replace("raw", "uint8 pixels")
                     + _step_text(step))
    return lines


def describe_history(m: Manifest) -> list[str]:
    """The recorded steps from the first source to this dataset, one line each."""
    steps = m.image.get("history") or []
    return [f"{i}. {s.get('from', '?')} {s.get('source', '')} → {s.get('to', '?')}: {_step_text(s)}"
            for i, s in enumerate(steps, 1) if isinstance(s, dict)]


def _step_text(step: dict[str, Any]) -> str:
    done = step.get("result") if isinstance(step.get("result"), dict) else {}
    kept = [f"{v} {k.removesuffix(' kept')}" for k, v in done.items() if str(k).endswith(" kept")]
    changed = [f"{v} {k}".replace("raw", "uint8 pixels") for k, v in done.items() if not str(k).endswith(" kept")]
    parts = ([", ".join(kept) + " kept as found (not re-encoded)"] if kept else []) + (
        [", ".join(changed)] if changed else [])
    if not done:
        parts.append(f"stored as {step.get('payload', '?')}")
    r = step.get("resize")
    if isinstance(r, dict):
        geo = (f"short side {r['short_side']}" if r.get("short_side") else
               "x".join(map(str, r["size"])) if r.get("size") else "")
        crop = "center crop " + "x".join(map(str, r["crop"])) if r.get("crop") else ""
        parts.append("resized to " + ", ".join(x for x in (geo, crop) if x))
    if step.get("quality") and any(str(k).endswith("→jpeg") for k in done):
        parts.append(f"JPEG quality {step['quality']}")
    if any(str(k).startswith("raw→") for k in done) and step.get("encode") == "keep":
        parts.append("decoded pixels stored lossless; --encode jpeg for smaller files")
    return "; ".join(parts)


def _fsync_tree(root: Path) -> None:
    paths = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
