"""An image folder's listing made by Dask tasks (``packio.sources.split``): the driver lists
nothing itself and holds a few numbers per chunk and bucket, the class lists and the skips;
the listing lies in spill folders under the conversion's temporary output."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from packio import census
from packio.errors import SourceError
from packio.pack.plan import Source
from packio.sources import split
from packio.sources.csvrows import csv_header, split_csv
from packio.sources.listing import UNLABELLED, labelling, sort_classes
from packio.sources.walk import Start

__all__ = ["split_source", "SplitListing"]

RANGE_BYTES = 32 << 20  # CSV bytes per task
BUCKET_ITEMS = 200_000  # files + rows per join task
CHUNKS_PER_WORKER = 4  # the walk splits folders until it has this many chunks per worker (3 levels at most)
SPILL = ".listing"


class SplitListing:
    """The listing's length and its chunks' spills: ``[a:b]`` is a ``ListingShare`` a task loads."""

    def __init__(self, root: str, chunks: list[tuple[str, int]]) -> None:
        self.root, self.chunks = root, chunks

    def __len__(self) -> int:
        return sum(n for _, n in self.chunks)

    def __getitem__(self, s: slice) -> split.ListingShare:
        a, b, _ = s.indices(len(self))
        return split.share(self.root, self.chunks, a, b)


def _gather(client: Any, futures: list[Any]) -> list[Any]:
    try:
        return client.gather(futures)
    except BaseException:
        client.cancel(futures)
        raise


def _submit(client: Any, fn: Any, *args: Any) -> Any:
    return client.submit(fn, *args, pure=False, retries=2)


def _walk(client: Any, root: Path, exclude: list[str], follow: bool, spill: Path,
          target: int) -> list[tuple[str, dict[str, Any]]]:
    """The walk's chunks in its order: (spill, result). A folder is listed alone (its own files,
    its sub-folders left as chunks of their own) while there are fewer than ``target`` chunks;
    then sibling sub-folders are walked whole, a few to a chunk (about ``target`` chunks)."""
    done: list[tuple[tuple[int, ...], str, dict[str, Any]]] = []
    todo: list[tuple[tuple[int, ...], list[Start], bool]] = [((), [("", str(root), frozenset())], True)]
    for depth in range(4):
        paths = [str(spill / f"walk-{depth}-{k}") for k in range(len(todo))]
        results = _gather(client, [_submit(client, split.walk_chunk, str(root), exclude, follow, starts, not expand,
                                           p) for (_, starts, expand), p in zip(todo, paths)])
        below = []  # per folder listed alone: its order and its sub-folders
        for (order, _, expand), path, r in zip(todo, paths, results):
            done.append((order + (0,) if expand else order, path, r))
            below.append((order, r.pop("subfolders")))
        todo = _next(below, len(done), target, depth < 2)
        if not todo:
            break
    return [(path, r) for _, path, r in sorted(done, key=lambda d: d[0])]


def _next(below: list[tuple[tuple[int, ...], list[Start]]], chunks: int, target: int,
          deeper: bool) -> list[tuple[tuple[int, ...], list[Start], bool]]:
    """The next round's walk tasks: each sub-folder listed alone, or runs of siblings walked whole
    (never runs across two parents: the parent's next sibling's own files come between)."""
    total = sum(len(subs) for _, subs in below)
    if deeper and chunks + total < target:
        return [(order + (j + 1,), [s], True) for order, subs in below for j, s in enumerate(subs)]
    size = max(1, -(-total // max(1, target)))
    return [(order + (j + 1,), subs[j:j + size], False) for order, subs in below for j in range(0, len(subs), size)]


def _read(client: Any, root: Path, csv: str | None, columns: dict[str, str], spill: Path) -> list[Any]:
    """Futures of the CSV's range tasks (one task: a CSV that may hold quoted line ends)."""
    if not csv:
        return []
    stamp = split.csv_stamp(csv)  # before the split: a CSV changed since fails the range tasks
    spans = split_csv(Path(csv), RANGE_BYTES) or [None]
    return [_submit(client, split.read_range, str(root), str(csv), columns, span, stamp, str(spill / f"csv-{k}"))
            for k, span in enumerate(spans)]


def _merge(results: list[dict[str, Any]], skipped: Counter[str], problems: list[str]) -> None:
    for r in results:
        skipped.update(r["skipped"])
        problems.extend(r["problems"])


