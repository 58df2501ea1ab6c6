"""convert(src, dst): an image folder (+ CSV) or any packed dataset → any format.

Inputs are read, checked and (optionally) resized in worker processes; the main
process writes. The output is built under a temporary name beside ``dst`` and
renamed into place only when complete.
"""

from __future__ import annotations

import errno
import functools
import multiprocessing
import os
import shutil
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from packio import decode as dec
from packio import limits
from packio.errors import OutputExistsError, PackioError, SourceError
from packio.formats import format_for_path, get_format, open_reader
from packio.formats.base import FormatSpec, Reader, WriteOptions
from packio.manifest import MANIFEST_NAME, Manifest, describe_files
from packio.sample import Sample, checksum, unstorable
from packio.sources import SourceItem, read_image_file, scan_source

TMP_MARK = ".packio-tmp-"


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

    def text(self) -> str:
        skipped = sum(self.skipped.values())
        lines = [f"packed {self.packed} samples into {self.output} ({self.format}, "
                 f"{self.bytes / 1e6:.1f} MB) in {self.seconds:.1f} s"]
        lines.append(f"skipped {skipped}" + (":" if skipped else ""))
        lines += [f"  {n:6d}  {reason}" for reason, n in sorted(self.skipped.items())]
        if self.info.get("duplicate_content"):
            lines.append(f"note: {self.info['duplicate_content']} samples are byte-identical to another (kept)")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Prep:
    """What each worker needs to turn one input into a stored Sample."""

    payload: str  # target format's payload kind
    resize: dec.ResizeSpec
    quality: int
    max_pixels: int
    reader: Reader | None = None  # set when the source is a packed dataset
    check: str = "header"  # "decode": every image is decoded strictly before it is stored


Result = tuple[Sample | None, str, str]  # (sample, skip reason, where)
CHECKS = ("header", "decode")


def _native_errors() -> tuple[type[BaseException], ...]:
    """What OpenCV, simplejpeg and numpy raise on an image they cannot handle."""
    return (ValueError, MemoryError, RuntimeError, OverflowError, dec._cv2().error)


def _finish(prep: _Prep, s: Sample, where: str) -> Result:
    """Re-encode / resize a sample for the target payload kind."""
    if not prep.resize.active and (
            (prep.payload == "encoded" and s.encoding != "raw") or (prep.payload == s.encoding)):
        if prep.check == "decode" and not isinstance(s.payload, np.ndarray):
            try:
                dec.check_decode(s.payload)
            except _native_errors() as exc:
                return None, "corrupt image data", f"{where} ({exc})"
        return _storable(s, where)
    if isinstance(s.payload, np.ndarray):
        img = s.payload
    else:
        try:
            img = dec.decode(s.payload, apply_exif=True, strict=prep.check == "decode", max_pixels=prep.max_pixels)
        except _native_errors() as exc:
            return None, "corrupt image data", f"{where} ({exc})"
    out_enc = {"raw": "raw", "bmp": "bmp"}.get(prep.payload, "jpeg" if prep.resize.active else "png")
    if prep.resize.active and (why := dec.output_problem(prep.resize, *img.shape[:2], out_enc, prep.max_pixels)):
        return None, "resize target too large", f"{where} ({why})"
    boxes, box_labels = s.boxes, s.box_labels
    try:
        if prep.resize.active:
            img, boxes, keep = dec.apply_spec(img, boxes, prep.resize)
            boxes, box_labels = boxes[keep], box_labels[keep]
        payload = img if out_enc == "raw" else dec.encode(img, out_enc, prep.quality)
    except _native_errors() as exc:
        return None, "cannot resize or encode", f"{where} ({type(exc).__name__}: {exc})"
    # raw pixels into an encoded format with no resize asked are kept lossless (png)
    out = Sample(key=s.key, payload=payload, encoding=out_enc, label=s.label, boxes=boxes,
                 box_labels=box_labels, width=img.shape[1], height=img.shape[0], meta=s.meta)
    out.checksum = checksum(out.payload)
    return _storable(out, where)


