"""``convert(src, dst, append=True)``: a packed folder dataset grown by one part.

The new samples are packed, like any conversion, into one complete dataset of the
same format and stored-image settings, written under a temporary name inside ``dst``
and renamed to ``part-NNNNN<suffix>``; then the top manifest is replaced (one rename:
the commit) by one listing every part. The old files are never touched, so a reader
opened before keeps reading its version: the new manifest names the ids it extends
(``extra["versions"]``), which readers accept as the same data. A single-part dataset
becomes a multi-part one whose first part is its own folder (``"path": "."``, its old
manifest kept as ``part-00000.json``). One code path serves every folder format; an
in-place LMDB append would change what an open reader's count means.

The top manifest names each part by its manifest id as well as its path: a part
replaced or grown on its own no longer opens as part of the dataset. Parts listed by a
packio from before ids (path and count only) still open, checked by count; an append
records their ids.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np

from packio import census
from packio.decode import ResizeSpec
from packio.errors import FormatError, PackioError
from packio.formats import get_format, open_reader
from packio.formats.reader import Reader, inside
from packio.manifest import DIGEST, MANIFEST_NAME, Manifest, describe_files, file_digest, manifest_id
from packio.options import PackOptions
from packio.pack.commit import TMP_MARK, fsync_path, fsync_tree, remove, stale, temp_name
from packio.pack.prepare import Packed, Result
from packio.sources.names import class_name

__all__ = ["BASE_PART", "existing", "stored_options", "merge_names", "Relabeled", "first_key", "part_entry",
           "with_id", "commit_part", "unlabelled"]

BASE_PART = "part-00000.json"  # the manifest of a single-part dataset's own files, once it has grown


def existing(dst: Path) -> Manifest:
    """The manifest of the packio folder dataset at ``dst`` that an append may grow."""
    if not dst.exists():
        raise PackioError(f"{dst}: no such dataset to append to; drop --append to create it")
    if not dst.is_dir():
        raise PackioError(f"{dst} is one file: a part cannot be added to it cheaply; convert it and the new "
                          f"images into a folder format (.wds, .lmdb, ...) and append there, or re-pack both "
                          f"into a new {dst.suffix} file")
    try:
        m = Reader.read_manifest(dst)
    except (FormatError, OSError) as exc:
        raise PackioError(f"{dst}: not a packio dataset to append to ({exc}); pack it first with "
                          f"'packio convert'") from None
    if m.source.get("foreign"):
        raise PackioError(f"{dst}: foreign shards; pack them first with 'packio convert'")
    return m


def stored_options(dst: Path, m: Manifest, options: PackOptions) -> PackOptions:
    """``options`` with the stored-image settings of the dataset being grown: a setting
    given (not its default) that contradicts them is an error (the parts must agree)."""
    default, img = PackOptions(), m.image
    resize = img.get("resize")
    spec = ResizeSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in resize.items()}) \
        if isinstance(resize, dict) else ResizeSpec()
    stored = {"format": m.format, "resize": spec, "encode": img.get("encode", "keep"),
              "quality": img.get("quality") or options.quality, "check": img.get("check", "auto")}
    for name, value in stored.items():
        given = getattr(options, name)
        if given not in (getattr(default, name), value):
            shown = value.to_json() if isinstance(value, ResizeSpec) else value
            raise PackioError(f"{dst} stores {name}={shown!r}, but this append asks for {name}={given!r}: every "
                              f"part keeps the dataset's settings; drop that option (or convert into a new dataset)")
    return dataclasses.replace(options, **stored)


def unlabelled(source: Any, dst: Path, old: Manifest) -> None:
    """Refuse a source that would give a labelled dataset images without a label: one
    with no class names at all (flat images, or a packed dataset without classes)."""
    if old.classes and not source.classes:
        shown = ", ".join(old.classes[:5]) + (", ..." if len(old.classes) > 5 else "")
        what = ("its samples have no class names" if source.reader is not None else
                "its images sit in no class folder and no CSV gives them a label")
        raise PackioError(f"{source.path}: {what}, but {dst} is labelled (classes: {shown}); appended as they are, "
                          f"every one would get label -1. Put the images in class folders ({source.path}/"
                          f"{old.classes[0]}/..., or a new class's name), or give a CSV with a label column; "
                          f"nothing was appended")


def merge_names(old: list[str], new: list[str]) -> tuple[list[str], np.ndarray]:
    """``old`` with the names of ``new`` it lacks appended (old ids never change), and
    each ``new`` index's id in the merged list. Names are compared as text (NFC, see
    :mod:`packio.sources.names`): a dataset packed before names were stored in NFC
    keeps its spelling, and the same name spelled otherwise gets its id."""
    merged = list(old)
    at: dict[str, int] = {}
    for i, name in enumerate(merged):
        at.setdefault(class_name(name), i)
    for name in map(class_name, new):
        if name not in at:
            at[name] = len(merged)
            merged.append(name)
    return merged, np.asarray([at[class_name(name)] for name in new], np.int64)


@dataclasses.dataclass(frozen=True)
class Relabeled:
    """A prepare function whose samples' labels and box labels are mapped to merged ids
    (a top-level class, so it pickles into worker processes)."""

    fn: Callable[[Any], Result]
    labels: np.ndarray
    box_labels: np.ndarray

    def __call__(self, task: Any) -> Result:
        r = self.fn(task)
        if not isinstance(r, Packed):
            return r
        s = r.sample
        label = int(_mapped([s.label], self.labels)[0])
        return dataclasses.replace(r, sample=dataclasses.replace(s, label=label,
                                                                 box_labels=_mapped(s.box_labels, self.box_labels)))


def _mapped(ids: Any, table: np.ndarray) -> np.ndarray:
    """``ids`` through ``table``; -1 (no class) and ids outside it stay as they are."""
    out = np.array(ids, np.int64).reshape(-1)
    ok = (out >= 0) & (out < len(table))
    out[ok] = table[out[ok]]
    return out


def part_name(dst: Path, old: Manifest) -> str:
    """The next part's name; a folder of that name that no manifest lists (left by a killed
    append after its rename, before its commit) is removed, as are dead runs' temporaries."""
    for p in dst.glob(f".*{TMP_MARK}*"):
        if stale(p):
            remove(p)
    listed = {os.path.normpath(p["path"]) for p in old.extra.get("parts", [])  # "./x", "x/": the same folder
              if isinstance(p, dict) and isinstance(p.get("path"), str)}
    suffix = get_format(old.format).suffixes[0]
    k = max(len(listed), 1)
    while f"part-{k:05d}{suffix}" in listed:
        k += 1
    name = f"part-{k:05d}{suffix}"
    if os.path.lexists(dst / name):
        remove(dst / name)  # never committed: no version of the dataset lists it
    return name


