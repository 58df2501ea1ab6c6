"""convert(src, dst): an image folder (+ CSV) or any packed dataset → any format.

Inputs are read, checked and (optionally) resized in worker processes; the main
process writes. The output is built under a temporary name beside ``dst`` and
renamed into place only when complete. One job per module: ``plan`` (the request
checked, the source opened, the job planned), ``prepare`` (one input → the sample to
store), ``workers`` (local processes), ``write`` (one part and its manifest),
``distributed`` (Dask parts), ``commit`` (lock, signals, atomic commit) and ``report``
(the summary and the recorded history).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from packio.errors import PackioError, SourceError
from packio.formats.reader import Reader
from packio.options import PackOptions, merge_options
from packio.pack.append import (Relabeled, check_keys, commit_part, existing, first_key, merge_names, part_name,
                                stored_options, unlabelled)
from packio.pack.commit import check_output, output_lock, remove, staged, temp_name, terminate_cleanly
from packio.pack.distributed import client_for, write_parts
from packio.pack.plan import Source, check_request, declared_shape, open_source, output_format, plan, readable_csv
from packio.pack.prepare import Packed, Result, Skipped
from packio.pack.report import Summary, summarize
from packio.pack.split_listing import SPILL, split_source
from packio.pack.write import Job, write_part
from packio.sources.names import case_notes

__all__ = ["Summary", "convert", "Packed", "Skipped", "output_format"]


def convert(src: str | Path | Reader, dst: str | Path, *, options: PackOptions | None = None,
            csv: str | Path | None = None, columns: dict[str, str] | None = None, workers: int | str = "auto",
            strict: bool = False, overwrite: bool = False, progress: bool | None = None, scheduler: Any = None,
            parts: int | None = None, follow_symlinks: bool = False, append: bool = False, **fields: Any) -> Summary:
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

    ``workers``: ``"auto"`` (time the first inputs, then use processes only when they pay off),
    or N local processes reading and checking inputs; one process writes. ``scheduler``: a Dask
    address (``"tcp://host:8786"``), ``Client`` or cluster (``packio[dask]``): Dask tasks list an
    image folder, then pack ``parts`` partitions, committed under one manifest when all are done.

    ``check``: a JPEG that libjpeg decodes only with warnings (garbage entropy data, a
    cut scan) is skipped and counted as "corrupt image data" wherever it is decoded
    strictly. ``"auto"`` (default): images decoded anyway (to resize, re-encode or turn
    upright) are decoded strictly, at no extra cost; images stored as found get the
    header checks only. ``"decode"``: every image is decoded strictly, stored as found
    or not (costs a decode per image). ``"header"``: headers and JPEG end markers only,
    lenient decoding (a damaged image is re-encoded with made-up pixels).
    ``max_pixels`` defaults to ``packio.limits.MAX_PIXELS``.

    ``dst`` may not be, hold or lie inside ``src``; a lock beside it makes a second conversion
    to the same path fail at once. ``overwrite`` replaces only a packio dataset, atomically.
    Symlinks in ``src`` are followed only where they stay inside it, unless ``follow_symlinks``;
    every skipped entry is counted. SIGTERM / SIGHUP remove the temporary output as Ctrl-C does.
    ``append=True`` adds ``src`` to the folder dataset ``dst`` as one more part (:mod:`.append`).
    """
    options, t0 = merge_options(PackOptions, options, fields, "convert"), time.perf_counter()
    src, dst, spec, packed = check_request(src, dst, options, csv=csv, columns=columns, workers=workers, parts=parts,
                                           overwrite=overwrite, append=append, scheduler=scheduler)
    with terminate_cleanly(), output_lock(dst), readable_csv(csv, dst) as at:  # a piped CSV: read once, here
        if append:
            return _append(src, dst, options, packed, at, columns, strict, follow_symlinks, workers, progress, t0, csv)
        check_output(dst, overwrite)  # again, under the lock
        if scheduler is not None and not packed:
            return _split(src, dst, spec, options, at, columns, strict, follow_symlinks, progress, scheduler, parts,
                          overwrite, t0, csv)
        source = _noted(open_source(src, packed, at, columns, strict=strict, follow_symlinks=follow_symlinks), at, csv)
        job, fn = plan(spec, options, source, strict)
        with staged(dst, overwrite) as tmp:  # committed to dst when the block ends, removed if it fails
            part = _write(job, fn, source, tmp, workers=workers, progress=progress, scheduler=scheduler, parts=parts)
        return summarize(dst, spec.name, source.problems, part, t0)


