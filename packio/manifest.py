"""The self-describing manifest (JSON) stored with every packed dataset."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from packio import limits
from packio.errors import FormatError

__all__ = ["MANIFEST_NAME", "DIGEST", "LAYOUT_VERSION", "Manifest", "file_digest", "describe_files", "disk_bytes"]

MANIFEST_NAME = "packio.json"
DIGEST = "xxh3_128"  # file checksums; samples carry xxh3_64 (packio.sample.checksum)
LAYOUT_VERSION = 1


@dataclass
class Manifest:
    """What a packed dataset holds; enough to open it without packio's help."""

    format: str
    count: int
    classes: list[str] = field(default_factory=list)
    image: dict[str, Any] = field(default_factory=dict)  # encoding, size, resize spec
    source: dict[str, Any] = field(default_factory=dict)  # path, csv, column map
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # relpath -> bytes, xxh3_128
    extra: dict[str, Any] = field(default_factory=dict)  # format-specific layout facts
    summary: dict[str, Any] = field(default_factory=dict)  # packed / skipped counts
    version: int = LAYOUT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> "Manifest":
        raw = limits.loads_json(text, f"{where}: manifest", limits.MAX_MANIFEST_BYTES)
        if not isinstance(raw, dict):
            raise FormatError(f"{where}: manifest is not a JSON object")
        if raw.get("version") != LAYOUT_VERSION:
            raise FormatError(
                f"{where}: manifest version {raw.get('version')!r} is not supported by this "
                f"packio (reads version {LAYOUT_VERSION}); upgrade packio or re-pack the data")
        types = {"format": str, "count": int, "classes": list, "image": dict, "source": dict,
                 "files": dict, "extra": dict, "summary": dict}
        for name, typ in types.items():
            if name in raw and not isinstance(raw[name], typ):
                raise FormatError(f"{where}: manifest field {name!r} should be {typ.__name__}")
        if "format" not in raw or "count" not in raw or isinstance(raw["count"], bool) or raw["count"] < 0:
            raise FormatError(f"{where}: manifest lacks 'format' or a valid 'count'")
        if not all(isinstance(c, str) for c in raw.get("classes", [])):
            raise FormatError(f"{where}: manifest 'classes' must be strings")
        known = {k: raw[k] for k in (*types, "version") if k in raw}
        return cls(**known)


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def disk_bytes(path: Path) -> int:
    """Bytes a dataset (one file, or a folder's files) takes on disk."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def describe_files(root: Path, skip: tuple[str, ...] = (MANIFEST_NAME,)) -> dict[str, dict[str, Any]]:
    """Size and checksum of every file below ``root`` (relative posix paths)."""
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in skip and not rel.endswith("lock.mdb"):
            out[rel] = {"bytes": p.stat().st_size, DIGEST: file_digest(p)}
    return out