def first_key(old: Manifest) -> int:
    """The first member key of a new part (tar names members by number): past every key
    of the listed parts, each counted from the first key it records (0: one written before
    parts recorded it, or the dataset's own first part)."""
    ends = [old.count]
    for p in old.extra.get("parts", []):
        k = p.get("first_key") if isinstance(p, dict) else None
        if isinstance(k, int) and not isinstance(k, bool) and 0 <= k < 1 << 53 and isinstance(p.get("count"), int):
            ends.append(k + p["count"])
    return max(ends)


def check_keys(dst: Path, tmp: Path) -> None:
    """Refuse a new part holding a key the dataset has already (named in the error)."""
    new = open_reader(tmp)
    try:
        keys = {new.key(i) for i in range(len(new))}
    finally:
        new.close()
    old = open_reader(dst)
    try:
        for i in range(len(old)):
            key = old.key(i)  # the record only, where the format keeps it apart from the image
            if key in keys:
                raise PackioError(f"{dst} already holds a sample with key {key!r} (#{i}), which the new samples "
                                  f"have too; nothing was appended. Rename or leave out those inputs (keys are "
                                  f"paths relative to the source folder)")
    finally:
        old.close()


def commit_part(dst: Path, old: Manifest, tmp: Path, name: str, part: dict[str, Any]) -> Manifest:
    """Rename the written part into place, then switch the top manifest to one listing it."""
    fsync_tree(tmp)
    os.rename(tmp, dst / name)
    base: dict[str, Any] = {}
    if "parts" not in old.extra:  # the dataset's own files become its first part, their manifest kept
        _write_atomic(dst / BASE_PART, (dst / MANIFEST_NAME).read_text())
        base = {BASE_PART: {"bytes": (dst / BASE_PART).stat().st_size, DIGEST: file_digest(dst / BASE_PART)}}
    top = top_manifest(old, part, name, {**old.files, **base, **_prefixed(dst / name, name)})
    top.extra["parts"][:-1] = [with_id(dst, p) for p in top.extra["parts"][:-1]]
    fsync_path(dst, os.O_RDONLY | os.O_DIRECTORY)
    _write_atomic(dst / MANIFEST_NAME, top.to_json())
    return top


