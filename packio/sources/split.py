"""The listing of an image folder + CSV made in steps that run apart (Dask tasks), each
step writing its share to a spill folder: whoever drives them holds a few numbers per
chunk, never the listing. The steps give the same listing as ``scan_source``:

1. ``walk_chunk``: one chunk of the walk (a folder's own files, or the whole subtrees of
   a run of sibling folders), in the walk's order; ``read_range``: one byte range of the CSV.
2. ``join_bucket``: files and rows whose stems hash into one bucket, joined as
   ``scan_source`` joins them all (why that gives the same result: ``join.join_stems``).
3. ``finish_chunk``: a chunk's listing columns, with the class lists merged from 2.
4. ``ListingShare.load``: the listing rows ``a:b`` of the whole, for one packed part.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from packio.errors import PackioError, SourceError
from packio.sources.csvrows import Rows, drop_duplicates, read_csv_range
from packio.sources.join import join, join_stems, stem_hashes
from packio.sources.listing import (Listing, box_class_names, box_columns, conflicts, image_folders, image_labels,
                                    label_names, named_files, problem)
from packio.sources.strings import Strings
from packio.sources.walk import Files, Start, walk_part

__all__ = ["Skips", "walk_chunk", "csv_stamp", "read_range", "join_bucket", "finish_chunk", "ListingShare", "share"]

_ROWS = ("line", "image_label", "has_box", "boxes", "box_class")


class Skips:
    """One step's skips: counted, and their problem lines."""

    def __init__(self) -> None:
        self.skipped: Counter[str] = Counter()
        self.problems: list[str] = []
        self.lines: list[int] = []  # of the CSV rows skipped, in order

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        self.problems.append(problem(reason, where, detail))
        line = where.rsplit(":", 1)[-1]
        self.lines.append(int(line) if line.isdigit() else 0)

    def result(self, **more: Any) -> dict[str, Any]:
        return {"skipped": self.skipped, "problems": self.problems, **more}


def _save(path: str, arrays: dict[str, np.ndarray]) -> None:
    """``arrays`` as ``path/NAME.npy``, made under a temporary name (a retried task writes it again)."""
    tmp = f"{path}.{os.getpid()}-{id(arrays):x}.tmp"
    try:
        os.mkdir(tmp)  # not makedirs: a task still running when its conversion failed must not make it again
    except FileNotFoundError:
        raise PackioError(f"{os.path.dirname(path)}: the conversion's temporary output is not there (cancelled, or "
                          f"on a filesystem this Dask worker does not share with the driver); nothing written") from None
    for name, a in arrays.items():
        np.save(os.path.join(tmp, name + ".npy"), np.ascontiguousarray(a), allow_pickle=False)
    if os.path.isdir(path):  # an earlier attempt's, the same
        shutil.rmtree(path, ignore_errors=True)
    try:
        os.rename(tmp, path)
    except OSError:
        if not os.path.isdir(path):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


class _Spill:
    """A spill folder's arrays, mapped (a slice reads only its pages)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __getitem__(self, name: str) -> np.ndarray:
        return np.load(os.path.join(self.path, name + ".npy"), mmap_mode="r", allow_pickle=False)

    def has(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.path, name + ".npy"))

    def strings(self, name: str, a: int | None = None, b: int | None = None) -> Strings:
        """Strings ``a:b`` (a copy), or all of them (mapped)."""
        s = Strings(self[name + "_data"], self[name + "_offsets"])
        return s if a is None else s.slice(a, len(s) if b is None else b)


def _strings(name: str, s: Strings) -> dict[str, np.ndarray]:
    return {name + "_data": s.data, name + "_offsets": s.offsets}


def _bucket_range(spill: _Spill, name: str, b: int, nb: int) -> tuple[int, int]:
    """Where the entries whose hash (sorted, in ``name``) falls in bucket ``b`` of ``nb`` lie."""
    h = spill[name]
    lo, hi = (int(np.searchsorted(h, np.uint64(_bucket_start(k, nb)))) if k < nb else len(h) for k in (b, b + 1))
    return lo, hi


def _bucket_start(b: int, nb: int) -> int:
    """The first 64-bit hash of bucket ``b`` of ``nb`` (buckets: equal hash ranges)."""
    return -(-(b << 64) // nb)


def _by_hash(hashes: np.ndarray, **columns: Any) -> dict[str, np.ndarray]:
    """``columns`` (arrays, or ``Strings`` saved as two arrays) in the order of their sorted
    ``hashes``, the hashes and each entry's place before: a bucket is then one slice of each."""
    order = np.argsort(hashes, kind="stable")
    out = {"hashes": hashes[order], "pos": order}
    for name, col in columns.items():
        out.update(_strings(name, col.take(order)) if isinstance(col, Strings) else {name: col[order]})
    return out


