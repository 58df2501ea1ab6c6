"""CSV annotation rows → columns (numpy arrays and one string buffer), parsed once at pack time.

Which column labels what: with box columns, ``class`` labels the boxes and
``label`` (if present) the images; without box columns, ``label``, or else
``class``, labels the images (Kaggle ``filename,label`` / ``image_id,class``).
``--csv-columns label=COL`` (or ``--label-column COL``) names the image-label
column explicitly. Default column names are matched case-insensitively, with a
few common aliases (``image_id``, ``path``, ``category``, ...).
"""

from __future__ import annotations

import csv
import io
import os
import stat
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from packio.errors import SourceError
from packio.sample import is_coord
from packio.sources.strings import Strings, StringsBuilder

__all__ = ["FIELDS", "Rows", "parse_columns", "read_csv", "read_csv_range", "csv_header", "split_csv", "drop_duplicates"]

FIELDS = ("filename", "class", "xmin", "ymin", "xmax", "ymax", "label", "width", "height")
BOX_FIELDS = ("xmin", "ymin", "xmax", "ymax")
# Column names tried, in order and ignoring case, for a field the user did not map.
ALIASES = {"filename": ("filename", "file_name", "file", "image_id", "image", "image_name", "img", "path",
                        "fname", "id"),
           "class": ("class", "class_name", "category"), "label": ("label", "target")}
Skip = Callable[[str, str, str], None]  # (reason, where, detail)
# The columns get their room once, from bounds read off the file: arrays grown a row at a
# time were copied at each growth, and after a walk the old copies stayed resident (a
# 300k-row CSV read after its folder's walk peaked at ~124 B a row for ~52 B of columns).
# Rows are gathered _ROWS at a time in small arrays, then copied in.
_ROWS = 1 << 12
_COLUMNS = {"line": (np.int32, ()), "labels": (np.int32, ()), "has_box": (np.bool_, ()), "boxes": (np.float32, (4,)),
            "box_classes": (np.int32, ()), "frames": (np.int32, (2,)), "digests": (np.uint64, (2,))}


@dataclass
class Rows:
    """The CSV's usable rows, one array entry per row."""

    path: str
    names: Strings  # the file-name cell, stripped, '\\' turned '/'
    line: np.ndarray  # int32: the row's line in the CSV
    image_label: np.ndarray  # int32 index into image_names, -1: none
    has_box: np.ndarray  # bool
    boxes: np.ndarray  # float32[n, 4] xyxy (zeros where has_box is False)
    box_class: np.ndarray  # int32 index into box_names, -1: none
    frames: np.ndarray | None  # int32[n, 2]: the CSV's (width, height) of the box's image, (0, 0); None: no such columns
    image_names: list[str]
    box_names: list[str]

    def __len__(self) -> int:
        return len(self.line)

    @classmethod
    def empty(cls) -> "Rows":
        """No CSV: no rows."""
        return cls("", Strings.of([]), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, bool),
                   np.zeros((0, 4), np.float32), np.zeros(0, np.int32), None, [], [])

    def where(self, i: int) -> str:
        return f"{self.path}:{int(self.line[i])}"

    def take(self, idx: np.ndarray) -> "Rows":
        return Rows(self.path, self.names.take(idx), self.line[idx], self.image_label[idx], self.has_box[idx],
                    self.boxes[idx], self.box_class[idx], None if self.frames is None else self.frames[idx],
                    self.image_names, self.box_names)


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


