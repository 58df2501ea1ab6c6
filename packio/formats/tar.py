"""Tar shards with WebDataset conventions: a folder ``DST.wds/`` with ``shard-000000.tar`` ... holding
``{key}.jpg`` (or .png/.bmp/.webp), ``{key}.cls`` (label as text) and ``{key}.json``
(the packio record). ``index.npy`` (int64 rows: shard, image offset, image size,
json offset, json size) gives random access without scanning; ``record_digests.npy``
(each json member's xxh3-64, int64) ties a record read by a byte range to the dataset
the reader opened (a re-upload in place cannot hand out its records under the old
manifest). A separate file: readers that predate it read the dataset as before.

:class:`TarReader` reads its shards through a :class:`ShardSource`: local files here
(:class:`LocalShards`), a cache fed from a URL in :mod:`packio.remote`.

Shards written by other tools (e.g. ``webdataset.ShardWriter``) open too: a folder
of ``.tar`` files, one ``.tar``, or a brace pattern ``shard-{000000..000009}.tar``;
they are scanned once at open. Members are never extracted; names with ``..``,
absolute names and links are refused.
"""

from __future__ import annotations

import os
import re
import tarfile
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from packio import limits
from packio.decode import sniff
from packio.errors import CorruptSampleError, DatasetReplacedError, FormatError
from packio.formats.base import (MAX_RECORD_BYTES, FormatSpec, WriteOptions, Writer, decode_stored, pack_record,
                                 payload_bytes, unpack_record)
from packio.formats.reader import Reader, StoredBatch, file_identity, folder_identity, inside
from packio.formats.spill import SpilledColumn
from packio.manifest import Manifest
from packio.sample import EXTENSIONS, Sample, checksum, sample_from_record, text_key
from packio.sources.names import class_name

__all__ = ["TarWriter", "TarReader", "ShardSource", "LocalShards", "FORMAT", "INDEX", "expand_pattern", "gather",
           "DIGESTS", "read_span", "record_digest", "scan_shard", "tar_pattern"]

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp")
INDEX = "index.npy"
MAX_OPEN_SHARDS = 64  # shard descriptors one reader keeps open per process
_SPILL = 1 << 13  # index rows a writer holds
_MAX_NAME_BYTES = 256  # a .cls member read as a label: longer, it is no class index or name

DIGESTS = "record_digests.npy"


def record_digest(blob: bytes | memoryview) -> int:
    """A json member's xxh3-64, as the int64 ``index.npy`` holds."""
    d = xxhash.xxh3_64_intdigest(blob)
    return d - (1 << 64) if d >= 1 << 63 else d


def _member(name: str, data: bytes | memoryview) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o444
    info.mtime = 0  # reproducible shards
    return info


