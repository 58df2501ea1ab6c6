"""A toy sixth format, registered only by the tests: one ``.toy`` file holding a magic
line and one msgpack map (manifest JSON, records, payloads). It exists to show that a
format is one module plus one registration: nothing in packio names it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from packio.errors import FormatError
from packio.formats.base import (FormatSpec, WriteOptions, Writer, decode_stored, file_starts_with, pack_record,
                                 payload_bytes, unpack_record)
from packio.formats.reader import Reader
from packio.manifest import Manifest
from packio.sample import Sample

MAGIC = b"PACKIO-TOY\n"


class ToyWriter(Writer):
    def __init__(self, path: Path, options: WriteOptions) -> None:
        super().__init__(path, options)
        self.records: list[bytes] = []
        self.payloads: list[bytes] = []

    def add(self, sample: Sample) -> None:
        self.records.append(pack_record(sample.record()))
        self.payloads.append(bytes(payload_bytes(sample)))
        self.count += 1

    def close(self) -> dict[str, Any]:
        return {"layout": "magic line + msgpack {manifest, records, payloads}"}

    def write_manifest(self, manifest: Manifest) -> None:
        manifest.files = {}  # one file: the manifest lives inside it
        body = {"manifest": manifest.to_json(), "records": self.records, "payloads": self.payloads}
        self.path.write_bytes(MAGIC + pack_record(body))


def _load(path: Path) -> dict[str, Any]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FormatError(f"{path}: cannot read ({exc.strerror})") from None
    if not data.startswith(MAGIC):
        raise FormatError(f"{path}: not a toy file")
    body = unpack_record(data[len(MAGIC):], str(path))
    if not isinstance(body, dict) or not all(k in body for k in ("manifest", "records", "payloads")):
        raise FormatError(f"{path}: toy file lacks its parts")
    return body


class ToyReader(Reader):
    MANIFEST_BESIDE = False  # the manifest lives inside the one file

    @classmethod
    def claims(cls, path: str) -> bool:
        return file_starts_with(path, MAGIC)

    @classmethod
    def open_unlisted(cls, path: str) -> "ToyReader":
        return cls(Path(path), cls.read_manifest(Path(path)))

    @classmethod
    def read_manifest(cls, path: Path) -> Manifest:
        return Manifest.from_json(_load(path)["manifest"], str(path))

    def _open(self) -> None:
        body = _load(self.path)
        self._h_records, self._h_payloads = body["records"], body["payloads"]
        if len(self._h_records) != self.manifest.count or len(self._h_payloads) != self.manifest.count:
            raise FormatError(f"{self.path}: holds a different number of samples than its manifest says")

    def _drop_handles(self) -> None:
        self.__dict__.pop("_h_records", None)
        self.__dict__.pop("_h_payloads", None)

    def _load(self, i: int) -> Sample:
        rec = unpack_record(self._h_records[i], f"#{i}")
        return decode_stored(rec, self._h_payloads[i], f"#{i}")


FORMAT = FormatSpec(name="toy", suffixes=(".toy",), writer=ToyWriter, reader=ToyReader)