class _Parser:
    """Turns one CSV row after another into columns; bad rows are told to ``skip``."""

    def __init__(self, path: Path, header: list[str], columns: dict[str, str], skip: Skip, cap: int,
                 size: int) -> None:
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
        at = {c: k for k, c in enumerate(header)}
        self.path, self.width, self.skip = str(path), len(header), skip
        self.file = at[cols["filename"]]
        image_col = cols.get("label") or (None if have_box else cols.get("class"))
        box_col = cols.get("class") if have_box else None
        self.image = at[image_col] if image_col else None
        self.box = [at[cols[f]] for f in BOX_FIELDS] if have_box else None
        self.box_class = at[box_col] if box_col else None
        self.size = (at[cols["width"]], at[cols["height"]]) if "width" in cols and "height" in cols else None
        self.info = {"csv_columns": {f: c for f, c in cols.items() if f in ("filename", "width", "height", *BOX_FIELDS)
                                     or c in (image_col, box_col)},
                     "csv_labels": {"images": image_col, "boxes": box_col}}
        self.image_ids: dict[str, int] = {}
        self.box_ids: dict[str, int] = {}
        self.sealed, self.name_bytes = 0, 0
        self.columns = {name: np.empty((cap, *shape), dtype) for name, (dtype, shape) in _COLUMNS.items()
                        if name != "frames" or self.size}
        self.name_data, self.name_ends = np.empty(size, np.uint8), np.zeros(cap + 1, np.int64)
        self._fresh()

    def _fresh(self) -> None:
        """Empty arrays for the next few rows."""
        self.names, self.line, self.labels, self.digests = StringsBuilder(), array("i"), array("i"), bytearray()
        self.has_box, self.boxes, self.box_classes, self.frames = array("b"), array("f"), array("i"), array("i")

    def seal(self) -> None:
        """The rows gathered since the last seal copied into the columns."""
        a, b = self.sealed, self.sealed + len(self.line)
        names = self.names.build()
        c = self.name_bytes + len(names.data)
        if b + 1 > len(self.name_ends) or c > len(self.name_data):
            raise SourceError(f"{self.path}: the CSV grew while it was read; read it again when it is complete")
        for name, part in (("line", self.line), ("labels", self.labels), ("has_box", self.has_box),
                           ("boxes", self.boxes), ("box_classes", self.box_classes), ("frames", self.frames),
                           ("digests", self.digests)):
            if name in self.columns and b > a:
                col = self.columns[name]
                col[a:b] = np.frombuffer(part, col.dtype).reshape(b - a, *col.shape[1:])
        self.name_data[self.name_bytes:c] = names.data
        self.name_ends[a + 1:b + 1] = names.offsets[1:] + self.name_bytes
        self.sealed, self.name_bytes = b, c
        self._fresh()

    def add(self, row: list[str], line: int) -> None:
        import xxhash

        where = f"{self.path}:{line}"
        if len(row) != self.width:
            self.skip("CSV row with a wrong number of fields", where, "")
            return
        box, frame = (0.0, 0.0, 0.0, 0.0), (0, 0)
        has_box = self.box is not None and any(row[k].strip() for k in self.box)  # all empty: no box
        if has_box:
            box = _box([row[k] for k in self.box], self.skip, where)
            frame = _frame(row[self.size[0]].strip(), row[self.size[1]].strip(), self.skip, where) \
                if self.size else (0, 0)
            if box is None or frame is None:
                return
        self.names.append(row[self.file].strip().replace("\\", "/"))
        self.line.append(line)
        self.labels.append(_id(self.image_ids, row[self.image].strip()) if self.image is not None else -1)
        self.has_box.append(has_box)
        self.boxes.extend(box)
        self.box_classes.append(_id(self.box_ids, row[self.box_class].strip())
                                if has_box and self.box_class is not None else -1)
        if self.size:
            self.frames.extend(frame)
        self.digests += xxhash.xxh3_128_digest(repr(row).encode("utf-8", "surrogateescape"))

    def rows(self) -> Rows:
        self.seal()
        n, c = self.sealed, self.columns
        return Rows(self.path, Strings(self.name_data[:self.name_bytes], self.name_ends[:n + 1]), c["line"][:n],
                    c["labels"][:n], c["has_box"][:n], c["boxes"][:n], c["box_classes"][:n],
                    c["frames"][:n] if self.size else None, list(self.image_ids), list(self.box_ids))


def _id(ids: dict[str, int], name: str) -> int:
    """``name``'s index among the names seen so far (-1: empty); class names are few."""
    if not name:
        return -1
    return ids.setdefault(name, len(ids))


