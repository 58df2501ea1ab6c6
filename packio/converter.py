"""convert(src, dst): an image folder (+ CSV) or any packed dataset → any format.

Inputs are read, checked and (optionally) resized in worker processes; the main
process writes. The output is built under a temporary name beside ``dst`` and
renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import multiprocessing
import os
import shutil
import signal
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from packio import decode as dec
from packio.errors import FormatError, OutputBusyError, OutputExistsError, PackioError, SourceError
from packio.formats import format_for_path, get_format, open_reader
from packio.formats import base as formats_base
from packio.formats.base import FormatSpec, Reader, WriteOptions
from packio.manifest import MANIFEST_NAME, Manifest, describe_files
from packio.sample import Sample, checksum
from packio.sources import SourceItem, scan_source

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


Result = tuple[Sample | None, str, str]  # (sample, skip reason, where)


def _finish(prep: _Prep, s: Sample, where: str) -> Result:
    """Re-encode / resize a sample for the target payload kind."""
    limit = formats_base.MAX_BOXES  # the readers' limit: such a record could never be read back
    if len(s.boxes) > limit:
        return None, f"more than {limit} boxes in one image", f"{where} ({len(s.boxes)} boxes)"
    if not prep.resize.active and (
            (prep.payload == "encoded" and s.encoding != "raw") or (prep.payload == s.encoding)):
        return s, "", where
    if isinstance(s.payload, np.ndarray):
        img = s.payload
    else:
        try:
            img = dec.decode(s.payload, apply_exif=True)
        except ValueError as exc:
            return None, "corrupt image data", f"{where} ({exc})"
    boxes, box_labels = s.boxes, s.box_labels
    if prep.resize.active:
        img, boxes, keep = dec.apply_spec(img, boxes, prep.resize)
        boxes, box_labels = boxes[keep], box_labels[keep]
    if prep.payload == "raw":
        payload, enc = img, "raw"
    elif prep.payload == "bmp":
        payload, enc = dec.encode(img, "bmp"), "bmp"
    elif prep.resize.active:
        payload, enc = dec.encode(img, "jpeg", prep.quality), "jpeg"
    else:  # raw pixels into an encoded format, no resize asked: keep them lossless
        payload, enc = dec.encode(img, "png"), "png"
    out = Sample(key=s.key, payload=payload, encoding=enc, label=s.label, boxes=boxes,
                 box_labels=box_labels, width=img.shape[1], height=img.shape[0], meta=s.meta)
    out.checksum = checksum(out.payload)
    return out, "", where


def _prepare_file(prep: _Prep, item: SourceItem) -> Result:
    try:
        with open(item.path, "rb") as f:
            data = f.read()
    except OSError as exc:
        return None, "unreadable file", f"{item.path} ({exc.strerror})"
    if not data:
        return None, "empty file", item.path
    enc = dec.sniff(data)
    if enc is None:
        return None, "not an image", item.path
    if enc == "gif":
        return None, "unsupported image type (gif)", item.path
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
    if s.checksum and checksum(s.payload) != s.checksum:  # never launder damage into a fresh checksum
        return None, "corrupt sample in the source dataset", f"#{index} {s.key} (checksum mismatch)"
    return _finish(prep, s, s.key)


_WORKER_FN: Callable[[Any], Result] | None = None  # set once in each pool process by _init_worker


def _init_worker(fn: Callable[[Any], Result]) -> None:
    global _WORKER_FN
    _WORKER_FN = fn


def _call(task: Any) -> Result:
    assert _WORKER_FN is not None, "pool process started without _init_worker"
    return _WORKER_FN(task)


def _results(fn: Callable[[Any], Result], tasks: list[Any], workers: int) -> Iterator[Result]:
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
            max_pixels: int = dec.MAX_PIXELS, scheduler: Any = None, parts: int | None = None,
            follow_symlinks: bool = False) -> Summary:
    """Pack ``src`` (image folder + optional CSV, or a packed dataset) into ``dst``.

    The format comes from ``format`` or ``dst``'s suffix. Bad inputs are skipped
    and counted in the returned Summary; ``strict=True`` turns any skip into a
    ``SourceError``. ``dst`` appears only when complete.

    ``workers=N``: N local processes read and check inputs; one process writes.
    ``scheduler``: a Dask scheduler address (``"tcp://host:8786"``), ``Client`` or
    cluster: the listing is split into ``parts`` contiguous partitions, each packed
    by one task into its own part; the parts are committed under one manifest once
    all of them are complete (needs ``pip install 'packio[dask]'``).

    ``dst`` may not be, hold or lie inside ``src``; a lock beside it makes a second
    conversion to the same path fail at once. ``overwrite`` replaces only a packio
    dataset, atomically. Symlinks in ``src`` are followed only where they stay inside
    it, unless ``follow_symlinks``; every skipped entry is counted. SIGTERM / SIGHUP
    remove the temporary output as Ctrl-C does.
    """
    t0 = time.perf_counter()
    src, dst = Path(src), Path(str(dst).rstrip("/"))
    spec: FormatSpec = get_format(format) if format else format_for_path(dst)
    resize = resize or dec.ResizeSpec()
    if not 1 <= quality <= 100:
        raise PackioError(f"JPEG quality must be 1..100, got {quality}")
    if spec.needs_fixed_shape and resize.fixed_shape is None:
        raise PackioError(f"the {spec.name} format stores one image shape: give --size HxW, "
                          f"or --short-side N with --crop HxW")
    packed_src = (src / MANIFEST_NAME).is_file() or src.is_file() or _looks_like_shards(src)
    if not packed_src and not src.exists():
        raise SourceError(f"{src}: no such file or folder")
    _check_paths(src, dst, csv)
    _check_output(dst, overwrite)
    if not dst.parent.is_dir():
        raise PackioError(f"{dst.parent}: the output's folder does not exist; create it first")
    with _terminate_cleanly(), _output_lock(dst):
        _check_output(dst, overwrite)  # again, under the lock
        return _convert(src, dst, spec, resize, packed_src, t0, csv=csv, columns=columns, workers=workers,
                        strict=strict, quality=quality, overwrite=overwrite, shard_samples=shard_samples,
                        shard_bytes=shard_bytes, progress=progress, max_pixels=max_pixels, scheduler=scheduler,
                        parts=parts, follow_symlinks=follow_symlinks)


def _convert(src: Path, dst: Path, spec: FormatSpec, resize: dec.ResizeSpec, packed_src: bool, t0: float, *,
             csv: str | Path | None, columns: dict[str, str] | None, workers: int, strict: bool, quality: int,
             overwrite: bool, shard_samples: int, shard_bytes: int, progress: bool | None, max_pixels: int,
             scheduler: Any, parts: int | None, follow_symlinks: bool) -> Summary:
    """convert() once its arguments are checked and the output is locked."""
    summary = Summary(output=str(dst), format=spec.name)
    payload = spec.payload_for(resize.fixed_shape)
    if packed_src:
        reader = open_reader(src)
        classes = list(reader.manifest.classes)
        tasks: list[Any] = list(range(len(reader)))
        fn = functools.partial(_prepare_packed, _Prep(payload, resize, quality, max_pixels, reader))
        source_info: dict[str, Any] = {"path": str(src), "packed_format": reader.manifest.format}
    else:
        scan = scan_source(src, csv, columns, strict=strict, follow_symlinks=follow_symlinks)
        summary.skipped.update(scan.skipped)
        summary.problems += scan.problems
        classes, tasks = scan.classes, scan.items
        fn = functools.partial(_prepare_file, _Prep(payload, resize, quality, max_pixels))
        source_info = {"path": str(src), "csv": str(csv) if csv else None, **scan.info}
    image = {"payload": payload, "resize": resize.to_json() if resize.active else None,
             "quality": quality if resize.active else None,
             "shape": list(resize.fixed_shape) + [3] if resize.fixed_shape else None}
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
        _commit(tmp, dst, overwrite)
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
    """A packio dataset: a folder whose manifest parses, or an HDF5 file with packio's manifest."""
    try:
        if path.is_dir():
            Reader.read_manifest(path)
            return True
        if path.is_file():
            with open(path, "rb") as f:
                if f.read(8) != b"\x89HDF\r\n\x1a\n":
                    return False
            get_format("hdf5").reader.read_manifest(path)
            return True
    except (FormatError, OSError):
        pass
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
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise PackioError(f"{path}: cannot create the output's lock file ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputBusyError(f"{dst}: another packio conversion is writing it now (it holds {path}); "
                                  f"wait for it to finish, or choose another output") from None
        try:  # the file on disk, not one its last holder removed after we opened it
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
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
    manifest = Manifest(format=job.format, count=writer.count, id=uuid.uuid4().hex, classes=job.classes,
                        image=job.image, source=job.source, extra=extra,
                        summary={"packed": writer.count, "skipped": dict(skipped), "duplicate_content": dup})
    writer.write_manifest(manifest)
    return {"count": writer.count, "skipped": dict(skipped), "problems": problems, "duplicate_content": dup}


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
    dup = sum(r["duplicate_content"] for r in results)
    manifest = Manifest(format=job.format, count=count, classes=job.classes, image=job.image, source=job.source,
                        extra={"parts": [{"path": n, "count": r["count"]} for n, r in zip(names, results)]},
                        summary={"packed": count, "skipped": dict(skipped), "duplicate_content": dup,
                                 "note": "duplicate_content counts within each part"},
                        files=describe_files(root), id=uuid.uuid4().hex)
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
