"""What a conversion reports: the :class:`Summary` it returns (and its text), the
history of steps the manifest records, and the lines telling how to open the output.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packio import census
from packio.formats import formats
from packio.manifest import Manifest, count_text, disk_bytes
from packio.pack.prepare import ENLARGED

__all__ = ["Summary", "describe_output", "describe_history", "history_of", "image_facts", "summarize"]


@dataclass
class Summary:
    output: str
    format: str
    packed: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    manifest: Manifest | None = None

    def line(self) -> str:
        """The summary in one line (``convert --quiet``): what was packed, skipped, appended."""
        appended = f"; appended: {self.info['appended']}" if self.info.get("appended") else ""
        return (f"packed {self.packed} samples into {self.output} ({self.format}, {self.bytes / 1e6:.1f} MB) in "
                f"{self.seconds:.1f} s, skipped {sum(self.skipped.values())}{appended}")

    def warnings(self) -> list[str]:
        """What asks for the user's attention: images the resize enlarged, an image folder
        packed with no label at all, boxes left without a class (the summary prints these;
        ``--quiet`` too, on stderr)."""
        if self.manifest is None:
            return []
        boxes = [line for line in census.describe(self.manifest) if line.startswith("warning:")]
        return boxes + _warnings(self.manifest, self.info.get("notes") or {}, self.packed)

    def text(self) -> str:
        skipped = sum(self.skipped.values())
        lines = [f"packed {self.packed} samples into {self.output} ({self.format}, "
                 f"{self.bytes / 1e6:.1f} MB) in {self.seconds:.1f} s"]
        if self.manifest is not None and "://" not in self.output:  # a URL: 'packio info URL' describes it
            lines += describe_output(self.output, self.manifest)
        if self.manifest is not None:
            lines += census.describe(self.manifest)
        if self.info.get("workers"):
            w = self.info["workers"]  # packing processes, not a DataLoader's workers: said apart
            lines.append(f"packing:  {w if 'Dask' in w else '--workers ' + w}")
        if self.info.get("appended"):
            lines.append(f"appended: {self.info['appended']}")
        lines.append(f"skipped {skipped}" + (":" if skipped else ""))
        lines += [f"  {n:6d}  {reason}" for reason, n in sorted(self.skipped.items())]
        if self.info.get("duplicate_content"):
            lines.append(f"note: {self.info['duplicate_content']} samples are byte-identical to another (kept)")
        lines += [f"note: {n} x {what}" for what, n in sorted(self.info.get("notes", {}).items()) if what != ENLARGED]
        extra = _warnings(self.manifest, self.info.get("notes") or {}, self.packed) if self.manifest else []
        return "\n".join(lines + extra)  # the census lines above hold its own warnings


def _warnings(m: Manifest, notes: dict[str, Any], packed: int) -> list[str]:
    out = []
    enlarged = notes.get(ENLARGED, 0)
    r = m.image.get("resize") if isinstance(m.image.get("resize"), dict) else {}
    if enlarged:
        option = "--short-side" if r.get("short_side") else "--size" if r.get("size") else "size"
        asked = (f"--short-side {r['short_side']}" if r.get("short_side") else
                 f"--size {_dims(r['size'])}" if r.get("size") else "the resize")
        out.append(f"warning:  {enlarged} of {packed} images are smaller than {asked} asks and were enlarged: stored "
                   f"with more pixels than they have (larger files, no detail gained); a smaller {option} keeps them "
                   "as they are")
    a = m.summary.get("annotations") if isinstance(m.summary.get("annotations"), dict) else {}
    from_folder = not m.source.get("csv") and not m.source.get("packed_format") and "foreign" not in m.source
    if from_folder and packed and not a.get("labels") and not a.get("boxes") and a.get("images_without_label"):
        out.append("hint:     no image has a label (a flat or single-folder source, and no --csv): label them "
                   "with --csv FILE (columns filename,label; csv= in Python), or sort them into one sub-folder per "
                   "class")
    return out


def history_of(m: Manifest) -> list[dict[str, Any]]:
    """The source dataset's recorded steps (datasets from before packio kept them get one summary step)."""
    steps = m.image.get("history")
    if isinstance(steps, list) and all(isinstance(x, dict) for x in steps):
        return [dict(x) for x in steps[-31:]]
    return [{"from": "unrecorded (packed before packio kept a history)", "to": m.format,
             "resize": m.image.get("resize"), "payload": m.image.get("payload")}]


def image_facts(image: dict[str, Any], done: Counter[str], stored: Counter[str], jpeg: bool) -> dict[str, Any]:
    """The manifest's ``image`` entry once written: what this step did (``done``), the
    encodings stored, and the JPEG quality when it encoded any JPEG."""
    history = [*image["history"][:-1], {**image["history"][-1], "quality": image["quality"] if jpeg else None,
                                        "result": dict(sorted(done.items()))}]
    return {**image, "quality": image["quality"] if jpeg else None, "encodings": dict(sorted(stored.items())),
            "history": history}