def _box(cells: list[str], skip: Skip, where: str) -> tuple[float, float, float, float] | None:
    try:
        x0, y0, x1, y1 = (float(c) for c in cells)
    except ValueError:
        skip("non-numeric box", where, ",".join(cells))
        return None
    if not all(map(is_coord, (x0, y0, x1, y1))) or min(x0, y0, x1, y1) < 0:
        skip("negative or non-finite box", where, "")
        return None
    if x1 < x0 or y1 < y0:
        skip("inverted box (max < min)", where, "")
        return None
    return x0, y0, x1, y1


def _frame(w_cell: str, h_cell: str, skip: Skip, where: str) -> tuple[int, int] | None:
    """The CSV's (width, height) for this row's box; (0, 0) when both cells are empty."""
    if not (w_cell or h_cell):
        return 0, 0
    try:
        w, h = float(w_cell), float(h_cell)
    except ValueError:
        w = h = -1.0
    if not (is_coord(w) and is_coord(h) and w >= 1 and h >= 1 and w == int(w) and h == int(h)):
        skip("bad CSV width/height (not positive integers)", where, f"{w_cell},{h_cell}")
        return None
    return int(w), int(h)


def drop_duplicates(rows: Rows, digests: np.ndarray, skip: Skip) -> Rows:
    """Rows whose every cell repeats an earlier row's are skipped and counted (128-bit
    ``digests``, one per row, compared in numpy: no set of rows is held)."""
    if not len(rows):
        return rows
    d = digests[:len(rows)]
    first = np.sort(d[:, 0])  # the common case, no two rows alike, needs no order array (8 B a row less)
    if not (first[1:] == first[:-1]).any():
        return rows
    del first
    order = np.argsort(d[:, 0], kind="stable")  # by the first 64 bits; the rest checked where those agree
    first = d[order, 0]
    maybe = np.flatnonzero(first[1:] == first[:-1]) + 1
    del first
    dup = np.zeros(len(d), bool)
    for k in maybe.tolist():  # a run of equal first halves: each row against the earlier ones of the run
        j = k - 1
        while j >= 0 and d[order[j], 0] == d[order[k], 0]:
            if d[order[j], 1] == d[order[k], 1]:
                dup[order[k]] = True
                break
            j -= 1
    for i in np.flatnonzero(dup).tolist():
        skip("duplicate CSV row", rows.where(i), "")
    return rows.take(np.flatnonzero(~dup)) if dup.any() else rows


def _bounds(fd: int) -> tuple[int, int]:
    """At most how many rows (lines) and file-name bytes (the file's size) the open CSV holds.
    A line ends at ``\n``, ``\r\n`` or a lone ``\r`` (the csv module's rule; old Mac files);
    a ``\r\n`` split between two blocks counts twice, which keeps this an upper bound."""
    lines = size = 0
    while block := os.pread(fd, 1 << 20, size):
        lines += block.count(b"\n") + block.count(b"\r") - block.count(b"\r\n")
        size += len(block)
    return lines + 1, size


def _open_checked(path: Path, mode: str = "r") -> Any:
    """The CSV opened (text: ``newline=""``, UTF-8 with or without BOM), refusing what is no regular file."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block, /dev/zero never end
            raise SourceError(f"{path}: the CSV is not a regular file; give a file (a copy of the stream)")
        return open(path, "rb") if mode == "rb" else open(path, newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise SourceError(f"{path}: cannot open the CSV ({exc.strerror})") from None


def _feed(parser: _Parser, reader: Any, line0: int = 0) -> None:
    """Every row of ``reader`` to ``parser``; its lines counted from ``line0``."""
    for row in reader:
        if row:  # blank lines are no rows
            parser.add(row, reader.line_num + line0)
            if len(parser.line) == _ROWS:
                parser.seal()


def read_csv(path: Path, columns: dict[str, str], skip: Skip) -> tuple[Rows, dict[str, Any]]:
    """Parse annotation rows (bad rows are skipped and counted, bad headers raise), and
    facts for the manifest (which columns were used for what)."""
    rows, digests, info = read_csv_range(path, columns, skip, None)
    return drop_duplicates(rows, digests, skip), info


def csv_header(path: Path, columns: dict[str, str]) -> tuple[list[str], dict[str, Any]]:
    """The CSV's header, checked as :func:`read_csv` checks it, and the facts for the manifest."""
    with _open_checked(path) as fh:
        try:
            header = next(csv.reader(fh), [])
        except (UnicodeDecodeError, csv.Error) as exc:
            raise SourceError(f"{path}: not a readable UTF-8 CSV ({exc})") from None
    return header, _Parser(path, header, columns, lambda *a: None, 1, 0).info