def _split(src: Path, dst: Path, spec: Any, options: PackOptions, csv: str | Path | None,
           columns: dict[str, str] | None, strict: bool, follow_symlinks: bool, progress: bool | None, scheduler: Any,
           parts: int | None, overwrite: bool, t0: float, given_csv: str | Path | None) -> Summary:
    """An image folder packed by Dask tasks, its listing made by them too (:mod:`packio.pack.split_listing`)."""
    client, owned = client_for(scheduler)
    try:
        with staged(dst, overwrite) as tmp:  # the listing spills inside: they go with it, on commit or failure
            tmp.mkdir()
            workers = max(1, len(client.scheduler_info().get("workers", {})))
            source = _noted(split_source(client, src, csv, columns, strict=strict, follow_symlinks=follow_symlinks,
                                         spill=tmp.absolute() / SPILL, workers=workers), csv, given_csv)
            job, fn = plan(spec, options, source, strict)
            part = _write(job, fn, source, tmp, workers=0, progress=progress, scheduler=client, parts=parts)
        return summarize(dst, spec.name, source.problems, part, t0)
    finally:
        if owned:
            client.close()


def _given(source: Source, at: str | Path | None, csv: str | Path | None) -> Source:
    """``source``, its record and problems naming the CSV given, not the copy of a piped one."""
    if at != csv:
        source.info["csv"] = str(csv)
        source.problems[:] = [p.replace(str(at), str(csv)) for p in source.problems]
    return source


def _noted(source: Source, at: str | Path | None, csv: str | Path | None) -> Source:
    """``source`` with a note for each group of its class names that differ only in case,
    naming the CSV given (see :func:`_given`)."""
    _given(source, at, csv)
    source.notes.update(case_notes(source.classes) + case_notes(source.box_classes or [], what="box class"))
    return source


def _write(job: Job, fn: Callable[[Any], Result], source: Source, tmp: Path, *, workers: int | str,
           progress: bool | None, scheduler: Any, parts: int | None) -> dict[str, Any]:
    """The output written at ``tmp``: by this process (with local workers), or as Dask parts."""
    skipped, notes = Counter(source.skipped), Counter(source.notes)
    if scheduler is None:
        part = write_part(job, fn, source.tasks, tmp, workers=workers, progress=progress, skipped=skipped, notes=notes)
    else:
        part = write_parts(job, fn, source.tasks, tmp, scheduler, parts, progress, skipped, notes)
    if not part["count"]:
        raise SourceError(f"{source.path}: none of its {len(source.tasks)} inputs could be packed ("
                          + "; ".join(f"{n} {r}" for r, n in sorted(part["skipped"].items()))
                          + "); nothing was written")
    return part


def _append(src: Path | Reader, dst: Path, options: PackOptions, packed: bool, csv: str | Path | None,
            columns: dict[str, str] | None, strict: bool, follow_symlinks: bool, workers: int | str,
            progress: bool | None, t0: float, given_csv: str | Path | None) -> Summary:
    """Pack ``src`` as one more part of the dataset at ``dst`` (see packio.pack.append)."""
    old = existing(dst)
    options = stored_options(dst, old, options)
    # the target's rule: where it has classes, the source's folders are classes, even one
    source = open_source(src, packed, csv, columns, strict=strict, follow_symlinks=follow_symlinks,
                         folder_classes=bool(old.classes))
    _given(source, csv, given_csv)
    unlabelled(source, dst, old)
    classes, label_ids = merge_names(old.classes, source.classes)
    box_classes, box_ids = None, label_ids  # box labels index the classes, in both
    if old.box_classes is not None or source.box_classes is not None:
        box_classes, box_ids = merge_names(old.box_class_names(), source.box_classes
                                           if source.box_classes is not None else source.classes)
    source = dataclasses.replace(source, classes=classes, box_classes=box_classes,
                                 shape=declared_shape(old) or source.shape)
    source.notes.update(case_notes(classes, since=len(old.classes)) + case_notes(
        box_classes or [], since=len(old.box_class_names()), what="box class"))  # the clashes this append makes
    job, fn = plan(output_format(dst, old.format), options, source, strict)
    job = dataclasses.replace(job, write_options=dataclasses.replace(job.write_options, first_key=first_key(old)))
    name = part_name(dst, old)
    tmp = temp_name(dst / name)
    try:
        part = _write(job, Relabeled(fn, label_ids, box_ids), source, tmp, workers=workers, progress=progress,
                      scheduler=None, parts=None)
        check_keys(dst, tmp)
        part["manifest"] = commit_part(dst, old, tmp, name, part)
    except OSError as exc:
        remove(tmp)
        raise PackioError(f"{dst}: appending failed ({exc.strerror or exc}); the dataset is as it was") from None
    except BaseException:
        remove(tmp)
        raise
    summary = summarize(dst, old.format, source.problems, part, t0)
    summary.info["appended"] = f"{name}: the dataset now holds {part['manifest'].count} samples in " \
                               f"{len(part['manifest'].extra['parts'])} parts"
    return summary