def _storable(s: Sample, where: str) -> Result:
    """The sample, or a skip when a reader would refuse what it stores."""
    problem = unstorable(s)
    if problem is not None:
        return None, problem[0], f"{where} ({problem[1]})"
    return s, "", where


def _prepare_file(prep: _Prep, item: SourceItem) -> Result:
    data, reason, detail = read_image_file(item.path, limits.MAX_INPUT_BYTES)
    if data is None:
        return None, reason, f"{item.path} ({detail})" if detail else item.path
    enc = dec.sniff(data)
    try:
        w, h = dec.image_size(data, enc)
    except Exception as exc:  # header parsers raise many types on garbage
        return None, "corrupt image header", f"{item.path} ({exc})"
    if w <= 0 or h <= 0 or w * h > prep.max_pixels:
        return None, "image too large (decompression bomb guard)", f"{item.path} ({w}x{h})"
    if enc == "jpeg" and b"\xff\xd9" not in data[-4096:]:
        return None, "truncated JPEG (no end marker)", item.path
    s = Sample(key=item.key, payload=data, encoding=enc, label=item.label,
               boxes=np.asarray(item.boxes, np.float32).reshape(-1, 4),
               box_labels=np.asarray(item.box_labels, np.int64), width=w, height=h)
    s.checksum = checksum(data)
    return _finish(prep, s, item.path)


def _prepare_packed(prep: _Prep, index: int) -> Result:
    assert prep.reader is not None
    try:
        s = prep.reader.read(index)
    except PackioError as exc:
        return None, "corrupt sample in the source dataset", f"#{index} ({exc})"
    return _finish(prep, s, s.key)


def _results(fn: Callable[[Any], Result], tasks: list[Any], workers: int) -> Iterator[Result]:
    if workers <= 1:
        yield from map(fn, tasks)
        return
    # forkserver, not fork: the caller may run threads (Dask, decode pools, OpenCV) whose
    # locks a forked child would inherit held (seen here: a worker hanging in OpenCV).
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    with ctx.Pool(workers) as pool:
        yield from pool.imap(fn, tasks, chunksize=8)


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


