"""Re-read a packed dataset and check every file and sample checksum."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from packio.errors import PackioError
from packio.formats import open_reader
from packio.manifest import DIGEST, file_digest
from packio.sample import checksum

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    path: str
    count: int = 0
    checked: int = 0
    bad_files: list[str] = field(default_factory=list)  # "relpath: reason"
    bad_samples: list[str] = field(default_factory=list)  # "#index key: reason"

    @property
    def ok(self) -> bool:
        return not self.bad_files and not self.bad_samples

    def text(self) -> str:
        head = (f"{self.path}: {'OK' if self.ok else 'DAMAGED'} — {self.checked}/{self.count} samples checked, "
                f"{len(self.bad_samples)} damaged, {len(self.bad_files)} files differ from the manifest")
        return "\n".join([head, *(f"  file {b}" for b in self.bad_files),
                          *(f"  sample {b}" for b in self.bad_samples)])


def verify(path: str | Path) -> VerifyReport:
    """Check each file against the manifest and each sample against its checksum."""
    reader = open_reader(path)
    report = VerifyReport(path=str(path), count=len(reader))
    root = Path(path)
    for rel, facts in reader.manifest.files.items():
        p = root / rel
        if not p.is_file():
            report.bad_files.append(f"{rel}: missing")
        elif p.stat().st_size != facts.get("bytes"):
            report.bad_files.append(f"{rel}: {p.stat().st_size} bytes, manifest says {facts.get('bytes')}")
        elif file_digest(p) != facts.get(DIGEST):
            report.bad_files.append(f"{rel}: checksum differs")
    for i in range(len(reader)):
        try:
            s = reader.read(i)
        except PackioError as exc:
            report.bad_samples.append(f"#{i}: {exc}")
            continue
        report.checked += 1
        if not s.checksum:
            report.bad_samples.append(f"#{i} {s.key}: no checksum stored")
        elif checksum(s.payload) != s.checksum:
            report.bad_samples.append(f"#{i} {s.key}: checksum mismatch")
    reader.close()
    return report