def walk_chunk(root: str, exclude: list[str], follow: bool, starts: list[Start], recursive: bool,
               out: str) -> dict[str, Any]:
    """Step 1: the walk from ``starts`` (see ``walk.walk_part``), spilled to ``out``; returns
    its counts, skips, the names of its folders holding images and the sub-folders left to walk."""
    skips = Skips()
    files, subfolders = walk_part(Path(root), skips.skip, set(exclude), follow, starts, recursive)
    _save(out, {**_strings("keys", files.keys), "folder": files.folder, **_strings("folders", Strings.of(
        files.folders)), **_by_hash(stem_hashes(files.keys), bkeys=files.keys)})
    return skips.result(count=len(files.keys), image_folders=image_folders(files), subfolders=subfolders)


def csv_stamp(csv: str) -> tuple[int, ...]:
    """What tells that the CSV changed: its identity, size and modification time."""
    try:
        st = os.stat(csv)
    except OSError as exc:
        raise SourceError(f"{csv}: cannot open the CSV ({exc.strerror})") from None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def read_range(root: str, csv: str, columns: dict[str, str], span: tuple[int, int, int] | None,
               stamp: tuple[int, ...], out: str) -> dict[str, Any]:
    """Step 1: the CSV's rows in ``span`` (see ``csvrows.read_csv_range``), spilled to ``out`` by
    bucket; ``stamp`` (``csv_stamp`` when the CSV was split) must hold before and after the read:
    a range of a CSV replaced or edited since is no range of rows."""
    skips = Skips()
    if csv_stamp(csv) != tuple(stamp):
        raise SourceError(f"{csv}: the CSV changed during the conversion; run it again once the CSV is written")
    rows, digests, _ = read_csv_range(Path(csv), columns, skips.skip, span)
    if csv_stamp(csv) != tuple(stamp):
        raise SourceError(f"{csv}: the CSV changed during the conversion; run it again once the CSV is written")
    arrays = {name: getattr(rows, name) for name in _ROWS}
    if rows.frames is not None:
        arrays["frames"] = rows.frames
    _save(out, {**_by_hash(join_stems(Path(root), rows.names), **arrays, names=rows.names, digests=digests),
                **_strings("image_names", Strings.of(rows.image_names)),
                **_strings("box_names", Strings.of(rows.box_names))})
    return skips.result(rows=len(rows), first=rows.names[0] if len(rows) else None, frames=rows.frames is not None)


def _take_rows(spill: _Spill, lo: int, hi: int, path: str) -> tuple[Rows, np.ndarray]:
    """Rows ``lo:hi`` of a range's spill in CSV order, and their digests."""
    order = np.argsort(spill["pos"][lo:hi], kind="stable")
    frames = np.asarray(spill["frames"][lo:hi])[order] if spill.has("frames") else None
    cols = [np.asarray(spill[name][lo:hi])[order] for name in _ROWS]
    return Rows(path, spill.strings("names", lo, hi).take(order), *cols, frames,
                list(spill.strings("image_names")), list(spill.strings("box_names"))), \
        np.asarray(spill["digests"][lo:hi])[order]


def _merge_rows(parts: list[Rows], path: str, frames: bool) -> Rows:
    """``parts`` one after another, their label ids made ids into merged name lists."""
    image_names: dict[str, int] = {}
    box_names: dict[str, int] = {}
    image_label, box_class = [], []
    for r in parts:
        for ids, col, names in ((image_names, r.image_label, r.image_names), (box_names, r.box_class, r.box_names)):
            remap = np.asarray([ids.setdefault(n, len(ids)) for n in names] + [-1], np.int32)
            (image_label if ids is image_names else box_class).append(remap[col])
    cat = lambda xs, empty: np.concatenate(xs) if xs else empty  # noqa: E731
    return Rows(path, Strings.concat([r.names for r in parts]), cat([r.line for r in parts], np.zeros(0, np.int32)),
                cat(image_label, np.zeros(0, np.int32)), cat([r.has_box for r in parts], np.zeros(0, bool)),
                cat([r.boxes for r in parts], np.zeros((0, 4), np.float32)), cat(box_class, np.zeros(0, np.int32)),
                cat([r.frames for r in parts], np.zeros((0, 2), np.int32)) if frames else None,
                list(image_names), list(box_names))


