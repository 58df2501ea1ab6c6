"""Image folder + CSV → a columnar listing: the tasks a conversion packs, one array entry per image."""

from __future__ import annotations

import os
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from packio.errors import SourceError
from packio.sample import text_key
from packio.sources.csvrows import Rows, read_csv
from packio.sources.join import join
from packio.sources.names import class_name, stored_alike
from packio.sources.strings import CHUNK, Strings, trim_heap
from packio.sources.walk import Files, Skip, walk

__all__ = ["SourceItem", "Listing", "Scan", "scan_source"]

UNLABELLED = "image without a label (no CSV label / class folder; packed with label -1)"


@dataclass
class SourceItem:
    """One input image, with its annotations resolved to class indices (made when packed)."""

    key: str  # path relative to the source root, '/'-separated
    path: str
    label: int = -1
    boxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.float32))
    box_labels: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    frames: list[tuple[int, int]] = field(default_factory=list)  # per box: the CSV's (width, height), or (0, 0)


@dataclass
class Listing:
    """The images to pack as columns: ``listing[i]`` makes the ``SourceItem`` when needed."""

    root: str
    keys: Strings
    labels: np.ndarray  # int32 per image
    box_offsets: np.ndarray  # int64[n + 1]: image i's boxes are rows box_offsets[i]:box_offsets[i + 1]
    boxes: np.ndarray  # float32[m, 4]
    box_labels: np.ndarray  # int32[m]
    frames: np.ndarray | None  # int32[m, 2]; None: the CSV gave no width/height

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            a, b, step = i.indices(len(self))
            if step != 1:
                raise ValueError("a listing slices with step 1 only")
            lo, hi = int(self.box_offsets[a]), int(self.box_offsets[max(a, b)])
            return Listing(self.root, self.keys.slice(a, max(a, b)), self.labels[a:b],
                           self.box_offsets[a:max(a, b) + 1] - lo, self.boxes[lo:hi], self.box_labels[lo:hi],
                           None if self.frames is None else self.frames[lo:hi])
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        key = self.keys[i]
        lo, hi = int(self.box_offsets[i]), int(self.box_offsets[i + 1])
        frames = [(0, 0)] * (hi - lo) if self.frames is None else [(w, h) for w, h in self.frames[lo:hi].tolist()]
        return SourceItem(key, os.path.join(self.root, key), int(self.labels[i]), self.boxes[lo:hi],
                          self.box_labels[lo:hi].astype(np.int64), frames)

    def __iter__(self) -> Iterator[SourceItem]:
        for k in range(0, len(self), CHUNK):
            yield from (self[j] for j in range(k, min(k + CHUNK, len(self))))


@dataclass
class Scan:
    items: Listing
    classes: list[str]  # image classes: what labels index
    box_classes: list[str] = field(default_factory=list)  # what box labels index
    skipped: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # "file: reason", one per skip
    info: dict[str, Any] = field(default_factory=dict)
    notes: Counter[str] = field(default_factory=Counter)  # kept, but worth a line in the summary

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        self.problems.append(problem(reason, where, detail))


def problem(reason: str, where: str, detail: str = "") -> str:
    """A skip's line in the summary's problems (a name's bytes that are not UTF-8 as ``\\xNN``)."""
    return text_key(f"{where}: {reason}" + (f" ({detail})" if detail else ""))


def sort_classes(names: set[str], where: str | Path = "") -> list[str]:
    """Sorted class names (in NFC: :func:`class_name`); numerically when all are integers (so '10'
    comes after '9'). Two folders (or labels) that would be one class as stored are refused."""
    clash = stored_alike(names)
    if clash:
        raise SourceError(f"{where}: the folders (or labels) {clash[0]!r} and {clash[1]!r} would be one class, "
                          f"{class_name(clash[0])!r}, as stored (a name that is not UTF-8 is written with \\xNN "
                          f"escapes); rename one of them")
    names = {class_name(n) for n in names}
    if names and all(n.isdigit() for n in names):
        return sorted(names, key=lambda n: (int(n), n))
    return sorted(names)


def folder_names(files: Files, at_least: int = 2) -> set[str]:
    """Folder names that label images: those of folders holding image files (by suffix),
    when ``at_least`` names do (two: a flat or single-folder source, ``BCCD/JPEGImages``,
    has none). Folders without images (``Annotations/``) name none."""
    return labelling(image_folders(files), at_least)


