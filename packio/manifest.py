"""The self-describing manifest (JSON) stored with every packed dataset."""

from __future__ import annotations

import contextlib
import contextvars
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from packio import limits
from packio.errors import FormatError

__all__ = ["MANIFEST_NAME", "DIGEST", "LAYOUT_VERSION", "Manifest", "count_text", "file_digest", "describe_files",
           "dataset_files", "disk_bytes", "manifest_id", "trust_manifest"]

MANIFEST_NAME = "packio.json"
DIGEST = "xxh3_128"  # file checksums; samples carry xxh3_64 (packio.sample.checksum)
LAYOUT_VERSION = 1
_CHECK_DIGEST = contextvars.ContextVar("packio_check_manifest_digest", default=True)


@contextlib.contextmanager
def trust_manifest() -> Any:
    """Open datasets whose manifest no longer matches its digest (edited by hand, on
    purpose) inside this block. Only for recovering data: the edit may relabel every
    sample. ``packio verify`` opens this way so that it can report the mismatch."""
    token = _CHECK_DIGEST.set(False)
    try:
        yield
    finally:
        _CHECK_DIGEST.reset(token)


@dataclass
class Manifest:
    """What a packed dataset holds; enough to open it without packio's help."""

    format: str
    count: int
    id: str = ""  # unique per written dataset: readers notice when the path now holds another one
    classes: list[str] = field(default_factory=list)  # what image labels index
    # what box labels index; None (datasets packed before it existed): ``classes``
    box_classes: list[str] | None = None
    image: dict[str, Any] = field(default_factory=dict)  # encoding, size, resize spec
    source: dict[str, Any] = field(default_factory=dict)  # path, csv, column map
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # relpath -> bytes, xxh3_128
    extra: dict[str, Any] = field(default_factory=dict)  # format-specific layout facts
    summary: dict[str, Any] = field(default_factory=dict)  # packed / skipped counts
    version: int = LAYOUT_VERSION
    digest: str = ""  # xxh3_128 of every other field (content_digest); verify compares

    def content_digest(self) -> str:
        """Checksum of the content a reader trusts (every field but ``digest``), in a
        canonical JSON form that survives a write/read round trip."""
        import xxhash

        body = json.loads(json.dumps({k: v for k, v in self._fields().items() if k != "digest"}))
        return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())

    def to_json(self) -> str:
        """The JSON to store, with a fresh digest. Field order puts ``id`` in the first
        bytes, so a reader can check it without parsing a large ``files`` table."""
        return json.dumps({**self._fields(), "digest": self.content_digest()}, indent=1)

    def box_class_names(self) -> list[str]:
        """The names box labels index (``box_classes``; ``classes`` in older datasets)."""
        return list(self.classes if self.box_classes is None else self.box_classes)

    def _fields(self) -> dict[str, Any]:
        """The stored fields; ``box_classes`` only when set, so older datasets keep their digest."""
        out = asdict(self)
        if out["box_classes"] is None:
            del out["box_classes"]
        return out

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> "Manifest":
        raw = limits.loads_json(text, f"{where}: manifest", limits.MAX_MANIFEST_BYTES)
        if not isinstance(raw, dict):
            raise FormatError(f"{where}: manifest is not a JSON object")
        if raw.get("version") != LAYOUT_VERSION:
            raise FormatError(
                f"{where}: manifest version {raw.get('version')!r} is not supported by this "
                f"packio (reads version {LAYOUT_VERSION}); upgrade packio or re-pack the data")
        types = {"format": str, "count": int, "id": str, "digest": str, "classes": list, "image": dict, "source": dict,
                 "files": dict, "extra": dict, "summary": dict}
        for name, typ in types.items():
            if name in raw and not isinstance(raw[name], typ):
                raise FormatError(f"{where}: manifest field {name!r} should be {typ.__name__}")
        if "format" not in raw or "count" not in raw or isinstance(raw["count"], bool) or raw["count"] < 0:
            raise FormatError(f"{where}: manifest lacks 'format' or a valid 'count'")
        for name in ("classes", "box_classes"):
            value = raw.get(name, [])
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise FormatError(f"{where}: manifest {name!r} must be a list of strings")
        _check_image(raw.get("image", {}), where)
        known = {k: raw[k] for k in (*types, "box_classes", "version") if k in raw}
        m = cls(**known)
        if _CHECK_DIGEST.get() and m.digest != m.content_digest():
            why = "has no content digest" if not m.digest else "no longer matches its digest"
            raise FormatError(f"{where}: manifest {why}: it was edited or damaged after packing (an edit such as "
                              f"reordered classes would relabel every sample); restore the original packio.json "
                              f"or re-pack the dataset ('packio verify' reports the details)")
        return m


def count_text(value: Any, grouped: bool = False) -> str:
    """A count read from a manifest, as printed: an int from 0 to 2**63-1 (``grouped``:
    1,234), else ``invalid`` (a stranger's manifest may hold anything there)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limits.INT64_MAX:
        return f"{value:,}" if grouped else str(value)
    return "invalid"


def _check_image(image: dict[str, Any], where: str) -> None:
    """The fields of ``image`` readers size things by: ``shape`` is null or [H, W, 3]."""
    shape = image.get("shape")
    if shape is not None and not (isinstance(shape, list) and len(shape) == 3 and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 < v <= limits.INT64_MAX for v in shape)
                                  and shape[2] == 3):
        raise FormatError(f"{where}: manifest image.shape {shape!r} is not [height, width, 3]; the manifest is "
                          f"damaged, re-pack the dataset")


_ID_AT_START = re.compile(rb'^\{\s*"format":\s*"[^"\\]*",\s*"count":\s*\d+,\s*"id":\s*"([0-9a-f]*)"')


def manifest_id(path: Path) -> str:
    """The ``id`` of the manifest file at ``path``: from its first bytes when it has the
    layout ``to_json`` writes, else from a full parse."""
    head = limits.read_head(path, 4096)  # a FIFO planted here is refused, never waited on
    m = _ID_AT_START.match(head)
    return m.group(1).decode() if m else Manifest.from_json(
        limits.read_regular(path, limits.MAX_MANIFEST_BYTES), str(path)).id


def file_digest(path: Path, chunk: int = 1 << 20) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(chunk)  # one buffer read into: no fresh block per read held by the heap
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def dataset_files(path: Path) -> list[Path]:
    """A dataset's files: the one file, or every file below the folder."""
    path = Path(path)
    return [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]


def disk_bytes(path: Path) -> int:
    """Bytes a dataset (one file, or a folder's files) takes on disk."""
    return sum(p.stat().st_size for p in dataset_files(path))


def describe_files(root: Path, skip: tuple[str, ...] = (MANIFEST_NAME,)) -> dict[str, dict[str, Any]]:
    """Size and checksum of every file below ``root`` (relative posix paths)."""
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in skip and not rel.endswith("lock.mdb"):
            out[rel] = {"bytes": p.stat().st_size, DIGEST: file_digest(p)}
    return out