class TarWriter(Writer):
    def __init__(self, path: Path, options: WriteOptions) -> None:
        super().__init__(path, options)
        path.mkdir(parents=True)
        self._shards: list[str] = []
        # 5 numbers per sample (see INDEX) and the record's digest, _SPILL rows at a time, then
        # appended to files beside the output (held, they were 40 B a sample at a pack's peak)
        self._rows = np.empty((_SPILL, 6), np.int64)
        self._index = SpilledColumn(path / ".index.spill", np.int64, (5,))
        self._digests = SpilledColumn(path / ".digests.spill", np.int64)
        self._tar: tarfile.TarFile | None = None
        self._in_shard = 0
        self._shard_bytes = 0
        self._cuts = 0  # planned shard boundaries passed

    def _full(self) -> bool:
        """Start a new shard here? At the planned even split (``options.shards``), else
        after ``shard_samples``; and whenever a shard reaches ``shard_bytes``."""
        o = self.options
        if self._tar is None or self._shard_bytes >= o.shard_bytes:
            return True
        if not o.shards:
            return self._in_shard >= o.shard_samples
        cut = False
        while self._cuts + 1 < o.shards and self.count >= (self._cuts + 1) * o.expected // o.shards:
            self._cuts += 1
            cut = True
        return cut

    def _roll(self) -> None:
        self._close_shard()
        name = f"shard-{len(self._shards):06d}.tar"
        self._shards.append(name)
        self._tar = tarfile.open(self.path / name, "w", format=tarfile.PAX_FORMAT)
        self._in_shard = self._shard_bytes = 0

    def add(self, sample: Sample) -> None:
        if self._full():
            self._roll()
        # WebDataset keys cannot hold dots; the original key is in the json. Numbered from the part's
        # first key: a webdataset pipeline over every part's shards sees each key once.
        key = f"{self.options.first_key + self.count:010d}"
        data = payload_bytes(sample)
        rec = pack_record(sample.record(), text=True)  # .json: what WebDataset pipelines decode
        row = [len(self._shards) - 1]
        for name, blob in ((f"{key}.{EXTENSIONS[sample.encoding]}", data), (f"{key}.json", rec)):
            row += [self._add(name, blob), len(blob)]
        self._rows[self.count % _SPILL] = [*row, record_digest(rec)]
        if sample.label >= 0:
            self._add(f"{key}.cls", str(sample.label).encode())
        self._in_shard += 1
        self._shard_bytes += len(data) + len(rec) + 1536
        self.count += 1
        if not self.count % _SPILL:
            self._spill(self._rows)

    def _spill(self, rows: np.ndarray) -> None:
        self._index.append(np.ascontiguousarray(rows[:, :5]))
        self._digests.append(np.ascontiguousarray(rows[:, 5]))

    def _add(self, name: str, blob: bytes | memoryview) -> int:
        """Append one member; returns the offset of its data (header bytes counted here,
        so no second pass over the shard is needed to build the index)."""
        tar = self._tar
        info = _member(name, blob)
        header = info.tobuf(tar.format, tar.encoding, tar.errors)  # built once (addfile would build it again)
        pad = -len(blob) % tarfile.BLOCKSIZE
        tar.fileobj.write(header)
        tar.fileobj.write(blob)
        if pad:
            tar.fileobj.write(tarfile.NUL * pad)
        start = tar.offset + len(header)
        tar.offset = start + len(blob) + pad  # TarFile.close() ends the archive from here
        return start

    def _close_shard(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        self._tar = None

    def close(self) -> dict[str, Any]:
        self._close_shard()
        self._spill(self._rows[:self.count % _SPILL])
        self._index.finish(self.path / INDEX)
        self._digests.finish(self.path / DIGESTS)
        first = {"first_key": self.options.first_key} if self.options.first_key else {}
        return {"shards": self._shards, "index": INDEX, **first,
                "index_columns": ["shard", "image_offset", "image_size", "json_offset", "json_size"],
                "record_digests": DIGESTS,
                "pattern": f"shard-{{000000..{max(len(self._shards) - 1, 0):06d}}}.tar"}

    def abort(self) -> None:
        self._index.discard()
        self._digests.discard()
        if self._tar is not None:
            self._tar.close()


def _check_member(m: tarfile.TarInfo, shard: Path) -> None:
    name = m.name
    if name.startswith("/") or ".." in Path(name).parts or re.match(r"^[A-Za-z]:", name):
        raise FormatError(f"{shard}: member {name!r} has an absolute or '..' path; refusing this tar")
    if m.issym() or m.islnk() or m.isdev():
        raise FormatError(f"{shard}: member {name!r} is a link or device; refusing this tar")
    if m.issparse():  # its data is not one run of bytes, and it may claim any size
        raise FormatError(f"{shard}: member {name!r} is a GNU sparse file; refusing this tar")


def _cls_label(tf: tarfile.TarFile, m: tarfile.TarInfo, shard: Path) -> int | str:
    """A ``.cls`` member's label: a class index (-1: none), or a class name where it holds
    text (``cat``); -1 when it holds no text (binary, empty, over ``_MAX_NAME_BYTES``)."""
    f = tf.extractfile(m) if m.size <= _MAX_NAME_BYTES else None
    try:
        text = f.read(m.size).decode().strip() if f else ""
    except UnicodeDecodeError:
        return -1
    try:
        label = int(text)
    except ValueError:
        return class_name(text) if text.isprintable() and text else -1
    if not -1 <= label < limits.MAX_CLASSES:  # one class name is made per index up to the largest
        raise FormatError(f"{shard}: {m.name!r} holds the label {label}, outside 0..{limits.MAX_CLASSES - 1}; "
                          f"packio reads .cls members as class indices")
    return label


def _json_labels(tf: tarfile.TarFile, m: tarfile.TarInfo) -> tuple[int, int]:
    """The image label of a stranger's ``.json`` (-1: none) and its largest box label (-1:
    none): what :func:`_fitting` would keep of them, read once at the scan so the class
    list covers every label read later."""
    f = tf.extractfile(m)
    data = f.read(m.size) if f else b""
    if b"label" not in data:  # most metadata never names one: not parsed
        return -1, -1
    try:
        extra = limits.loads_json(data, "json", limits.MAX_RECORD_BYTES)
    except FormatError:
        return -1, -1
    label = extra.get("label") if isinstance(extra, dict) else None
    boxes = _fitting(extra).get("box_labels", [])
    return (label if _class_index(label) else -1,
            max((b for b in boxes if _class_index(b)), default=-1))


def _class_index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < limits.MAX_CLASSES


class _HeaderCap:
    """A shard file for ``tarfile``'s scan whose single reads are capped: ``tarfile`` reads
    a PAX or GNU long-name header whole, as large as the header claims (member data is
    skipped by seeking), so a stranger's 1 GB "header" is refused instead of read."""

    def __init__(self, raw: Any, shard: Path) -> None:
        self.raw, self.shard = raw, shard

    def read(self, n: int = -1) -> bytes:
        if n < 0 or n > MAX_RECORD_BYTES:
            raise FormatError(f"{self.shard}: a tar header of {n} bytes, over packio's limit of {MAX_RECORD_BYTES} "
                              f"(a PAX or GNU long-name header); not a shard packio reads")
        return self.raw.read(n)

    def __getattr__(self, name: str) -> Any:  # seek, tell, name, mode: the file's own
        return getattr(self.raw, name)


Scan = tuple[np.ndarray, list[str], list[int | str], int]


def scan_shard(shard: Path, shard_no: int, strict: bool) -> Scan:
    """Index one shard: rows (shard, img off, img size, json off, json size), keys, each
    sample's label (its ``.cls``, else its ``.json``'s: an index or a class name, -1 none),
    and the largest box label of any ``.json`` (-1: none)."""
    labels: list[int | str] = []
    rows, keys, box_top = [], [], -1
    try:
        fd = limits.open_regular(shard)
        with os.fdopen(fd, "rb") as raw, tarfile.open(fileobj=_HeaderCap(raw, shard), mode="r:", encoding="utf-8",
                                                      errors="surrogateescape") as tf:
            groups = _groups(tf, shard, os.fstat(fd).st_size)
            for key, g in groups.items():
                img = next((g[e] for e in IMAGE_EXTS if e in g), None)
                if img is None:
                    if strict:
                        raise FormatError(f"{shard}: sample {key!r} has no image member")
                    continue
                if img.size > limits.MAX_PAYLOAD_BYTES:
                    raise FormatError(f"{shard}: member {img.name!r} holds {img.size} bytes, over packio's limit "
                                      f"of {limits.MAX_PAYLOAD_BYTES} for one image; refusing this shard")
                js = g.get("json")
                if js is not None and js.size > limits.MAX_RECORD_BYTES:
                    js = None  # metadata too big to be packio's record (polygons, ...): ignored, as unfitting
                label, box = _json_labels(tf, js) if js is not None else (-1, -1)
                rows.append((shard_no, img.offset_data, img.size,
                             js.offset_data if js else -1, js.size if js else 0))
                keys.append(key)
                labels.append(_cls_label(tf, g["cls"], shard) if "cls" in g else label)  # .cls first, as webdataset
                box_top = max(box_top, box)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise FormatError(f"{shard}: not a readable tar shard ({exc})") from None
    return np.asarray(rows, np.int64).reshape(-1, 5), keys, labels, box_top


def _groups(tf: tarfile.TarFile, shard: Path, size: int) -> dict[str, dict[str, tarfile.TarInfo]]:
    """The shard's members grouped by key (in order), each group by extension; a key that is
    not UTF-8 is written with ``\\xNN`` escapes (:func:`packio.sample.text_key`)."""
    groups: dict[str, dict[str, tarfile.TarInfo]] = {}
    named: dict[str, str] = {}  # key -> the name it was made from (names that may escape alike)
    for m in tf:
        _check_member(m, shard)
        if not m.isfile():
            continue
        limits.check_span(m.offset_data, m.size, size, f"{shard}: member {m.name!r}")
        base = m.name.rsplit("/", 1)[-1]
        if "." not in base:
            continue
        stem, ext = base.split(".", 1)
        name = m.name[: len(m.name) - len(base)] + stem
        key = text_key(name)
        if (not name.isascii() or "\\" in name) and named.setdefault(key, name) != name:  # b'caf\xe9', 'caf\\xe9'
            raise FormatError(f"{shard}: members named {named[key]!r} and {name!r} are one key, {key!r}, as stored (a "
                              f"name that is not UTF-8 is written with \\xNN escapes); rename one of them in the shard")
        group = groups.setdefault(key, {})
        if ext.lower() in group:  # never let a later member replace the first one silently
            raise FormatError(f"{shard}: member {m.name!r} repeats the key {key!r} (a duplicate key: two "
                              f"samples would be one); give every sample its own key in the shard")
        group[ext.lower()] = m
    return groups


def _check_rows(where: Path, index: np.ndarray) -> None:
    """Offsets and sizes are non-negative and within packio's size limits (whether a
    member lies inside its shard is checked per read: a truncated shard keeps the
    samples before the cut readable)."""
    img_off, img_size, js_off, js_size = (index[:, k] for k in range(1, 5))
    ok = ((img_off >= 0) & (img_size >= 0) & (img_size <= limits.MAX_PAYLOAD_BYTES) & (js_off >= -1)
          & (js_size >= 0) & (js_size <= limits.MAX_RECORD_BYTES))
    if not ok.all():
        i = int(np.argmin(ok))
        raise FormatError(f"{where}: row {i} {index[i].tolist()} holds a negative offset or a size over "
                          f"packio's limits; re-pack the dataset")


_INT_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?")
_CHAR_RANGE = re.compile(r"[A-Za-z]\.\.[A-Za-z](?:\.\.-?\d+)?")


def _names_in(pattern: str, cap: int) -> int:
    """How many names ``pattern`` expands to (braceexpand's grammar), at least ``cap + 1``
    once over ``cap``; counted without expanding (braceexpand materialises each group)."""
    total, depth, start = 1, 0, 0
    for i, c in enumerate(pattern):
        if c == "{":
            start = i if depth == 0 else start
            depth += 1
        elif c == "}" and depth:
            depth -= 1
            if depth == 0:
                total *= _group_names(pattern[start + 1:i], cap)
                if total > cap:
                    return cap + 1
    return total


def _group_names(expr: str, cap: int) -> int:
    m = _INT_RANGE.fullmatch(expr)
    if m:
        step = max(1, int(m[3] or 1))
        return abs(int(m[2]) - int(m[1])) // step + 1 if len(expr) < 64 else cap + 1
    if _CHAR_RANGE.fullmatch(expr):
        return 52
    items, depth, start = [], 0, 0
    for i, c in enumerate(expr):
        depth += (c == "{") - (c == "}")
        if c == "," and depth == 0:
            items.append(expr[start:i])
            start = i + 1
    items.append(expr[start:])
    return min(cap + 1, sum(_names_in(item, cap) for item in items))


def expand_pattern(pattern: str) -> tuple[str, list[str]]:
    """A brace pattern (``shard-{000000..000099}.tar``) as its folder (everything before
    the first brace, up to a ``/``) and the names it expands to below that folder: at
    most ``limits.MAX_SHARDS`` of them (counted before expanding), each named once, none
    outside the folder (``..``, absolute or hidden parts are refused)."""
    if len(pattern) > limits.MAX_PATTERN_CHARS:
        raise FormatError(f"{pattern[:80]}...: a shard pattern of {len(pattern)} characters, over packio's "
                          f"limit of {limits.MAX_PATTERN_CHARS}")
    n = _names_in(pattern, limits.MAX_SHARDS)
    if n > limits.MAX_SHARDS:
        raise FormatError(f"{pattern}: names more than {limits.MAX_SHARDS} shards (packio's limit for one "
                          f"pattern); check the braces, or pack the shards in parts")
    from braceexpand import UnbalancedBracesError, braceexpand

    prefix = pattern.split("{", 1)[0].rpartition("/")[0]
    prefix = prefix + "/" if prefix or pattern.startswith("/") else ""
    try:
        names = list(braceexpand(pattern))
    except (UnbalancedBracesError, ValueError) as exc:
        raise FormatError(f"{pattern}: not a brace pattern ({exc}); write e.g. shard-{{000000..000099}}.tar"
                          ) from None
    rels = [name[len(prefix):] for name in names]
    bad = next((r for name, r in zip(names, rels) if not name.startswith(prefix) or not limits.plain_rel(r)), None)
    if bad is not None:
        raise FormatError(f"{pattern}: names {bad!r}, which is not a plain path below {prefix or './'}; "
                          f"a pattern may name only files under the folder before its first brace")
    if len(set(rels)) != len(rels):
        raise FormatError(f"{pattern}: names a shard twice; every sample would be read twice")
    return prefix, rels


def gather(scans: list[Scan]) -> tuple[np.ndarray, dict[int, tuple[str, int]], list[str]]:
    """Foreign shards' scans (see ``scan_shard``) as one index, index -> (key, label), and the
    class names: ``"0"``.. the largest index any label or box label takes, then the names
    ``.cls`` members give as text, sorted. Every label read is one of them."""
    rows, found, top = [], [], -1
    for r, keys, labels, box_top in scans:
        found += zip(keys, labels)
        top = max(top, box_top, max((lab for lab in labels if isinstance(lab, int)), default=-1))
        rows.append(r)
    index = np.concatenate(rows) if rows else np.zeros((0, 5), np.int64)
    names = sorted({lab for _, lab in found if isinstance(lab, str)})
    at = {name: top + 1 + k for k, name in enumerate(names)}
    foreign = {i: (key, at[lab] if isinstance(lab, str) else lab) for i, (key, lab) in enumerate(found)}
    return index, foreign, [str(c) for c in range(top + 1)] + names


def tar_pattern(where: str, m: Manifest) -> str | None:
    """The brace pattern naming every shard (webdataset / braceexpand syntax), or a glob;
    ``where``: the folder (or URL) the dataset's files lie in."""
    where = where.rstrip("/")
    if "parts" not in m.extra:
        pattern = _brace([s for s in m.extra.get("shards", []) if isinstance(s, str)])
        return f"{where}/{pattern}" if pattern else None
    groups: dict[str, list[str]] = {}
    for rel in sorted(f for f in m.files if f.endswith(".tar")):
        head, _, name = rel.rpartition("/")
        groups.setdefault(head, []).append(name)
    inner = {tuple(v) for v in groups.values()}
    outer = _brace(list(groups))
    if len(inner) == 1 and outer:
        names = _brace(list(next(iter(inner))))
        return f"{where}/{outer}/{names}" if names else None
    heads = sorted(groups, key=lambda head: (head != "", head))  # grown by --append: the top folder's first
    each = [(f"{head}/" if head else "") + (_brace(groups[head]) or "") for head in heads]
    if all(e and not e.endswith("/") and "," not in e for e in each):  # one nested brace pattern: URLs too
        return f"{where}/{{{','.join(each)}}}"
    glob = f"{where}/*/*.tar"
    if "" in groups:  # grown by convert --append: the first part's shards lie in the top folder
        glob = f"{where}/*.tar + {glob}"
    return glob + " (globs: sorted(glob.glob(...)) lists the shards)"


def _brace(names: list[str]) -> str | None:
    """``shard-{000000..000007}.tar`` for contiguous, equally padded numbered names."""
    found = [re.fullmatch(r"(.*?)(\d+)(\.[^/]*)?", n) for n in names]
    if not names or not all(found) or len({(f[1], f[3], len(f[2])) for f in found}) != 1:  # type: ignore[index]
        return None
    nums = [int(f[2]) for f in found]  # type: ignore[index]
    if nums != list(range(nums[0], nums[0] + len(nums))):
        return None
    if len(nums) == 1:
        return names[0]
    f, w = found[0], len(found[0][2])  # type: ignore[index]
    return f"{f[1]}{{{nums[0]:0{w}d}..{nums[-1]:0{w}d}}}{f[3] or ''}"


def _fitting(extra: Any) -> dict[str, Any]:
    """The fields of another tool's ``.json`` that fit packio's record (boxes — with their
    box labels, or -1 each when it has none —, sizes); the rest (captions, ...) is ignored.
    Never the label (the scan took it, see :func:`scan_shard`), the key or a checksum: the
    member names give the key (as webdataset's), and a stranger's checksum field is not
    packio's."""
    if not isinstance(extra, dict):
        return {}
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    fit = {k: extra[k] for k in ("width", "height") if whole(extra.get(k))}
    boxes, box_labels = extra.get("boxes"), extra.get("box_labels")
    if isinstance(boxes, list):
        if not (isinstance(box_labels, list) and len(box_labels) == len(boxes)):
            box_labels = [-1] * len(boxes)
        fit.update(boxes=boxes, box_labels=box_labels)
    return fit


class ShardSource(ABC):
    """Where a :class:`TarReader`'s shard bytes (``names``) come from. Per-process state
    is made by :meth:`open` and dropped by :meth:`close`; a source pickles without it."""

    checks_samples = False  # True: bytes come by range, unchecked: each record and payload is checked as read

    def __init__(self, names: list[str]) -> None:
        self.names = names

    @abstractmethod
    def open(self) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Drop this process's handles (in a forked child: without touching the parent's)."""

    @abstractmethod
    def read(self, shard: int, off: int, size: int, i: int) -> bytes:
        """``size`` bytes at ``off`` of shard ``shard``, for sample ``i`` (short: CorruptSampleError)."""

    def stage(self, rows: np.ndarray) -> None:
        """The index rows of the samples about to be read (a remote source fetches them)."""

    def unstage(self) -> None:
        """Those samples are read."""

    @abstractmethod
    def replaced(self) -> str | None:
        """Why the bytes may no longer be those of the dataset opened, or None."""


class LocalShards(ShardSource):
    """Shard files, opened on first use, at most ``MAX_OPEN_SHARDS`` per process (least
    recently used closed first). ``root``: the dataset folder; a shard opened later must
    come from the folder the reader opened (a descriptor opened during a failed check is
    closed, never kept). ``stamps``: each shard's :func:`file_identity` taken before it was
    scanned (shards another tool wrote), checked when it is opened and before each read."""

    def __init__(self, paths: list[Path], root: Path | None = None,
                 stamps: list[tuple[int, int, int, int]] | None = None) -> None:
        super().__init__([p.name for p in paths])
        self.paths, self.root, self.stamps = paths, root, stamps
        self._fds: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._root_id: tuple[int, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _fds=OrderedDict(), _root_id=None)

    def open(self) -> None:
        self._fds = OrderedDict()
        self._root_id = folder_identity(self.root) if self.root is not None else None

    def close(self) -> None:
        fds, self._fds = self._fds, OrderedDict()
        for fd, _ in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def read(self, shard: int, off: int, size: int, i: int) -> bytes:
        fd, end = self._fd(shard)
        if self.stamps is not None and file_identity(os.fstat(fd)) != self.stamps[shard]:  # rewritten in place
            raise DatasetReplacedError(self._rewritten(shard))
        return read_span(fd, end, off, size, i, self.names[shard])

    def _fd(self, shard: int) -> tuple[int, int]:
        fds = self._fds
        if shard in fds:
            fds.move_to_end(shard)
            return fds[shard]
        while len(fds) >= MAX_OPEN_SHARDS:
            os.close(fds.popitem(last=False)[1][0])
        fd = limits.open_regular(self.paths[shard])
        try:
            st = os.fstat(fd)
            why = self._rewritten(shard) if self.stamps is not None and file_identity(st) != self.stamps[shard] \
                else self._root_moved()
            if why is not None:
                raise DatasetReplacedError(why)
        except BaseException:
            os.close(fd)
            raise
        fds[shard] = (fd, st.st_size)
        return fds[shard]

    def _rewritten(self, shard: int) -> str:
        return (f"{self.paths[shard]} was rewritten or replaced after this reader opened it (its size or "
                f"modification time changed); open the shards again")

    def _root_moved(self) -> str | None:
        if self._root_id is None:
            return None
        try:
            same = folder_identity(self.root) == self._root_id  # type: ignore[arg-type]
        except OSError:
            same = False
        return None if same else (f"{self.root} was replaced or removed (another 'packio convert --overwrite'?) "
                                  f"after this reader opened it; open the dataset again")

    def replaced(self) -> str | None:
        for k, path in enumerate(self.paths if self.stamps is not None else []):
            try:
                now = file_identity(os.stat(path))
            except OSError:
                now = None
            if now != self.stamps[k]:  # type: ignore[index]
                return self._rewritten(k)
        return self._root_moved()


def read_span(fd: int, end: int, off: int, size: int, i: int, name: str) -> bytes:
    """``size`` bytes at ``off`` of an open shard of ``end`` bytes (sample ``i``'s member)."""
    limits.check_span(off, size, end, f"shard {name}",
                      lambda m: CorruptSampleError(f"#{i}", f"{m}: the shard is truncated or the index damaged"))
    data = os.pread(fd, size, off)
    if len(data) != size:
        raise CorruptSampleError(f"#{i}", f"shard {name} is truncated")
    return data


class TarReader(Reader):
    """Random access through the member index, over a :class:`ShardSource` (the
    dataset's own shard files unless another is given)."""

    COUNT_FILE = None  # the index's header must hold the manifest's count, and fit its file

    def __init__(self, path: Path, manifest: Manifest, index: np.ndarray | None = None,
                 foreign: dict[int, tuple[str, int]] | None = None, source: ShardSource | None = None) -> None:
        super().__init__(path, manifest)
        if source is None:
            names = manifest.extra.get("shards", [])
            if not isinstance(names, list) or not all(isinstance(s, str) for s in names):
                raise FormatError(f"{path}: manifest 'shards' is not a list of file names; re-pack the dataset")
            source = LocalShards([inside(path, s) for s in names], root=path)
        self.source = source
        if index is None:  # the header's shape must be the manifest's count, and fit the file
            index = limits.load_npy(inside(path, INDEX), "<i8", (manifest.count, 5))
        if index.dtype != np.int64 or index.shape != (manifest.count, 5) or (
                len(index) and not (0 <= index[:, 0].min() and index[:, 0].max() < len(source.names))):
            raise FormatError(f"{path}: {INDEX} does not match the manifest ({manifest.count} samples, "
                              f"{len(source.names)} shards); re-pack the dataset")
        _check_rows(path / INDEX, index)
        self.index = index
        self.foreign = foreign  # index -> (key, label) for shards without packio records
        self.digests: np.ndarray | None = None  # each record's xxh3-64, where a source reads records by range

    @staticmethod
    def detect_shards(path: str) -> bool:
        p = Path(path)
        if "{" in path and ".tar" in path:
            return True
        if p.is_file() and p.suffix == ".tar":
            return True
        if not p.is_dir() or (p / "packio.json").exists():
            return False
        # one lazy pass (Path.glob lists a whole folder first: 30 MB for an image folder of 200k files)
        found = False
        with os.scandir(p) as it:
            for e in it:
                try:
                    if e.name.startswith(".") or not e.is_file():
                        continue
                except OSError:  # a symlink loop: no shard
                    continue
                if not e.name.endswith(".tar"):
                    return False
                found = True
        return found

    @classmethod
    def claims(cls, path: str) -> bool:
        return cls.detect_shards(path)

    @classmethod
    def describe(cls, where: str, manifest: Manifest) -> list[str]:
        pattern = tar_pattern(where, manifest)
        if not pattern:
            return []
        n = manifest.count
        shards = len([f for f in manifest.files if f.endswith(".tar")]) or len(manifest.extra.get("shards", []))
        return [f"shards:   {shards} × ~{n // max(shards, 1)} samples: {pattern}",
                "          (paste into webdataset.WebDataset(...) or tar tf; members {key}.jpg/.cls/.json)"]

    @classmethod
    def open_unlisted(cls, path: str) -> "TarReader":
        return cls.from_shards(path)

    @classmethod
    def from_shards(cls, path: str) -> "TarReader":
        """Open shards written by another tool: each shard's identity noted, then its
        members scanned once into the index."""
        p = Path(path)
        if p.is_dir():
            shards = [inside(p, s.name) for s in sorted(p.glob("*.tar"))]
        elif "{" in path:
            prefix, names = expand_pattern(path)
            shards = [inside(Path(prefix or "."), name) for name in names]  # a link may not lead out either
        else:
            shards = [p]
        missing = [s for s in shards if not s.is_file()]
        if missing or not shards:
            raise FormatError(f"{path}: shard {missing[0] if missing else '(none)'} not found")
        stamps = [file_identity(os.stat(s)) for s in shards]  # before the scan: a later change shows
        index, foreign, classes = gather([scan_shard(shard, n, strict=False) for n, shard in enumerate(shards)])
        manifest = Manifest(format="tar", count=len(index), classes=classes,
                            source={"path": path, "foreign": True}, extra={"shards": [s.name for s in shards]})
        return cls(p if p.is_dir() else p.parent, manifest, index=index, foreign=foreign,
                   source=LocalShards(shards, stamps=stamps))

    def _open(self) -> None:
        self.source.open()

    def _drop_handles(self) -> None:
        self.source.close()

    def _load(self, i: int) -> Sample:
        src = self.source
        src.stage(self.index[i:i + 1])
        try:
            return self._sample(i)
        finally:
            src.unstage()

    def _load_batch(self, idx: np.ndarray, threads: Any) -> StoredBatch:
        src = self.source
        src.stage(self.index[idx])
        try:
            return StoredBatch(idx, samples=self._each(idx, self._sample))
        finally:
            src.unstage()

    def _load_records(self, idx: np.ndarray) -> list[Sample]:
        """The ``.json`` members alone, staged as a batch (over a URL: concurrent range reads),
        no image read; a foreign sample without one: its scanned label, no boxes."""
        rows = self.index[idx]
        rows[:, 1], rows[:, 2] = rows[:, 3], 0  # each image an empty span where its record starts
        self.source.stage(rows[rows[:, 3] >= 0])
        try:
            return [self._sample(i, image=False) for i in idx.tolist()]
        finally:
            self.source.unstage()

    def _load_key(self, i: int) -> str:
        """The record's key (foreign shards: the scan's); not staged: a key is no read of
        the sample (it does not advance a streaming plan)."""
        if self.foreign is not None:
            return self.foreign[i][0]
        rec = self._record(i, *(int(v) for v in self.index[i, [0, 3, 4]]))
        return rec["key"] if isinstance(rec, dict) and isinstance(rec.get("key"), str) else self._load(i).key

    def _record(self, i: int, shard: int, off: int, size: int) -> Any:
        if size > MAX_RECORD_BYTES:  # checked before reading: the index comes from the file
            raise CorruptSampleError(f"#{i}", f"json member of {size} bytes exceeds {MAX_RECORD_BYTES}")
        blob = self.source.read(shard, off, size, i)
        if self.source.checks_samples and self.digests is not None and record_digest(blob) != self.digests[i]:
            raise CorruptSampleError(f"#{i}", f"its record in {self.source.names[shard]} is not the one "
                                              f"{DIGESTS} names")
        return unpack_record(blob, f"#{i}", text=True)

    def _sample(self, i: int, image: bool = True) -> Sample:
        """Sample ``i`` from bytes the source has (staged; ``image=False``: its record alone);
        damage found while the source says the dataset changed is that change, not a corrupt sample."""
        shard, ioff, isize, joff, jsize = (int(v) for v in self.index[i])
        src = self.source
        try:
            payload = src.read(shard, ioff, isize, i) if image else b""
            if self.foreign is not None:
                return self._stranger(i, shard, payload, joff, jsize)
            rec = self._record(i, shard, joff, jsize)
            sample = decode_stored(rec, payload, f"#{i}") if image else sample_from_record(rec, b"")
            if image and src.checks_samples and sample.checksum and checksum(payload) != sample.checksum:
                raise CorruptSampleError(f"#{i}", f"checksum mismatch in {src.names[shard]}")
            return sample
        except CorruptSampleError:
            why = src.replaced()
            if why is not None:
                raise DatasetReplacedError(why) from None
            raise

    def _stranger(self, i: int, shard: int, payload: bytes, joff: int, jsize: int) -> Sample:
        """A sample of shards another tool wrote: key and label from the scan, what fits of its .json."""
        key, label = self.foreign[i]  # type: ignore[index]
        rec = {"key": key, "encoding": sniff(payload) or "jpeg", "label": label, "boxes": [],
               "box_labels": [], "width": 0, "height": 0}
        if joff >= 0:
            try:
                extra = self._record(i, shard, joff, jsize)
            except CorruptSampleError:
                extra = None  # another tool's .json: use what fits packio's record, else ignore it
            try:
                return decode_stored({**rec, **_fitting(extra)}, payload, f"#{i}")
            except CorruptSampleError:
                pass  # the parts that looked like packio's do not hold together: the image alone
        return decode_stored(rec, payload, f"#{i}")

    def units(self) -> list[range]:
        if not len(self.index):
            return []
        cuts = np.flatnonzero(np.diff(self.index[:, 0])) + 1
        bounds = [0, *cuts.tolist(), len(self.index)]
        # Split big shards into blocks so a few shards still spread over many workers.
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            out += [range(s, min(s + 512, b)) for s in range(a, b, 512)]
        return out


FORMAT = FormatSpec(name="tar", suffixes=(".wds",), writer=TarWriter, reader=TarReader,
                    refused_suffixes=((".tar", "`tar tf` and webdataset"),),
                    folder_holds="shard-NNNNNN.tar files + packio.json")