def summarize(dst: Path, format: str, problems: list[str], part: dict[str, Any], t0: float) -> Summary:
    """The Summary of a committed conversion: ``part`` is what writing it returned, ``problems``
    what the listing found before, ``t0`` when it started (``time.perf_counter``)."""
    return Summary(output=str(dst), format=format, packed=part["count"], skipped=Counter(part["skipped"]),
                   problems=[*problems, *part["problems"]], bytes=disk_bytes(dst), seconds=time.perf_counter() - t0,
                   info={"duplicate_content": part["duplicate_content"], "notes": dict(part["notes"]),
                         "workers": part.get("workers")}, manifest=part["manifest"])


def describe_output(where: str, m: Manifest) -> list[str]:
    """Lines telling how to open the dataset whose files lie at ``where`` (a folder, a
    file, or the URL they are served at) with the neighbours' tools, and what its images are."""
    spec = formats().get(m.format)
    lines: list[str] = spec.reader.describe(where, m) if spec is not None else []
    enc = m.image.get("encodings") or {}
    if isinstance(enc, dict) and enc:
        step = _whole_step(m.image.get("history") or [])
        lines.append(f"images:   {', '.join(f'{count_text(v)} {k}' for k, v in enc.items())}: "
                     .replace("raw", "uint8 pixels")
                     + _step_text(step))
    return lines


def _whole_step(steps: list[Any]) -> dict[str, Any]:
    """The step that made the whole dataset: its conversion and every ``convert --append``
    after it (the parts share their settings), their results summed."""
    steps = [s for s in steps if isinstance(s, dict)]
    if not steps:
        return {}
    k = len(steps) - 1
    while k > 0 and steps[k].get("appended"):
        k -= 1
    done: Counter[str] = Counter()
    for s in steps[k:]:
        result = s.get("result") if isinstance(s.get("result"), dict) else {}
        done.update({str(what): n for what, n in result.items() if isinstance(n, int) and not isinstance(n, bool)})
    quality = next((s["quality"] for s in steps[k:] if s.get("quality")), None)
    return {**steps[k], "result": dict(done), "quality": quality}


def describe_history(m: Manifest) -> list[str]:
    """The recorded steps from the first source to this dataset, one line each; an appended
    part's line ends with the part and the samples it added."""
    steps = m.image.get("history") or []
    parts = m.extra.get("parts") if isinstance(m.extra.get("parts"), list) else []
    added = {p.get("path"): p.get("count") for p in parts if isinstance(p, dict) and isinstance(p.get("path"), str)}
    lines = []
    for i, s in enumerate(steps if isinstance(steps, list) else [], 1):
        if not isinstance(s, dict):
            continue
        name = s.get("appended")
        count = added.get(name) if isinstance(name, str) else None
        mark = f"; appended: {name} (+{count_text(count)} samples)" if name else ""
        lines.append(f"{i}. {s.get('from', '?')} {s.get('source', '')} → {s.get('to', '?')}: {_step_text(s)}{mark}")
    return lines


def _dims(value: Any) -> str:
    """``HxW`` of a recorded size, ``invalid`` when it is not a list of counts."""
    return "x".join(map(count_text, value)) if isinstance(value, list) else "invalid"


def _step_text(step: dict[str, Any]) -> str:
    done = step.get("result") if isinstance(step.get("result"), dict) else {}
    kept = [f"{count_text(v)} {str(k).removesuffix(' kept')}" for k, v in done.items() if str(k).endswith(" kept")]
    changed = [f"{count_text(v)} {k}".replace("raw", "uint8 pixels") for k, v in done.items()
               if not str(k).endswith(" kept")]
    parts = ([", ".join(kept) + " kept as found (not re-encoded)"] if kept else []) + (
        [", ".join(changed)] if changed else [])
    if not done:
        parts.append(f"stored as {step.get('payload', '?')}")
    r = step.get("resize")
    if isinstance(r, dict):
        geo = (f"short side {count_text(r['short_side'])}" if r.get("short_side") else
               _dims(r["size"]) if r.get("size") else "")
        crop = "center crop " + _dims(r["crop"]) if r.get("crop") else ""
        parts.append("resized to " + ", ".join(x for x in (geo, crop) if x))
    if step.get("quality") and any(str(k).endswith("→jpeg") for k in done):
        parts.append(f"JPEG quality {count_text(step['quality'])}")
    if any(str(k).startswith("raw→") for k in done) and step.get("encode") == "keep":
        parts.append("decoded pixels stored lossless; --encode jpeg for smaller files")
    return "; ".join(parts)