def image_folders(files: Files) -> set[str]:
    """Names of the (non-root) folders holding image files."""
    return {n for n, img in zip(files.folders, files.with_images) if img and n}


def labelling(names: set[str], at_least: int = 2) -> set[str]:
    """``names`` (of folders holding images), if they label images: when ``at_least`` names do."""
    return names if len({unicodedata.normalize("NFC", n) for n in names}) >= at_least else set()


def _remap(names: list[str], index: dict[str, int]) -> np.ndarray:
    """Lookup array: old id → index in the sorted class list (ids of unused names: -1); id -1 stays -1."""
    out = np.full(len(names) + 1, -1, np.int32)
    out[:-1] = [index.get(class_name(n), -1) for n in names]
    return out  # out[-1] == -1 serves id -1


def conflicts(rows: Rows, file_of: np.ndarray, skip: Skip, keys: Strings, strict: bool) -> np.ndarray:
    """Files the CSV gives two or more labels (skipped and counted), as a bool mask over files."""
    bad = np.zeros(len(keys), bool)
    lab = np.flatnonzero((file_of >= 0) & (rows.image_label >= 0))
    if not len(lab):
        return bad
    f, v = file_of[lab], rows.image_label[lab]
    del lab
    last = np.full(len(keys), -1, np.int32)
    last[f] = v  # one of each file's labels: a file with another one has several
    for fi in np.unique(f[v != last[f]]).tolist():
        first = int(np.flatnonzero(file_of == fi)[0])
        given = sorted({rows.image_names[x] for x in rows.image_label[file_of == fi].tolist() if x >= 0})
        if strict:
            raise SourceError(f"{rows.where(first)}: the CSV gives {keys[fi]!r} several labels {given} (--strict)")
        skip("CSV gives the image several labels", rows.where(first), f"{keys[fi]}: {', '.join(given)}")
        bad[fi] = True
    return bad


def label_names(rows: Rows, file_of: np.ndarray) -> set[str]:
    """The CSV's image labels on rows that name a file."""
    lab = np.flatnonzero((file_of >= 0) & (rows.image_label >= 0))
    return {rows.image_names[x] for x in np.unique(rows.image_label[lab]).tolist()}


def box_class_names(rows: Rows, file_of: np.ndarray) -> set[str]:
    """The CSV's box classes on rows that name a file."""
    sel = np.flatnonzero((file_of >= 0) & rows.has_box)
    return {rows.box_names[x] for x in np.unique(rows.box_class[sel]).tolist() if x >= 0}


def image_labels(files: Files, rows: Rows, file_of: np.ndarray, named: set[str],
                 classes: list[str]) -> np.ndarray:
    """Each file's label: its CSV label, else its folder's name (one of ``folder_names``,
    see :func:`folder_names`), else -1."""
    index = {c: i for i, c in enumerate(classes)}
    lab = np.flatnonzero((file_of >= 0) & (rows.image_label >= 0))
    per_folder = np.asarray([index.get(class_name(n), -1) if n in named else -1 for n in files.folders]
                            + [-1], np.int64)
    labels = per_folder[files.folder].astype(np.int32) if len(files.folder) else np.zeros(0, np.int32)
    labels[file_of[lab]] = _remap(rows.image_names, index)[rows.image_label[lab]]
    return labels


def box_columns(rows: Rows, file_of: np.ndarray, keep: np.ndarray,
                box_classes: list[str]) -> tuple[np.ndarray, ...]:
    """(offsets, boxes, box labels, frames) of the kept files, in CSV row order per file."""
    sel = np.flatnonzero((file_of >= 0) & rows.has_box)
    sel = sel[keep[file_of[sel]]]
    of = file_of[sel]
    if len(of) > 1 and (of[1:] < of[:-1]).any():  # rows not in file order (in order, as usual: no sort)
        sel = sel[np.argsort(of, kind="stable")]
    del of
    counts = np.bincount(file_of[sel], minlength=len(keep))[keep]
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    box_map = _remap(rows.box_names, {c: i for i, c in enumerate(box_classes)})
    return (offsets, rows.boxes[sel], box_map[rows.box_class[sel]],
            None if rows.frames is None else rows.frames[sel])