def _bucket_keys(chunks: list[str], b: int, nb: int) -> tuple[Strings, np.ndarray, np.ndarray]:
    """The keys of bucket ``b`` from every chunk's spill, with each key's chunk and place in it
    (their order changes no result of the join: a row's hits are one file, or several)."""
    keys, chunk, place = [], [], []
    for c, path in enumerate(chunks):
        spill = _Spill(path)
        lo, hi = _bucket_range(spill, "hashes", b, nb)
        keys.append(spill.strings("bkeys", lo, hi))
        chunk.append(np.full(hi - lo, c, np.int64))
        place.append(np.asarray(spill["pos"][lo:hi]))
    return Strings.concat(keys), np.concatenate(chunk or [np.zeros(0, np.int64)]), \
        np.concatenate(place or [np.zeros(0, np.int64)])


def _bucket_rows(ranges: list[str], csv: str, b: int, nb: int, frames: bool) -> tuple[Rows, np.ndarray]:
    """The CSV rows of bucket ``b`` (in CSV order) and their digests."""
    parts, digests = [], []
    for path in ranges:
        spill = _Spill(path)
        rows, d = _take_rows(spill, *_bucket_range(spill, "hashes", b, nb), csv)
        parts.append(rows)
        digests.append(d)
    return _merge_rows(parts, csv, frames), np.concatenate(digests or [np.zeros((0, 2), np.uint64)])


def join_bucket(root: str, csv: str, strict: bool, b: int, nb: int, chunks: list[str], ranges: list[str],
                frames: bool, out: str) -> dict[str, Any]:
    """Step 2: bucket ``b``'s rows deduplicated and joined to its files, conflicting labels
    found; spilled to ``out`` sorted by chunk. With ``strict``, the first error is returned
    (``error``: an order and its message) for the driver to raise the one the whole would."""
    keys, chunk, place = _bucket_keys(chunks, b, nb)
    rows, digests = _bucket_rows(ranges, csv, b, nb, frames)
    skips, joins = Skips(), Skips()
    rows = drop_duplicates(rows, digests, skips.skip)
    del digests
    file_of = join(Path(root), keys, rows, joins.skip, False)
    if strict and joins.lines:  # the first row that fails: rows are in CSV order
        return {"error": ((0, joins.lines[0]), _raised(lambda: join(Path(root), keys, rows, joins.skip, True)))}
    bad = conflicts(rows, file_of, joins.skip, keys, False)
    if strict and bad.any():  # the first file that fails: in walk order
        fi = min(np.flatnonzero(bad).tolist(), key=lambda f: (int(chunk[f]), int(place[f])))
        return {"error": ((2, int(chunk[fi]), int(place[fi])), _raised(
            lambda: conflicts(rows, np.where(file_of == fi, file_of, -1), joins.skip, keys, True)))}
    sel = np.flatnonzero(file_of >= 0)
    sel = sel[np.argsort(chunk[file_of[sel]], kind="stable")]  # by chunk, then CSV order
    arrays = {name: getattr(rows, name)[sel] for name in _ROWS}
    if rows.frames is not None:
        arrays["frames"] = rows.frames[sel]
    badf = np.flatnonzero(bad)
    badf = badf[np.argsort(chunk[badf], kind="stable")]
    _save(out, {**arrays, "chunk": chunk[file_of[sel]], "place": place[file_of[sel]],
                "bad_chunk": chunk[badf], "bad_place": place[badf], **_strings("image_names", Strings.of(
                    rows.image_names)), **_strings("box_names", Strings.of(rows.box_names))})
    skips.skipped.update(joins.skipped)
    return skips.result(error=None, rows=len(rows), named=named_files(file_of, bad), problems=skips.problems
                        + joins.problems, labels=label_names(rows, file_of), box_classes=box_class_names(rows, file_of))


def _raised(step: Any) -> str:
    """The message of the SourceError that ``step`` raises (its --strict form)."""
    try:
        step()
    except SourceError as exc:
        return str(exc)
    raise AssertionError("a --strict step did not raise")  # pragma: no cover


