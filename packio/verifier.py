"""Re-read a packed dataset and check everything a reader trusts: the manifest's own
digest, every file it lists, format-specific arrays, and every sample's checksum."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from packio.errors import CorruptSampleError, FormatError, PackioError
from packio.formats import open_reader
from packio.formats.reader import Reader, inside
from packio.manifest import DIGEST, MANIFEST_NAME, file_digest, trust_manifest
from packio.decode import check_decode
from packio.sample import Sample, checksum

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    path: str
    count: int = 0
    checked: int = 0
    bad_files: list[str] = field(default_factory=list)  # "relpath: reason"
    bad_samples: list[str] = field(default_factory=list)  # "#index key: reason"
    foreign: bool = False  # shards another tool wrote: no checksums, so every image is decoded instead

    @property
    def ok(self) -> bool:
        """Every sample checked and found sound; a dataset of no samples is not OK: nothing was verified."""
        return not self.bad_files and not self.bad_samples and not self.empty

    @property
    def empty(self) -> bool:
        return self.count == 0 and not self.bad_files and not self.bad_samples

    def text(self) -> str:
        if self.empty:
            why = ("no member of the shards is an image packio reads (.jpg .jpeg .png .webp .bmp, named "
                   "{key}.ext)" if self.foreign else "its manifest lists no samples")
            return f"{self.path}: EMPTY — 0 samples, nothing was verified: {why}"
        head = (f"{self.path}: {'OK' if self.ok else 'DAMAGED'} — {self.checked}/{self.count} samples checked, "
                f"{len(self.bad_samples)} damaged, {len(self.bad_files)} files differ from the manifest")
        note = ["  (shards written by another tool carry no checksums: every image was decoded instead)"
                if self.foreign else ""]
        return "\n".join([head, *filter(None, note), *(f"  file {b}" for b in self.bad_files),
                          *(f"  sample {b}" for b in self.bad_samples)])


def _why(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, PackioError) else f"{type(exc).__name__}: {exc}"


def _check_files(reader: Reader, out: list[str], known: dict[str, str]) -> None:
    """The manifest against its digest; each listed file's size and checksum (only
    files inside the dataset are read); ``known``: files already found damaged, each
    reported once with the reason given."""
    m = reader.manifest
    if not m.source.get("foreign"):
        where = MANIFEST_NAME if reader.path.is_dir() else "manifest"
        if not m.digest:
            out.append(f"{where}: no content digest (packed by an older packio); re-pack to protect it")
        elif m.digest != m.content_digest():
            out.append(f"{where}: content differs from its digest (edited or damaged)")
    for rel, facts in m.files.items():
        if rel in known:
            out.append(f"{rel}: {known[rel]}")
            continue
        try:
            p = inside(reader.path, rel)
            if not p.is_file():
                out.append(f"{rel}: missing or not a regular file")
            elif p.stat().st_size != facts.get("bytes"):
                out.append(f"{rel}: {p.stat().st_size} bytes, manifest says {facts.get('bytes')}")
            elif file_digest(p) != facts.get(DIGEST):
                out.append(f"{rel}: checksum differs")
        except (FormatError, OSError) as exc:
            out.append(f"{rel}: {_why(exc)}")


def verify(path: str | Path | Reader, damaged: dict[str, str] | None = None) -> VerifyReport:
    """Check a packed dataset; damage of any kind is reported, never raised. Raises
    only a PackioError when ``path`` cannot be opened as a packed dataset at all.
    An edited manifest is opened anyway (:func:`trust_manifest`), to report it.
    ``damaged``: listed files found damaged already (a download refused), not read again."""
    with trust_manifest():
        return _verify(path, damaged or {})


def _verify(path: str | Path | Reader, damaged: dict[str, str]) -> VerifyReport:
    reader = open_reader(path)
    report = VerifyReport(path=str(path), count=len(reader), foreign=bool(reader.manifest.source.get("foreign")))
    try:
        _check_files(reader, report.bad_files, damaged)
        report.bad_files += reader.check_stored()  # what the format keeps beyond the listed files
    except Exception as exc:  # noqa: BLE001 - hostile files: whatever a library raises goes into the report
        report.bad_files.append(f"(stored data): cannot be checked ({_why(exc)})")
    for i in range(len(reader)):
        try:
            s = reader.read(i)
        except Exception as exc:  # noqa: BLE001 - damage of any kind is a line in the report
            if i == 0 and not isinstance(exc, CorruptSampleError):  # the dataset itself cannot be opened
                report.bad_files.append(f"(dataset): cannot be read ({_why(exc)})")
                break
            report.bad_samples.append(f"#{i}: {_why(exc)}")
            continue
        report.checked += 1
        if report.foreign:
            _check_image(s, i, report.bad_samples)
        elif not s.checksum:
            report.bad_samples.append(f"#{i} {s.key}: no checksum stored")
        elif checksum(s.payload) != s.checksum:
            report.bad_samples.append(f"#{i} {s.key}: checksum mismatch")
    reader.close()
    return report


def _check_image(s: Sample, i: int, out: list[str]) -> None:
    try:
        check_decode(s.payload)
    except Exception as exc:  # noqa: BLE001 - a stranger's image: any decoder error is damage
        out.append(f"#{i} {s.key}: the image does not decode ({_why(exc)})")
