"""One part written by this process: every input prepared (here or in local worker
processes), each stored sample handed to the format's writer, then the part's manifest
(counts, skips, encodings, annotations): a complete, self-describing dataset."""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from packio import census
from packio.errors import SourceError
from packio.formats import get_format
from packio.formats.base import WriteOptions
from packio.manifest import Manifest
from packio.pack.prepare import Result, Skipped
from packio.pack.report import image_facts
from packio.pack.workers import progress_bar, results
from packio.sample import Sample, checksum, text_key

__all__ = ["Job", "write_part"]


@dataclass(frozen=True)
class Job:
    """What every part of one conversion shares."""

    format: str
    write_options: WriteOptions  # what the format's writer gets
    classes: list[str]
    box_classes: list[str] | None  # None: a source packed before box_classes, whose box labels index classes
    image: dict[str, Any]
    source: dict[str, Any]
    strict: bool


def write_part(job: Job, fn: Callable[[Any], Result], tasks: list[Any], path: Path, *,
               workers: int | str = 0, progress: bool | None = False, skipped: Counter[str] | None = None,
               notes: Counter[str] | None = None) -> dict[str, Any]:
    """Write ``tasks`` as one complete, self-describing dataset at ``path``."""
    spec = get_format(job.format)
    skipped = Counter(skipped or {})
    notes = Counter(notes or {})
    problems: list[str] = []
    writer = spec.writer(path, job.write_options)
    # each sample's checksum (xxh3-64), room made once (a growing array's copies stayed resident):
    # duplicates counted in numpy at the end
    sums, n_sums = np.empty(len(tasks), np.uint64), 0
    done: Counter[str] = Counter()  # "jpeg kept", "bmp→jpeg", ...
    stored: Counter[str] = Counter()  # encodings stored
    jpeg_encoded = False  # whether this step encoded any JPEG (the manifest then records the quality)
    chosen: dict[str, Any] = {}
    tally = census.Tally()
    try:
        with progress_bar(len(tasks), progress) as bar:
            for r in results(fn, tasks, workers, chosen):
                bar.update(1)
                r = _named(r, job)
                if isinstance(r, Skipped):
                    if job.strict:
                        raise SourceError(f"{r.where}: {r.reason} (--strict)")
                    skipped[r.reason] += 1
                    problems.append(text_key(f"{r.where}: {r.reason}"))
                    continue
                sample = r.sample
                sums[n_sums] = _sum64(sample)
                n_sums += 1
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
    dup = n_sums - len(np.unique(sums[:n_sums]))
    manifest = Manifest(format=job.format, count=writer.count, id=uuid.uuid4().hex, classes=job.classes,
                        box_classes=job.box_classes,
                        image=image_facts(job.image, done, stored, jpeg_encoded), source=job.source, extra=extra,
                        summary={"packed": writer.count, "skipped": dict(skipped), "duplicate_content": dup,
                                 "notes": dict(notes), "annotations": tally.to_json(job.classes, job.box_classes)})
    writer.write_manifest(manifest)
    return {"count": writer.count, "skipped": dict(skipped), "problems": problems, "duplicate_content": dup,
            "notes": dict(notes), "done": dict(done), "stored": dict(stored), "jpeg_encoded": jpeg_encoded,
            "workers": chosen.get("workers"), "manifest": manifest, "annotations": manifest.summary["annotations"]}


def _named(r: Result, job: Job) -> Result:
    """``r``, or a skip when its label or a box label names no class of the output (a
    stranger's label outside its class list): a stored label always has a name."""
    if isinstance(r, Skipped):
        return r
    s, boxed = r.sample, len(job.classes if job.box_classes is None else job.box_classes)
    if not -1 <= s.label < len(job.classes):
        return Skipped("label outside the class list (it names no class)", f"{r.where} (label {s.label}, "
                       f"{len(job.classes)} classes)")
    if len(s.box_labels) and not (-1 <= int(np.min(s.box_labels)) and int(np.max(s.box_labels)) < boxed):
        return Skipped("box label outside the class list (it names no class)",
                       f"{r.where} (box labels {np.asarray(s.box_labels).tolist()[:8]}, {boxed} classes)")
    return r


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
