"""What a dataset's labels and boxes add up to, said where a user looks (the convert
summary, ``packio info``), with a warning when the boxes' classes were plainly missed."""

from __future__ import annotations

import csv
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from packio.manifest import Manifest, count_text
from packio.sample import Sample

__all__ = ["Tally", "describe", "unused_text_columns"]

NO_CLASS = "-1 (no class)"
_NUMBER = re.compile(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*")


class Tally:
    """Counts of image labels and box classes over the samples packed (by index; names at the end)."""

    def __init__(self) -> None:
        self.labels: Counter[int] = Counter()
        self.box_labels: Counter[int] = Counter()
        self.with_boxes = 0

    def add(self, sample: Sample) -> None:
        self.labels[int(sample.label)] += 1
        n = len(sample.box_labels)
        if n:
            self.with_boxes += 1
            self.box_labels.update(np.asarray(sample.box_labels).tolist())

    def to_json(self, classes: list[str], box_classes: list[str] | None = None) -> dict[str, Any]:
        """Counts by name: image labels index ``classes``, box labels ``box_classes`` (``classes`` when None)."""
        def name(i: int, names: list[str] = classes) -> str:
            return names[i] if 0 <= i < len(names) else NO_CLASS

        boxed = classes if box_classes is None else box_classes

        return {"images_without_label": self.labels.get(-1, 0),
                "labels": {name(i): n for i, n in sorted(self.labels.items()) if i >= 0},
                "boxes": sum(self.box_labels.values()), "images_with_boxes": self.with_boxes,
                "box_classes": {name(i, boxed): n for i, n in sorted(self.box_labels.items())}}


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The tallies of several parts (their ``to_json``) as one."""
    out: dict[str, Any] = {"images_without_label": 0, "labels": Counter(), "boxes": 0, "images_with_boxes": 0,
                           "box_classes": Counter()}
    for p in parts:
        for k in ("images_without_label", "boxes", "images_with_boxes"):
            out[k] += p.get(k, 0)
        out["labels"].update(p.get("labels", {}))
        out["box_classes"].update(p.get("box_classes", {}))
    return {**out, "labels": dict(out["labels"]), "box_classes": dict(out["box_classes"])}


def unused_text_columns(csv_path: str | Path | None, used: dict[str, str] | None, rows: int = 200) -> list[str]:
    """Columns of the CSV that packing did not use and that hold text (not numbers), from its
    first ``rows`` rows: the likely class column when boxes came out without classes."""
    if not csv_path:
        return []
    try:
        with open(csv_path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            header = [h for h in reader.fieldnames or [] if h not in set((used or {}).values())]
            text = {h: False for h in header}
            for _, row in zip(range(rows), reader):
                for h in header:
                    v = row.get(h)
                    text[h] |= isinstance(v, str) and bool(v.strip()) and not _NUMBER.fullmatch(v)
    except (OSError, UnicodeDecodeError, csv.Error):
        return []  # the scan already read it; a hint is not worth an error
    return [h for h in header if text[h]]


def _counts(counts: Any, most: int = 12) -> str:
    """``name count, ...``, most first; a manifest's counts that are not counts: ``invalid``."""
    if not isinstance(counts, dict):
        return "invalid"
    items = sorted(counts.items(), key=lambda kv: -kv[1] if count_text(kv[1]) != "invalid" else 0)
    text = ", ".join(f"{k} {count_text(v, grouped=True)}" for k, v in items[:most])
    return text + (f", ... ({len(items) - most} more)" if len(items) > most else "")


def describe(m: Manifest) -> list[str]:
    """Summary lines: image labels, boxes and their classes, and the missed-class warning."""
    a = m.summary.get("annotations") if isinstance(m.summary, dict) else None
    if not isinstance(a, dict):
        return []
    lines = []
    labels, without = a.get("labels") or {}, a.get("images_without_label", 0)
    if labels:
        lines.append(f"labels:   {_counts(labels)}" +
                     (f"; {count_text(without, True)} images without a label" if without else ""))
    else:
        lines.append(f"labels:   none ({count_text(without, True)} images without a label)")
    boxes, classes = a.get("boxes", 0), a.get("box_classes") or {}
    if boxes:
        lines.append(f"boxes:    {count_text(boxes, True)} on {count_text(a.get('images_with_boxes', 0), True)} "
                     f"images; classes: {_counts(classes)}")
        unused = m.source.get("csv_unused_text")
        unused = unused if isinstance(unused, list) else []
        if isinstance(classes, dict) and set(classes) == {NO_CLASS}:
            hint = (f": did you mean `--csv-columns class={unused[0]}`?" if unused else
                    ": give the CSV a class column, or map yours with --csv-columns class=COLUMN")
            lines.append(f"warning:  every box has label -1 (no class){hint}")
    return lines
