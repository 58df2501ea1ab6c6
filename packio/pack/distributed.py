"""A conversion on a Dask cluster: the inputs split into contiguous partitions, each
packed by one task into its own part (under a temporary name beside its final one);
the parts enter the output, under one top manifest, only once all of them are done."""

from __future__ import annotations

import dataclasses
import math
import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np

from packio import census
from packio.errors import PackioError, SourceError
from packio.formats import get_format
from packio.manifest import MANIFEST_NAME, Manifest, describe_files
from packio.pack.append import part_entry
from packio.pack.commit import fsync_tree, remove, temp_name
from packio.pack.prepare import Result
from packio.pack.report import image_facts
from packio.pack.workers import progress_bar
from packio.pack.write import Job, write_part
from packio.sources.split import ListingShare

__all__ = ["write_parts", "client_for"]


def _pack_part(job: Job, fn: Callable[[Any], Result], tasks: list[Any], path: str) -> dict[str, Any]:
    """One Dask task: write one part under a temporary name beside its final one. The
    driver commits the returned temporary; those of killed attempts it removes."""
    final = Path(path)
    if not final.parent.is_dir():
        raise PackioError(f"{final.parent}: the conversion's output is gone (cancelled); nothing written")
    tmp = temp_name(final)
    try:
        out = write_part(job, fn, tasks.load() if isinstance(tasks, ListingShare) else tasks, tmp)
        fsync_tree(tmp)
    except BaseException:
        remove(tmp)
        raise
    return {**out, "tmp": tmp.name}


def client_for(scheduler: Any) -> tuple[Any, bool]:
    """A Dask client for ``scheduler`` (an address, a Client or a cluster), and whether it is ours to close."""
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


def write_parts(job: Job, fn: Callable[[Any], Result], tasks: list[Any], root: Path, scheduler: Any,
                parts: int | None, progress: bool | None, skipped: Counter[str],
                notes: Counter[str]) -> dict[str, Any]:
    """Pack contiguous partitions as Dask tasks into ``root/part-NNNNN<suffix>``,
    then write the top manifest that lists them (only when every part is done)."""
    names, results, nworkers = _run_parts(job, fn, tasks, root, scheduler, parts, progress)
    for name, r in zip(names, results):  # parts enter the output only under their final names
        os.rename(root / r.pop("tmp"), root / name)
    for p in root.iterdir():
        if p.name not in names:  # temporaries of attempts on workers that died
            remove(p)
    count = sum(r["count"] for r in results)
    for r in results:
        skipped.update(r["skipped"])
        notes.update(r["notes"])
    if job.strict and skipped:  # the listing's skips (a part's own raised in it), as one process tells them
        raise SourceError(f"{sum(skipped.values())} inputs were skipped (--strict): ")
    dup = sum(r["duplicate_content"] for r in results)
    done = sum((Counter(r["done"]) for r in results), Counter())
    stored = sum((Counter(r["stored"]) for r in results), Counter())
    jpeg = any(r["jpeg_encoded"] for r in results)
    manifest = Manifest(format=job.format, count=count, classes=job.classes, box_classes=job.box_classes,
                        image=image_facts(job.image, done, stored, jpeg),
                        source=job.source,
                        extra={"parts": [part_entry(n, r["manifest"]) for n, r in zip(names, results)]},
                        summary={"packed": count, "skipped": dict(skipped), "duplicate_content": dup,
                                 "notes": dict(notes), "note": "duplicate_content counts within each part",
                                 "annotations": census.merge([r["annotations"] for r in results])},
                        files=describe_files(root), id=uuid.uuid4().hex)
    (root / MANIFEST_NAME).write_text(manifest.to_json())
    return {"count": count, "skipped": dict(skipped), "notes": dict(notes),
            "problems": [p for r in results for p in r["problems"]],
            "duplicate_content": dup, "done": dict(done), "manifest": manifest,
            "workers": f"{len(names)} parts on {nworkers} Dask worker{'s' if nworkers != 1 else ''}"}


def _run_parts(job: Job, fn: Callable[[Any], Result], tasks: list[Any], root: Path, scheduler: Any,
               parts: int | None, progress: bool | None) -> tuple[list[str], list[dict[str, Any]], int]:
    """The parts' final names, what each task returned (in that order) and the Dask workers
    counted; the first task error is raised and the other tasks cancelled."""
    from dask.distributed import as_completed

    client, owned = client_for(scheduler)
    try:
        nworkers = max(1, len(client.scheduler_info().get("workers", {})))
        k = max(1, min(parts or 4 * nworkers, len(tasks) or 1))
        bounds = np.linspace(0, len(tasks), k + 1).astype(int)
        suffix = get_format(job.format).suffixes[0]
        root.mkdir(parents=True, exist_ok=True)  # the listing's spills may be there
        names = [f"part-{i:05d}{suffix}" for i in range(k)]
        at = Path(os.path.abspath(root))  # a worker's working folder is not this process's
        futures = [client.submit(_pack_part, _part_job(job, a, b), fn, tasks[a:b], str(at / name), pure=False,
                                 retries=2, key=f"packio-{root.name}-{name}")
                   for (a, b), name in zip(zip(bounds[:-1], bounds[1:]), names)]
        try:
            with progress_bar(k, progress) as bar:
                for _ in as_completed(futures):
                    bar.update(1)
            results = client.gather(futures)  # raises the first task error: nothing gets committed
        except BaseException:
            client.cancel(futures)
            raise
    finally:
        if owned:
            client.close()
    return names, results, nworkers


def _part_job(job: Job, a: int, b: int) -> Job:
    """The job of the part packing inputs ``a:b``: its share of the planned tar shards, its
    first member key ``a`` (no part packs more samples than inputs: keys unique across parts)."""
    o, count = job.write_options, b - a
    share = max(1, math.ceil(o.shards * count / max(o.expected, 1))) if o.shards else 0
    return dataclasses.replace(job, write_options=dataclasses.replace(o, shards=share, expected=count,
                                                                      first_key=int(a)))
