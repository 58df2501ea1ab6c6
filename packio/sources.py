"""Image folder (class sub-folders or flat) + CSV annotation rows → source items.

The CSV is parsed once here, at pack time; readers never see it again.

Which column labels what: with box columns, ``class`` labels the boxes and
``label`` (if present) the images; without box columns, ``label``, or else
``class``, labels the images (Kaggle ``filename,label`` / ``image_id,class``).
``--csv-columns label=COL`` (or ``--label-column COL``) names the image-label
column explicitly. Default column names are matched case-insensitively, with a
few common aliases (``image_id``, ``path``, ``category``, ...).

Which frame CSV boxes are in: see :func:`boxes_to_stored_frame`.
"""

from __future__ import annotations

import csv
import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from packio import geometry as geo
from packio.errors import SourceError
from packio.sample import is_coord

__all__ = ["SourceItem", "Scan", "parse_columns", "boxes_to_stored_frame", "read_image_file", "scan_source"]

FIELDS = ("filename", "class", "xmin", "ymin", "xmax", "ymax", "label", "width", "height")
BOX_FIELDS = ("xmin", "ymin", "xmax", "ymax")
# Column names tried, in order and ignoring case, for a field the user did not map.
ALIASES = {"filename": ("filename", "file_name", "file", "image_id", "image", "image_name", "img", "path",
                        "fname", "id"),
           "class": ("class", "class_name", "category"), "label": ("label", "target")}
UNLABELLED = "image without a label (no CSV label / class folder; packed with label -1)"


@dataclass
class SourceItem:
    """One input image, with its annotations resolved to class indices."""

    key: str  # path relative to the source root, '/'-separated
    path: str
    label: int = -1
    boxes: list[list[float]] = field(default_factory=list)
    box_labels: list[int] = field(default_factory=list)
    frames: list[tuple[int, int]] = field(default_factory=list)  # per box: the CSV's (width, height), or (0, 0)


@dataclass
class Scan:
    items: list[SourceItem]
    classes: list[str]  # image classes: what labels index
    box_classes: list[str] = field(default_factory=list)  # what box labels index
    skipped: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # "file: reason", one per skip
    info: dict[str, Any] = field(default_factory=dict)
    notes: Counter[str] = field(default_factory=Counter)  # kept, but worth a line in the summary

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        self.problems.append(f"{where}: {reason}" + (f" ({detail})" if detail else ""))