def _csv_rows(root: Path, csv_path: Path, columns: dict[str, str], files: Files, scan: Scan,
              strict: bool) -> tuple[Rows, np.ndarray]:
    """The CSV's rows and the file each names (-1: none)."""
    rows, info = read_csv(csv_path, columns, scan.skip)
    scan.info.update(info)
    file_of = join(root, files.keys, rows, scan.skip, strict)
    if len(rows) and not (file_of >= 0).any():
        raise SourceError(f"{csv_path}: none of its {len(rows)} rows names an image in {root} "
                          f"(first: {rows.names[0]!r}); give file names relative to the folder, "
                          f"or map the file-name column with --csv-columns filename=COLUMN")
    return rows, file_of


def scan_source(root: str | Path, csv_path: str | Path | None = None, columns: dict[str, str] | None = None,
                *, strict: bool = False, follow_symlinks: bool = False, folder_classes: bool = False) -> Scan:
    """List an image folder and attach CSV annotations, as columns (``Scan.items``).

    Labels: the name of each image's parent folder (``train/ants/x.jpg`` → ``ants``)
    when the images sit in sub-folders; a CSV image label (see ``csvrows``) overrides
    it; a flat or single-folder source has no folder labels, except with ``folder_classes``
    (an append to a labelled dataset) when the CSV gives no image labels: then one folder
    of images is a class too. Box classes come from the
    CSV ``class`` column and get their own list (``box_classes``). Images without CSV
    rows are kept with no boxes; CSV rows naming no image are counted (``strict`` makes
    them an error; which rows name which file: see ``join``); an image without a label
    in a dataset that has labels is counted in ``notes``. A CSV whose rows name none of
    the images is an error.
    """
    root = Path(root)
    if not root.is_dir():
        raise SourceError(f"{root}: not a folder. Give a folder of images (class sub-folders or flat)")
    scan = Scan(items=Listing(str(root), Strings.of([]), *_empty_columns()), classes=[])
    files = walk(root, scan.skip, {os.path.abspath(csv_path)} if csv_path else set(), follow_symlinks)
    trim_heap()  # the walk's sort buffers
    if csv_path:
        rows, file_of = _csv_rows(root, Path(csv_path), columns or {}, files, scan, strict)
    else:
        rows, file_of = Rows.empty(), np.zeros(0, np.int64)
    rows.names = Strings.of([])  # the file names are no longer needed: their memory goes before the columns are made
    bad = conflicts(rows, file_of, scan.skip, files.keys, strict)
    given = label_names(rows, file_of)
    named = folder_names(files, 1 if folder_classes and not given else 2)
    scan.classes = sort_classes(named | given, root)
    labels = image_labels(files, rows, file_of, named, scan.classes)
    keep = ~bad
    scan.box_classes = sort_classes(box_class_names(rows, file_of))
    offsets, boxes, box_labels, frames = box_columns(rows, file_of, keep, scan.box_classes)
    scan.info.update({"files": len(files.keys), "csv_rows": len(rows), "images_with_rows": named_files(file_of, keep)})
    del rows, file_of
    trim_heap()  # the CSV's columns and the join's tables go before the listing's last columns are made
    if bad.any():
        kept = np.flatnonzero(keep)
        keys, labels = files.keys.take(kept), labels[kept]
    else:
        keys = files.keys
    scan.items = Listing(str(root), keys, labels, offsets, boxes, box_labels, frames)
    unlabelled = int((scan.items.labels < 0).sum())
    # a dataset with no image labels at all (say, boxes only) is not worth a note, unless the CSV has a label column
    if unlabelled and (unlabelled < len(scan.items) or scan.info.get("csv_labels", {}).get("images")):
        scan.notes[UNLABELLED] = unlabelled
    del files, bad, keep, labels
    trim_heap()
    return scan


def named_files(file_of: np.ndarray, keep: np.ndarray) -> int:
    """How many files a CSV row names (1 B a file; -1, no file, lands in the extra last slot)."""
    named = np.zeros(len(keep) + 1, bool)
    named[file_of] = True
    return int(np.count_nonzero(named[:-1]))


def _empty_columns() -> tuple[np.ndarray, ...]:
    return np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros((0, 4), np.float32), np.zeros(0, np.int32), None