def read_csv_range(path: Path, columns: dict[str, str], skip: Skip, span: tuple[int, int, int] | None
                   ) -> tuple[Rows, np.ndarray, dict[str, Any]]:
    """The rows of the whole CSV (``span`` None), or of bytes ``start:end`` after its header whose
    first line is line ``line0 + 1`` (see :func:`split_csv`), with each row's 128-bit digest
    (duplicates not dropped yet) and the manifest's facts."""
    if span is not None:
        header, _ = csv_header(path, columns)
        with _open_checked(path, "rb") as f:
            data = os.pread(f.fileno(), span[1] - span[0], span[0])
        lines = data.count(b"\n") + data.count(b"\r") - data.count(b"\r\n") + 1
    with _open_checked(path) as fh:
        try:
            if span is None:
                reader = csv.reader(fh)
                header = next(reader, [])
                parser = _Parser(path, header, columns, skip, *_bounds(fh.fileno()))
                _feed(parser, reader)
            else:
                parser = _Parser(path, header, columns, skip, lines, len(data))
                _feed(parser, csv.reader(io.StringIO(data.decode("utf-8"), newline="")), span[2])
        except (UnicodeDecodeError, csv.Error) as exc:
            raise SourceError(f"{path}: not a readable UTF-8 CSV ({exc})") from None
    rows = parser.rows()
    return rows, parser.columns["digests"][:len(rows)], parser.info


def split_csv(path: Path, size: int) -> list[tuple[int, int, int]] | None:
    """Byte ranges of about ``size`` after the header, each starting a line, with the lines
    before it: (start, end, lines before start). Only for a CSV without any quote character,
    where every line is one row (a quoted cell may hold line ends; then None: one range)."""
    starts: list[tuple[int, int]] = []
    lines, pos, last = 0, 0, b""
    with _open_checked(path, "rb") as f:
        while block := os.pread(f.fileno(), 1 << 16, pos):
            if b'"' in block:
                return None
            found = _line_starts(block, pos, size, starts)
            if found is None:
                return None
            for j in found:
                starts.append((pos + j, lines + _lines(block, last, j)))
            lines += _lines(block, last)
            pos, last = pos + len(block), block[-1:]
    ends = [s for s, _ in starts[1:]] + [pos]
    return [(a, b, n) for (a, n), b in zip(starts, ends) if b > a]


def _lines(block: bytes, last: bytes, end: int | None = None) -> int:
    """Line ends in ``block[:end]`` (``\n``, ``\r\n`` or a lone ``\r``), ``last`` the byte before it."""
    end = len(block) if end is None else end
    return (block.count(b"\n", 0, end) + block.count(b"\r", 0, end) - block.count(b"\r\n", 0, end)
            - (last == b"\r" and block[:1] == b"\n" and end > 0))


def _line_starts(block: bytes, pos: int, size: int, starts: list[tuple[int, int]]) -> list[int] | None:
    """Where in ``block`` (at ``pos`` in the file) new ranges start: the header's end first,
    then the first line start at or after each ``size`` bytes past the previous start
    (None: the header's end is not in the first block, or not plain to see)."""
    out = []
    if not starts:
        k = min((k for k in (block.find(b"\n"), block.find(b"\r")) if k >= 0), default=-1)
        if k < 0 or k + 2 >= len(block):
            return None
        out.append(k + 1 + (block[k:k + 2] == b"\r\n"))
    while True:
        prev = pos + out[-1] if out else starts[-1][0]
        k = block.find(b"\n", max(prev + size - pos, 0))
        if k < 0 or k + 1 >= len(block):
            return out
        out.append(k + 1)