def _join(client: Any, root: Path, csv: str | None, strict: bool, spill: Path, chunks: list[str],
          ranges: list[str], rows: int, files: int, frames: bool) -> list[dict[str, Any]]:
    """Step 2 on every bucket; with ``strict``, raises the error the whole listing would raise first."""
    if not ranges:  # no CSV: nothing to join
        return []
    nb = max(1, min(1 << 16, -(-(rows + files) // BUCKET_ITEMS)))
    paths = [str(spill / f"join-{b}") for b in range(nb)]
    results = _gather(client, [_submit(client, split.join_bucket, str(root), str(csv or ""), strict, b, nb, chunks,
                                       ranges, frames, p) for b, p in enumerate(paths)])
    errors = [r["error"] for r in results if r["error"]]
    if errors:  # rows naming no file before label conflicts (which mean some row names a file)
        raise SourceError(min(errors)[1])
    for r, p in zip(results, paths):
        r["path"] = p
    return results


def split_source(client: Any, root: Path, csv: str | Path | None, columns: dict[str, str] | None, *, strict: bool,
                 follow_symlinks: bool, spill: Path, workers: int) -> Source:
    """The source ``scan_source`` + ``open_source`` would give, its listing made by Dask tasks
    (spilled under ``spill``, which the caller removes)."""
    if not root.is_dir():
        raise SourceError(f"{root}: not a folder. Give a folder of images (class sub-folders or flat)")
    spill.mkdir()
    columns = columns or {}
    info = dict(csv_header(Path(csv), columns)[1]) if csv else {}
    # the tasks get absolute paths: a worker's working folder is not this process's
    at, csv_at = Path(os.path.abspath(root)), os.path.abspath(csv) if csv else None
    ranges = _read(client, at, csv_at, columns, spill)
    walked = _walk(client, at, [csv_at] if csv_at else [], follow_symlinks, spill, CHUNKS_PER_WORKER * workers)
    read = _gather(client, ranges)
    skipped: Counter[str] = Counter()
    problems: list[str] = []
    _merge([r for _, r in walked] + read, skipped, problems)
    rows, files = sum(r["rows"] for r in read), sum(r["count"] for _, r in walked)
    frames = any(r["frames"] for r in read)  # the CSV has width and height columns
    joined = _join(client, at, csv_at, strict, spill, [p for p, _ in walked],
                   [str(spill / f"csv-{k}") for k in range(len(read))], rows, files, frames)
    _merge(joined, skipped, problems)
    named, kept_rows = sum(r["named"] for r in joined), sum(r["rows"] for r in joined)
    if kept_rows and not named:
        first = next(r["first"] for r in read if r["first"] is not None)
        raise SourceError(f"{csv}: none of its {kept_rows} rows names an image in {root} (first: {first!r}); give "
                          f"file names relative to the folder, or map the file-name column with --csv-columns "
                          f"filename=COLUMN")
    folders = labelling(set().union(*(r["image_folders"] for _, r in walked)))
    classes = sort_classes(folders | set().union(*(r["labels"] for r in joined)), root)
    box_classes = sort_classes(set().union(*(r["box_classes"] for r in joined)))
    finished = _gather(client, [_submit(client, split.finish_chunk, str(at), csv_at or "", c, path,
                                        [r["path"] for r in joined], folders, classes, box_classes, frames,
                                        str(spill / f"list-{c}")) for c, (path, _) in enumerate(walked)])
    info.update({"files": files, "csv_rows": kept_rows, "images_with_rows": named})
    return _source(root, csv, info, SplitListing(str(at), [(str(spill / f"list-{c}"), r["count"]) for c, r in
                                                         enumerate(finished)]), finished, classes, box_classes,
                   skipped, problems)


def _source(root: Path, csv: str | Path | None, info: dict[str, Any], listing: SplitListing,
            finished: list[dict[str, Any]], classes: list[str], box_classes: list[str], skipped: Counter[str],
            problems: list[str]) -> Source:
    notes: Counter[str] = Counter()
    unlabelled = sum(r["unlabelled"] for r in finished)
    if unlabelled and (unlabelled < len(listing) or info.get("csv_labels", {}).get("images")):
        notes[UNLABELLED] = unlabelled
    if not len(listing):
        raise SourceError(f"{root}: no image files found" + (f" ({sum(skipped.values())} entries skipped: "
                          + "; ".join(problems[:3]) + ")" if skipped else "")
                          + "; give a folder holding images (class sub-folders or flat)")
    info = {"path": str(root), "csv": str(csv) if csv else None, **info,
            "csv_unused_text": census.unused_text_columns(csv, info.get("csv_columns"))}
    return Source(root, "image folder", listing, classes, box_classes, info, skipped=skipped, problems=problems,
                  notes=notes)