def convert(src: str | Path, dst: str | Path, *, format: str | None = None, csv: str | Path | None = None,
            columns: dict[str, str] | None = None, workers: int = 0, strict: bool = False,
            resize: dec.ResizeSpec | None = None, quality: int = 90, overwrite: bool = False,
            shard_samples: int = 10_000, shard_bytes: int = 1 << 30, progress: bool | None = None,
            max_pixels: int | None = None, scheduler: Any = None, parts: int | None = None,
            check: str = "header") -> Summary:
    """Pack ``src`` (image folder + optional CSV, or a packed dataset) into ``dst``.

    The format comes from ``format`` or ``dst``'s suffix. Bad inputs are skipped
    and counted in the returned Summary; ``strict=True`` turns any skip into a
    ``SourceError``. ``dst`` appears only when complete.

    ``workers=N``: N local processes read and check inputs; one process writes.
    ``scheduler``: a Dask scheduler address (``"tcp://host:8786"``), ``Client`` or
    cluster: the listing is split into ``parts`` contiguous partitions, each packed
    by one task into its own part; the parts are committed under one manifest once
    all of them are complete (needs ``pip install 'packio[dask]'``).

    ``check="decode"`` decodes every image strictly before storing it and skips (and
    counts) those libjpeg can only decode with warnings ("corrupt image data"); the
    default ``"header"`` checks headers and JPEG end markers only. Images that are
    resized are decoded anyway: there the check adds a 1/8-scale strict JPEG decode.
    ``max_pixels`` defaults to ``packio.limits.MAX_PIXELS``.
    """
    t0 = time.perf_counter()
    src, dst = Path(src), Path(str(dst).rstrip("/"))
    spec: FormatSpec = get_format(format) if format else format_for_path(dst)
    resize = resize or dec.ResizeSpec()
    if not 1 <= quality <= 100:
        raise PackioError(f"JPEG quality must be 1..100, got {quality}")
    if check not in CHECKS:
        raise PackioError(f"check must be one of {', '.join(CHECKS)}, got {check!r}")
    max_pixels = limits.MAX_PIXELS if max_pixels is None else max_pixels
    if spec.needs_fixed_shape and resize.fixed_shape is None:
        raise PackioError(f"the {spec.name} format stores one image shape: give --size HxW, "
                          f"or --short-side N with --crop HxW")
    if dst.exists() and not overwrite:
        raise OutputExistsError(f"{dst} exists; pass --overwrite to replace it, or choose another name")
    packed_src = (src / MANIFEST_NAME).is_file() or src.is_file() or _looks_like_shards(src)
    if not packed_src and not src.exists():
        raise SourceError(f"{src}: no such file or folder")
    if src.resolve() == dst.resolve():
        raise PackioError(f"{dst}: source and destination are the same")
    if not dst.parent.is_dir():
        raise PackioError(f"{dst.parent}: the output's folder does not exist; create it first")

    summary = Summary(output=str(dst), format=spec.name)
    payload = spec.payload_for(resize.fixed_shape)
    if packed_src:
        reader = open_reader(src)
        classes = list(reader.manifest.classes)
        tasks: list[Any] = list(range(len(reader)))
        fn = functools.partial(_prepare_packed, _Prep(payload, resize, quality, max_pixels, reader, check))
        source_info: dict[str, Any] = {"path": str(src), "packed_format": reader.manifest.format}
    else:
        scan = scan_source(src, csv, columns, strict=strict)
        summary.skipped.update(scan.skipped)
        summary.problems += scan.problems
        classes, tasks = scan.classes, scan.items
        fn = functools.partial(_prepare_file, _Prep(payload, resize, quality, max_pixels, check=check))
        source_info = {"path": str(src), "csv": str(csv) if csv else None, **scan.info}
    image = {"payload": payload, "resize": resize.to_json() if resize.active else None,
             "quality": quality if resize.active else None,
             "shape": list(resize.fixed_shape) + [3] if resize.fixed_shape else None, "check": check}
    job = _Job(spec.name, WriteOptions(shard_samples=shard_samples, shard_bytes=shard_bytes,
                                       fixed_shape=resize.fixed_shape if payload == "raw" else None),
               classes, image, source_info, strict)

    _clean_stale(dst)
    tmp = dst.with_name(f".{dst.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        if scheduler is None:
            part = _write_part(job, fn, tasks, tmp, workers=workers, progress=progress,
                               skipped=Counter(summary.skipped))
        else:
            part = _write_parts(job, fn, tasks, tmp, scheduler, parts, progress, Counter(summary.skipped))
        summary.skipped = Counter(part["skipped"])
        summary.problems += part["problems"]
        summary.packed = part["count"]
        summary.info["duplicate_content"] = part["duplicate_content"]
        _fsync_tree(tmp)
        if dst.exists():  # overwrite: swap in the new output, then drop the old one
            old = dst.with_name(f".{dst.name}{TMP_MARK}{os.getpid()}-old")
            os.rename(dst, old)
            os.rename(tmp, dst)
            _remove(old)
        else:
            os.rename(tmp, dst)
    except OSError as exc:
        _remove(tmp)
        raise PackioError(f"{dst}: writing failed ({exc.strerror or exc}); the partial output was removed"
                          + ("; free some disk space and run again" if exc.errno == errno.ENOSPC else "")) from None
    except BaseException:
        _remove(tmp)
        raise
    summary.bytes = _size(dst)
    summary.seconds = time.perf_counter() - t0
    return summary


@dataclass(frozen=True)
class _Job:
    """What every part of one conversion shares."""

    format: str
    options: WriteOptions
    classes: list[str]
    image: dict[str, Any]
    source: dict[str, Any]
    strict: bool


def _write_part(job: _Job, fn: Callable[[Any], Result], tasks: list[Any], path: Path, *, workers: int = 0,
                progress: bool | None = False, skipped: Counter[str] | None = None) -> dict[str, Any]:
    """Write ``tasks`` as one complete, self-describing dataset at ``path``."""
    spec = get_format(job.format)
    skipped = Counter(skipped or {})
    problems: list[str] = []
    writer = spec.writer(path, job.options)
    seen: set[str] = set()
    dup = 0
    try:
        with _progress(len(tasks), progress) as bar:
            for sample, reason, where in _results(fn, tasks, workers):
                bar.update(1)
                if sample is None:
                    if job.strict:
                        raise SourceError(f"{where}: {reason} (--strict)")
                    skipped[reason] += 1
                    problems.append(f"{where}: {reason}")
                    continue
                dup += sample.checksum in seen
                seen.add(sample.checksum)
                writer.add(sample)
        if job.strict and skipped:
            raise SourceError(f"{sum(skipped.values())} inputs were skipped (--strict): " + "; ".join(problems[:5]))
        extra = writer.close()
    except BaseException:
        writer.abort()
        raise
    manifest = Manifest(format=job.format, count=writer.count, classes=job.classes, image=job.image,
                        source=job.source, extra=extra,
                        summary={"packed": writer.count, "skipped": dict(skipped), "duplicate_content": dup})
    writer.write_manifest(manifest)
    return {"count": writer.count, "skipped": dict(skipped), "problems": problems, "duplicate_content": dup}


def _pack_part(job: _Job, fn: Callable[[Any], Result], tasks: list[Any], path: str) -> dict[str, Any]:
    """One Dask task: write one part atomically (a retried task starts clean)."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    _remove(final)
    try:
        out = _write_part(job, fn, tasks, tmp)
        _fsync_tree(tmp)
        os.rename(tmp, final)
    except BaseException:
        _remove(tmp)
        raise
    return out


def _client(scheduler: Any) -> tuple[Any, bool]:
    try:
        from dask.distributed import Client
    except ImportError:
        raise PackioError("distributed conversion needs Dask: pip install 'packio[dask]'") from None
    if isinstance(scheduler, Client):
        return scheduler, False
    return Client(scheduler), True


def _write_parts(job: _Job, fn: Callable[[Any], Result], tasks: list[Any], root: Path, scheduler: Any,
                 parts: int | None, progress: bool | None, skipped: Counter[str]) -> dict[str, Any]:
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
        futures = [client.submit(_pack_part, job, fn, tasks[a:b], str(root / name), pure=False, retries=2,
                                 key=f"packio-{root.name}-{name}")
                   for (a, b), name in zip(zip(bounds[:-1], bounds[1:]), names)]
        with _progress(k, progress) as bar:
            for _ in as_completed(futures):
                bar.update(1)
        results = client.gather(futures)  # raises the first task error: nothing gets committed
    finally:
        if owned:
            client.close()
    count = sum(r["count"] for r in results)
    for r in results:
        skipped.update(r["skipped"])
    dup = sum(r["duplicate_content"] for r in results)
    manifest = Manifest(format=job.format, count=count, classes=job.classes, image=job.image, source=job.source,
                        extra={"parts": [{"path": n, "count": r["count"]} for n, r in zip(names, results)]},
                        summary={"packed": count, "skipped": dict(skipped), "duplicate_content": dup,
                                 "note": "duplicate_content counts within each part"},
                        files=describe_files(root))
    (root / MANIFEST_NAME).write_text(manifest.to_json())
    return {"count": count, "skipped": dict(skipped), "problems": [p for r in results for p in r["problems"]],
            "duplicate_content": dup}


def _looks_like_shards(src: Path) -> bool:
    from packio.formats.tar import TarReader

    return TarReader.detect_shards(str(src))


def _fsync_tree(root: Path) -> None:
    paths = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