def top_manifest(old: Manifest, part: dict[str, Any], name: str, files: dict[str, Any]) -> Manifest:
    """The manifest of the grown dataset: every part with its count, the merged names,
    the summed counts, the ids it extends."""
    new: Manifest = part["manifest"]
    parts = old.extra.get("parts") or [{"path": ".", "manifest": BASE_PART, "count": old.count, "id": old.id}]
    versions = [*old.extra.get("versions", []), old.id]
    s, n = old.summary, new.summary
    image = {**old.image, "quality": old.image.get("quality") or new.image.get("quality"),
             "encodings": dict(Counter(old.image.get("encodings") or {}) + Counter(part["stored"])),
             "history": [*(old.image.get("history") or []), {**new.image["history"][-1], "appended": name}]}
    summary = {"packed": old.count + new.count,
               "skipped": dict(Counter(s.get("skipped") or {}) + Counter(n.get("skipped") or {})),
               "duplicate_content": int(s.get("duplicate_content") or 0) + int(n.get("duplicate_content") or 0),
               "notes": dict(Counter(s.get("notes") or {}) + Counter(n.get("notes") or {})),
               "note": "duplicate_content counts within each part",
               "annotations": census.merge([s.get("annotations") or {}, n.get("annotations") or {}])}
    return Manifest(format=old.format, count=old.count + new.count, id=uuid.uuid4().hex, classes=new.classes,
                    box_classes=new.box_classes, image=image, source=old.source, files=files, summary=summary,
                    extra={"parts": [*parts, part_entry(name, new)], "versions": versions})


def part_entry(name: str, m: Manifest) -> dict[str, Any]:
    """A top manifest's entry for the part ``name`` with manifest ``m``: its count, its
    manifest id, and its first member key where the format names members by number (tar)."""
    k = m.extra.get("first_key")
    return {"path": name, "count": m.count, "id": m.id, **({"first_key": k} if k else {})}


def with_id(dst: Path, part: dict[str, Any]) -> dict[str, Any]:
    """A listed part's entry with its manifest id (one listed before ids were recorded
    gets the id of the part the append just opened and counted)."""
    if "id" in part:
        return part
    base = os.path.normpath(part["path"]) == "."
    return {**part, "id": manifest_id(inside(dst, part["manifest"] if base else f"{part['path']}/{MANIFEST_NAME}"))}


def _prefixed(root: Path, name: str) -> dict[str, Any]:
    return {f"{name}/{rel}": facts for rel, facts in describe_files(root, skip=()).items()}


def _write_atomic(path: Path, text: str) -> None:
    tmp = temp_name(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        remove(tmp)
        raise
    fsync_path(path.parent, os.O_RDONLY | os.O_DIRECTORY)

