"""Image folder (class sub-folders or flat) + CSV annotation rows → source items.

The CSV is parsed once here, at pack time; readers never see it again.
"""

from __future__ import annotations

import csv
import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packio.errors import SourceError

FIELDS = ("filename", "class", "xmin", "ymin", "xmax", "ymax", "label", "width", "height")
BOX_FIELDS = ("xmin", "ymin", "xmax", "ymax")


@dataclass
class SourceItem:
    """One input image, with its annotations resolved to class indices."""

    key: str  # path relative to the source root, '/'-separated
    path: str
    label: int = -1
    boxes: list[list[float]] = field(default_factory=list)
    box_labels: list[int] = field(default_factory=list)


@dataclass
class Scan:
    items: list[SourceItem]
    classes: list[str]
    skipped: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # "file: reason", one per skip
    info: dict[str, Any] = field(default_factory=dict)

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


def _read_csv(path: Path, columns: dict[str, str], scan: Scan) -> list[dict[str, Any]]:
    """Parse annotation rows; bad rows are skipped and counted, bad headers raise."""
    cols = {f: columns.get(f, f) for f in FIELDS}
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
        if cols["filename"] not in header:
            raise SourceError(
                f"{path}: no column {cols['filename']!r} for file names; columns are {header}. "
                f"Map yours with --csv-columns filename=COLUMN")
        have_box = [f for f in BOX_FIELDS if cols[f] in header]
        if have_box and len(have_box) != 4:
            missing = [cols[f] for f in BOX_FIELDS if cols[f] not in header]
            raise SourceError(
                f"{path}: box columns {missing} are missing; columns are {header}. "
                f"Map them with --csv-columns xmin=...,ymin=...,xmax=...,ymax=...")
        scan.info["csv_columns"] = {f: c for f, c in cols.items() if c in header}
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
                for f in ("class", "label"):
                    if cols[f] in header:
                        out[f] = row[cols[f]].strip()
                if have_box:
                    try:
                        x0, y0, x1, y1 = (float(row[cols[f]]) for f in BOX_FIELDS)
                    except ValueError:
                        scan.skip("non-numeric box", where, ",".join(row[cols[f]] for f in BOX_FIELDS))
                        continue
                    if not all(map(_finite, (x0, y0, x1, y1))) or min(x0, y0, x1, y1) < 0:
                        scan.skip("negative or non-finite box", where)
                        continue
                    if x1 < x0 or y1 < y0:
                        scan.skip("inverted box (max < min)", where)
                        continue
                    out["box"] = [x0, y0, x1, y1]
                rows.append(out)
        except (UnicodeDecodeError, csv.Error) as exc:
            raise SourceError(f"{path}: not a readable UTF-8 CSV ({exc})") from None
    return rows


def _finite(v: float) -> bool:
    return v == v and abs(v) != float("inf")


def scan_source(root: str | Path, csv_path: str | Path | None = None, columns: dict[str, str] | None = None,
                *, strict: bool = False, follow_symlinks: bool = False) -> Scan:
    """List an image folder and attach CSV annotations.

    Labels: the name of each image's parent folder (``train/ants/x.jpg`` → ``ants``)
    when the images sit in sub-folders; a CSV ``label`` column overrides it. Box
    classes come from the CSV ``class`` column. One class list serves both.
    Images without CSV rows are kept with no boxes; CSV rows naming no image are
    counted (``strict`` makes them an error).
    """
    root = Path(root)
    if not root.is_dir():
        raise SourceError(f"{root}: not a folder. Give a folder of images (class sub-folders or flat)")
    scan = Scan(items=[], classes=[])
    exclude = {os.path.abspath(csv_path)} if csv_path else set()
    files = _walk(root, scan, exclude, follow_symlinks)
    rows = _read_csv(Path(csv_path), columns or {}, scan) if csv_path else []

    by_key = {rel: full for rel, full in files}
    by_base: dict[str, list[str]] = {}
    for rel, _ in files:
        by_base.setdefault(rel.rsplit("/", 1)[-1], []).append(rel)
    per_image: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        name = row["filename"].replace("\\", "/")
        rel = name if name in by_key else None
        if rel is None and len(by_base.get(name.rsplit("/", 1)[-1], [])) == 1:
            rel = by_base[name.rsplit("/", 1)[-1]][0]
        if rel is None:
            ambiguous = len(by_base.get(name.rsplit("/", 1)[-1], [])) > 1
            reason = ("CSV row names several files (give the path relative to the folder)" if ambiguous
                      else "CSV row for a missing file")
            if strict:
                raise SourceError(f"{row['where']}: names {name!r}: {reason} (--strict)")
            scan.skip(reason, row["where"], name)
            continue
        per_image.setdefault(rel, []).append(row)

    names: set[str] = set()
    folder_of = {rel: (rel.rsplit("/", 2)[-2] if "/" in rel else None) for rel, _ in files}
    names.update(v for v in folder_of.values() if v)
    for rs in per_image.values():
        names.update(r[f] for r in rs for f in ("class", "label") if r.get(f))
    scan.classes = sorted(names)
    index = {c: i for i, c in enumerate(scan.classes)}
    for rel, full in files:
        item = SourceItem(key=rel, path=full)
        if folder_of[rel]:
            item.label = index[folder_of[rel]]
        for r in per_image.get(rel, []):
            if r.get("label"):
                item.label = index[r["label"]]
            if "box" in r:
                item.boxes.append(r["box"])
                item.box_labels.append(index[r["class"]] if r.get("class") else -1)
        scan.items.append(item)
    scan.info.update({"files": len(files), "csv_rows": len(rows), "images_with_rows": len(per_image)})
    return scan