def _chunk_rows(buckets: list[str], c: int, csv: str, frames: bool, n: int) -> tuple[Rows, np.ndarray, np.ndarray]:
    """Chunk ``c``'s joined rows from every bucket's spill (in CSV order), the file of each
    (its place in the chunk) and the chunk's files with conflicting labels (a mask)."""
    parts, place, bad = [], [], np.zeros(n, bool)
    for path in buckets:
        spill = _Spill(path)
        ch = spill["chunk"]
        lo, hi = int(np.searchsorted(ch, c, "left")), int(np.searchsorted(ch, c, "right"))
        arrays = [np.asarray(spill[name][lo:hi]) for name in _ROWS]
        no_names = Strings(np.zeros(0, np.uint8), np.zeros(hi - lo + 1, np.int64))  # not needed any more
        parts.append(Rows(csv, no_names, *arrays, np.asarray(spill["frames"][lo:hi]) if frames else None,
                          list(spill.strings("image_names")), list(spill.strings("box_names"))))
        place.append(np.asarray(spill["place"][lo:hi]))
        bc = spill["bad_chunk"]
        bad[np.asarray(spill["bad_place"][np.searchsorted(bc, c, "left"):np.searchsorted(bc, c, "right")])] = True
    rows = _merge_rows(parts, csv, frames)
    order = np.argsort(rows.line, kind="stable")
    return rows.take(order), np.concatenate(place or [np.zeros(0, np.int64)])[order], bad


def finish_chunk(root: str, csv: str, c: int, chunk: str, buckets: list[str], named: set[str], classes: list[str],
                 box_classes: list[str], frames: bool, out: str) -> dict[str, Any]:
    """Step 3: chunk ``c``'s listing columns (as ``scan_source`` makes them), spilled to ``out``."""
    spill = _Spill(chunk)
    keys = spill.strings("keys")
    files = Files(keys, np.asarray(spill["folder"]), list(spill.strings("folders")))
    rows, file_of, bad = _chunk_rows(buckets, c, csv, frames, len(keys))
    labels = image_labels(files, rows, file_of, named, classes)
    offsets, boxes, box_labels, box_frames = box_columns(rows, file_of, ~bad, box_classes)
    kept = np.flatnonzero(~bad)
    keys, labels = (keys.take(kept), labels[kept]) if bad.any() else (keys, labels)
    arrays = {**_strings("keys", keys), "labels": labels, "box_offsets": offsets, "boxes": boxes,
              "box_labels": box_labels}
    if box_frames is not None:
        arrays["frames"] = box_frames
    _save(out, arrays)
    return {"count": len(labels), "unlabelled": int((labels < 0).sum())}


@dataclass
class ListingShare:
    """Rows ``a:b`` of the listing whose chunks are spilled at ``chunks`` (with their counts): what one part packs."""

    root: str
    chunks: list[tuple[str, int, int]]  # (spill, first row, end row) of each chunk it takes rows from

    def __len__(self) -> int:
        return sum(b - a for _, a, b in self.chunks)

    def load(self) -> Listing:
        parts = []
        for path, a, b in self.chunks:
            s = _Spill(path)
            offsets = np.asarray(s["box_offsets"][a:b + 1])
            lo, hi = int(offsets[0]), int(offsets[-1])
            parts.append((s.strings("keys", a, b), np.asarray(s["labels"][a:b]), offsets - lo,
                          np.asarray(s["boxes"][lo:hi]), np.asarray(s["box_labels"][lo:hi]),
                          np.asarray(s["frames"][lo:hi]) if s.has("frames") else None))
        return _concat_listing(self.root, parts)


def _concat_listing(root: str, parts: list[tuple[Any, ...]]) -> Listing:
    ends = np.cumsum([0] + [int(p[2][-1]) for p in parts[:-1]])
    offsets = np.concatenate([np.zeros(1, np.int64)] + [p[2][1:] + e for p, e in zip(parts, ends)])
    frames = None if not parts or parts[0][5] is None else np.concatenate([p[5] for p in parts])
    return Listing(root, Strings.concat([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), offsets,
                   np.concatenate([p[3] for p in parts]), np.concatenate([p[4] for p in parts]), frames)


def share(root: str, chunks: list[tuple[str, int]], a: int, b: int) -> ListingShare:
    """The share of rows ``a:b`` of the listing spilled as ``chunks`` (spill, count), in order."""
    out, at = [], 0
    for path, n in chunks:
        lo, hi = max(a - at, 0), min(b - at, n)
        if lo < hi:
            out.append((path, lo, hi))
        at += n
    return ListingShare(root, out)