def parse_columns(text: str | None) -> dict[str, str]:
    """``'filename=path,class=cell_type'`` → ``{'filename': 'path', 'class': 'cell_type'}``."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, sep, column = part.partition("=")
        if not sep or not column or name not in FIELDS:
            raise SourceError(
                f"--csv-columns: cannot read {part!r}; write FIELD=COLUMN pairs separated by commas, "
                f"FIELD one of {', '.join(FIELDS)}")
        out[name] = column
    return out


PATH_MAX = 4096  # bytes: longer paths cannot be opened by name on Linux


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a symlink loop
        return False


def _walk(root: Path, scan: Scan, exclude: set[str], follow_symlinks: bool = False) -> list[tuple[str, str]]:
    """(relative key, path) of every regular file, sorted (files of a folder, then its
    sub-folders). Symlinks are followed only where they resolve inside ``root``, unless
    ``follow_symlinks``; a symlinked folder is followed only with ``follow_symlinks``
    (inside ``root`` its files are packed under their own path already). Every entry
    left out is counted in ``scan``. Iterative: no depth limit."""
    found: list[tuple[str, str]] = []
    top = os.path.realpath(root)
    # (key prefix, folder, the folders above it): a followed link to one of those is a loop
    stack: list[tuple[str, str, frozenset[tuple[int, int]]]] = [("", str(root), frozenset())]
    while stack:
        prefix, folder, above = stack.pop()
        try:
            st = os.stat(folder)
            if (st.st_dev, st.st_ino) in above:
                scan.skip("symlink loop (a folder inside itself)", folder)
                continue
            with os.scandir(folder) as it:
                entries = sorted((e.name, e.is_symlink(), _is_dir(e)) for e in it)
        except OSError as exc:
            if folder == str(root):
                raise SourceError(f"{root}: cannot list the folder ({exc.strerror})") from None
            scan.skip("unreadable folder", folder, exc.strerror or "")
            continue
        above = above | {(st.st_dev, st.st_ino)}
        subfolders: list[tuple[str, str, frozenset[tuple[int, int]]]] = []
        for name, link, is_dir in entries:
            full = os.path.join(folder, name)
            if name.startswith("."):
                scan.skip("hidden file or folder (name starts with '.')", full)
                continue
            if exclude and os.path.abspath(full) in exclude:
                continue
            rel = prefix + name
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                scan.skip("file name is not valid UTF-8", os.fsencode(full).decode("utf-8", "replace"))
                continue
            if len(os.fsencode(os.path.abspath(full))) >= PATH_MAX:
                scan.skip(f"path longer than {PATH_MAX - 1} bytes", full[:200] + "...")
                continue
            if link:
                target = os.path.realpath(full)
                if not os.path.exists(full):
                    scan.skip("broken or looping symlink", full)
                    continue
                if not follow_symlinks and not (target == top or target.startswith(top.rstrip(os.sep) + os.sep)):
                    scan.skip("symlink to outside the source (--follow-symlinks packs it)", full, target)
                    continue
                if is_dir and not follow_symlinks:
                    scan.skip("symlinked folder inside the source (packed under its own path; "
                              "--follow-symlinks packs it twice)", full, target)
                    continue
            if is_dir:
                subfolders.append((rel + "/", full, above))
                continue
            try:
                regular = stat.S_ISREG(os.stat(full).st_mode)
            except OSError as exc:
                scan.skip("unreadable file", full, exc.strerror or "")
                continue
            if not regular:  # a FIFO or device would block or never end
                scan.skip("not a regular file", full)
                continue
            found.append((rel, full))
        stack.extend(reversed(subfolders))
    return found


def read_image_file(path: str, max_bytes: int) -> tuple[bytes | None, str, str]:
    """(data, "", "") or (None, skip reason, detail). Never blocks on a FIFO, sniffs the
    first bytes before reading the rest (a huge file that is no image is not read), and
    refuses a file over ``max_bytes`` before reading it (an 8 GiB sparse .jpg)."""
    from packio.decode import sniff

    try:
        with open(path, "rb", opener=_nonblocking) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None, "not a regular file", ""
            if st.st_size == 0:
                return None, "empty file", ""
            head = f.read(64)
            enc = sniff(head)
            if enc is None:
                return None, "not an image", ""
            if enc == "gif":
                return None, "unsupported image type (gif)", ""
            if st.st_size > max_bytes:
                return None, "file too large", f"{st.st_size} bytes, limit {max_bytes}"
            data = head + f.read(st.st_size + 1 - len(head))
    except OSError as exc:
        return None, "unreadable file", exc.strerror or str(exc)
    if len(data) != st.st_size:
        return None, "file changed while being read", ""
    return data, "", ""


def _nonblocking(path: str, flags: int) -> int:
    fd = os.open(path, flags | os.O_NONBLOCK)
    os.set_blocking(fd, True)  # blocking reads again (regular files ignore it; a FIFO is refused)
    return fd


def _resolve_columns(path: Path, header: list[str], columns: dict[str, str]) -> dict[str, str]:
    """Field → CSV column, for the fields this CSV has. Mapped columns must exist."""
    missing = [c for c in columns.values() if c not in header]
    if missing:
        raise SourceError(f"{path}: --csv-columns names {missing}, which the CSV does not have; "
                          f"columns are {header}")
    lower = {h.lower(): h for h in header}
    out = dict(columns)
    for f in FIELDS:
        if f not in out:
            found = next((lower[a] for a in ALIASES.get(f, (f,)) if a in lower), None)
            if found is not None and found not in out.values():
                out[f] = found
    return out


def _read_csv(path: Path, columns: dict[str, str], scan: Scan) -> list[dict[str, Any]]:
    """Parse annotation rows; bad rows are skipped and counted, bad headers raise.

    Each row becomes ``filename``, ``where`` and, when present, ``image_label``,
    ``box`` (xyxy), ``box_class`` and ``frame`` (the CSV's width, height)."""
    try:
        fh = open(path, newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise SourceError(f"{path}: cannot open the CSV ({exc.strerror})") from None
    with fh:
        try:
            reader = csv.DictReader(fh)
            header = reader.fieldnames or []
        except (UnicodeDecodeError, csv.Error) as exc:
            raise SourceError(f"{path}: not a readable UTF-8 CSV ({exc})") from None
        cols = _resolve_columns(path, header, columns)
        if "filename" not in cols:
            raise SourceError(
                f"{path}: no column 'filename' (or image_id, path, ...) for file names; columns are {header}. "
                f"Map yours with --csv-columns filename=COLUMN")
        have_box = [f for f in BOX_FIELDS if f in cols]
        if have_box and len(have_box) != 4:
            missing = [f for f in BOX_FIELDS if f not in cols]
            raise SourceError(
                f"{path}: box columns {missing} are missing; columns are {header}. "
                f"Map them with --csv-columns xmin=...,ymin=...,xmax=...,ymax=...")
        image_col = cols.get("label") or (None if have_box else cols.get("class"))
        box_col = cols.get("class") if have_box else None
        sized = "width" in cols and "height" in cols
        scan.info["csv_columns"] = {f: c for f, c in cols.items() if f in ("filename", "width", "height", *BOX_FIELDS)
                                    or c in (image_col, box_col)}
        scan.info["csv_labels"] = {"images": image_col, "boxes": box_col}
        rows: list[dict[str, Any]] = []
        seen: set[tuple[str, ...]] = set()
        try:
            for n, row in enumerate(reader, start=2):
                where = f"{path}:{n}"
                if None in row or any(v is None for v in row.values()):
                    scan.skip("CSV row with a wrong number of fields", where)
                    continue
                ident = tuple(row[c] for c in header)
                if ident in seen:
                    scan.skip("duplicate CSV row", where)
                    continue
                seen.add(ident)
                out: dict[str, Any] = {"filename": row[cols["filename"]].strip(), "where": where}
                if image_col:
                    out["image_label"] = row[image_col].strip()
                if have_box and any(row[cols[f]].strip() for f in BOX_FIELDS):  # all empty: a row without a box
                    box = _box(row, cols, scan, where)
                    if box is None:
                        continue
                    out["box"] = box
                    out["box_class"] = row[box_col].strip() if box_col else ""
                    frame = _frame(row, cols, scan, where) if sized else (0, 0)
                    if frame is None:
                        continue
                    out["frame"] = frame
                rows.append(out)
        except (UnicodeDecodeError, csv.Error) as exc:
            raise SourceError(f"{path}: not a readable UTF-8 CSV ({exc})") from None
    return rows


def _box(row: dict[str, str], cols: dict[str, str], scan: Scan, where: str) -> list[float] | None:
    try:
        x0, y0, x1, y1 = (float(row[cols[f]]) for f in BOX_FIELDS)
    except ValueError:
        scan.skip("non-numeric box", where, ",".join(row[cols[f]] for f in BOX_FIELDS))
        return None
    if not all(map(is_coord, (x0, y0, x1, y1))) or min(x0, y0, x1, y1) < 0:
        scan.skip("negative or non-finite box", where)
        return None
    if x1 < x0 or y1 < y0:
        scan.skip("inverted box (max < min)", where)
        return None
    return [x0, y0, x1, y1]


def _frame(row: dict[str, str], cols: dict[str, str], scan: Scan, where: str) -> tuple[int, int] | None:
    """The CSV's (width, height) for this row's box; (0, 0) when both cells are empty."""
    cells = row[cols["width"]].strip(), row[cols["height"]].strip()
    if not any(cells):
        return 0, 0
    try:
        w, h = (float(c) for c in cells)
    except ValueError:
        w = h = -1.0
    if not (is_coord(w) and is_coord(h) and w >= 1 and h >= 1 and w == int(w) and h == int(h)):
        scan.skip("bad CSV width/height (not positive integers)", where, ",".join(cells))
        return None
    return int(w), int(h)


def _fits(frame: tuple[int, int], size: tuple[int, int]) -> bool:
    """Is ``frame`` (w, h) ``size`` (w, h) resized, to within a pixel of rounding?"""
    (fw, fh), (w, h) = frame, size
    return abs(fh - fw * h / w) <= 1 or abs(fw - fh * w / h) <= 1


def boxes_to_stored_frame(item: SourceItem, width: int, height: int,
                          orientation: int) -> tuple[np.ndarray, list[str]] | str:
    """The item's CSV boxes in the frame of the image as stored (``width x height``
    before its EXIF ``orientation``), and notes; or why they cannot be placed.

    The rule: a CSV box is in the *upright* frame (what viewers, browsers, annotation
    tools and ``PIL.ImageOps.exif_transpose`` show) unless the CSV's width/height
    say otherwise: equal to the stored size (and not to the upright one) → the
    stored frame; the same shape at another size → a resized copy of that frame,
    scaled back; another shape → the image is skipped (its boxes would be wrong).
    """
    boxes = np.asarray(item.boxes, np.float32).reshape(-1, 4)
    if not len(boxes):
        return boxes, []
    upright = geo.upright_size(orientation, width, height)
    frames = item.frames or [(0, 0)] * len(boxes)
    out, notes = np.empty_like(boxes), set()
    for k, (box, frame) in enumerate(zip(boxes, frames)):
        if frame == (0, 0) or frame == upright:
            src, in_upright = upright, True
        elif frame == (width, height):
            src, in_upright = frame, False
            notes.add("CSV boxes in the stored (not EXIF-upright) frame, told by the CSV's width/height")
        elif _fits(frame, upright) or _fits(frame, (width, height)):
            in_upright = _fits(frame, upright)
            src = upright if in_upright else (width, height)
            notes.add("CSV boxes given for a resized copy (width/height), scaled to the image")
        else:
            return (f"CSV width/height {frame[0]}x{frame[1]} fit neither the image ({width}x{height}) "
                    f"nor its EXIF-upright view ({upright[0]}x{upright[1]})")
        b = geo.resize(box[None], (frame[1], frame[0]), (src[1], src[0])) if frame != (0, 0) else box[None]
        if in_upright and orientation != 1:
            b = geo.orient(b, geo.inverse_orientation(orientation), *upright)
        out[k] = b[0]
    return out, sorted(notes)


def _sort_classes(names: set[str]) -> list[str]:
    """Sorted class names; numerically when all are integers (so '10' comes after '9')."""
    if names and all(n.isdigit() for n in names):
        return sorted(names, key=lambda n: (int(n), n))
    return sorted(names)


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".webp")


def _folder_labels(keys: list[str]) -> dict[str, str]:
    """Key → the name of its folder, when image files (by suffix) sit in two or more
    folder names: a flat or single-folder source (``BCCD/JPEGImages/``) has no image
    classes, and folders holding no images (``Annotations/``) name none."""
    folder = {k: k.rsplit("/", 2)[-2] for k in keys if "/" in k}
    names = {f for k, f in folder.items() if k.lower().endswith(IMAGE_SUFFIXES)}
    return {k: f for k, f in folder.items() if f in names} if len(names) > 1 else {}


def _candidates(root: Path, name: str) -> list[str]:
    """The keys a CSV path with folders may name: itself, and itself read relative to a
    folder above ``root`` (``train/x.jpg`` for the source ``data/train``)."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/"):
        rel = os.path.relpath(name, os.path.abspath(root))
        return [] if rel.startswith("..") else [rel]
    top = Path(os.path.abspath(root)).parts
    out = ["/".join(parts)]
    for k in range(1, min(len(parts), len(top))):
        if tuple(parts[:k]) == top[-k:]:
            out.append("/".join(parts[k:]))
    return out


def _join(root: Path, keys: list[str], rows: list[dict[str, Any]], scan: Scan,
          strict: bool) -> dict[str, list[dict[str, Any]]]:
    """CSV rows per key. A name with folders must name its file (relative to ``root`` or
    to a folder above it); a bare file name (or an id without extension) names the one
    file of that name, only when that name is unique among the files and no other CSV
    path has it (``train/x.jpg`` and ``val/x.jpg`` never both land on one ``x.jpg``)."""
    have = set(keys)
    by_base: dict[str, list[str]] = {}
    by_stem: dict[str, list[str]] = {}
    for rel in keys:
        base = rel.rsplit("/", 1)[-1]
        by_base.setdefault(base, []).append(rel)
        by_stem.setdefault(base.rsplit(".", 1)[0], []).append(rel)
    paths_of_base: dict[str, set[str]] = {}
    for row in rows:
        name = row["filename"].replace("\\", "/")
        paths_of_base.setdefault(name.rsplit("/", 1)[-1], set()).add(name)
    per_image: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        name = row["filename"].replace("\\", "/")
        base, reason = name.rsplit("/", 1)[-1], ""
        if "/" in name:
            found = list(dict.fromkeys(k for k in _candidates(root, name) if k in have))
        elif name in have:
            found = [name]
        else:
            found = by_base.get(base) or ([] if "." in base else by_stem.get(base, []))
            if len(found) == 1 and len(paths_of_base[base]) > 1:
                found = []  # other CSV paths share this file name: which file is meant is unclear
                reason = "CSV file name given with several paths in the CSV (give the path relative to the folder)"
        if len(found) != 1:
            reason = ("CSV row names several files (give the path relative to the folder)" if found
                      else reason or "CSV row for a missing file")
            if strict:
                raise SourceError(f"{row['where']}: names {name!r}: {reason} (--strict)")
            scan.skip(reason, row["where"], name)
            continue
        per_image.setdefault(found[0], []).append(row)
    return per_image


def scan_source(root: str | Path, csv_path: str | Path | None = None, columns: dict[str, str] | None = None,
                *, strict: bool = False, follow_symlinks: bool = False) -> Scan:
    """List an image folder and attach CSV annotations.

    Labels: the name of each image's parent folder (``train/ants/x.jpg`` → ``ants``)
    when the images sit in sub-folders; a CSV image label (see the module doc)
    overrides it; a flat or single-folder source has no folder labels. Box classes
    come from the CSV ``class`` column and get their own list (``box_classes``). Images without CSV rows are kept with no boxes; CSV rows naming no
    image are counted (``strict`` makes them an error); an image without a label in
    a dataset that has labels is counted in ``notes``. A CSV whose rows name none of
    the images is an error. How CSV names find files: see :func:`_join`.
    """
    root = Path(root)
    if not root.is_dir():
        raise SourceError(f"{root}: not a folder. Give a folder of images (class sub-folders or flat)")
    scan = Scan(items=[], classes=[])
    exclude = {os.path.abspath(csv_path)} if csv_path else set()
    files = _walk(root, scan, exclude, follow_symlinks)
    rows = _read_csv(Path(csv_path), columns or {}, scan) if csv_path else []

    per_image = _join(root, [rel for rel, _ in files], rows, scan, strict)
    if rows and not per_image:
        raise SourceError(f"{csv_path}: none of its {len(rows)} rows names an image in {root} "
                          f"(first: {rows[0]['filename']!r}); give file names relative to the folder, "
                          f"or map the file-name column with --csv-columns filename=COLUMN")

    folder_of = _folder_labels([rel for rel, _ in files])
    names = set(folder_of.values()) - {None}
    box_names = set()
    for rs in per_image.values():
        names.update(r["image_label"] for r in rs if r.get("image_label"))
        box_names.update(r["box_class"] for r in rs if r.get("box_class"))
    scan.classes, scan.box_classes = _sort_classes(names), _sort_classes(box_names)
    index = {c: i for i, c in enumerate(scan.classes)}
    box_index = {c: i for i, c in enumerate(scan.box_classes)}
    for rel, full in files:
        rs = per_image.get(rel, [])
        given = {r["image_label"] for r in rs if r.get("image_label")}
        if len(given) > 1:
            if strict:
                raise SourceError(f"{rs[0]['where']}: the CSV gives {rel!r} several labels {sorted(given)} (--strict)")
            scan.skip("CSV gives the image several labels", rs[0]["where"], f"{rel}: {', '.join(sorted(given))}")
            continue
        item = SourceItem(key=rel, path=full)
        label = given.pop() if given else folder_of.get(rel)
        if label:
            item.label = index[label]
        for r in rs:
            if "box" in r:
                item.boxes.append(r["box"])
                item.box_labels.append(box_index[r["box_class"]] if r["box_class"] else -1)
                item.frames.append(r["frame"])
        scan.items.append(item)
    unlabelled = sum(it.label < 0 for it in scan.items)
    # a dataset with no image labels at all (say, boxes only) is not worth a note, unless the CSV has a label column
    if unlabelled and (unlabelled < len(scan.items) or scan.info.get("csv_labels", {}).get("images")):
        scan.notes[UNLABELLED] = unlabelled
    scan.info.update({"files": len(files), "csv_rows": len(rows), "images_with_rows": len(per_image)})
    return scan
