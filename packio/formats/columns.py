"""Labels and boxes as plain columns: the one layout HDF5 and arrays share, readable
by h5py / numpy alone, and what a whole-batch read slices without parsing records.

- ``labels`` int64[N]: each sample's class index (-1: none)
- ``boxes`` float32[M, 4]: every box, xyxy pixels of the stored image
- ``box_labels`` int64[M]: each box's class index
- ``box_offsets`` int64[N+1]: the boxes of sample i are rows ``box_offsets[i]:box_offsets[i+1]``
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np

from packio.errors import FormatError
from packio.sample import Sample

__all__ = ["NAMES", "ColumnBuffer", "Columns", "LabelColumns"]

NAMES = ("labels", "boxes", "box_labels", "box_offsets")


class ColumnBuffer:
    """Collects the columns of samples as they are written, in growing flat arrays (no
    Python object per sample: millions of samples cost their bytes, not ~500 B each)."""

    def __init__(self) -> None:
        self._labels = array("q")
        self._boxes = array("f")
        self._box_labels = array("q")
        self._counts = array("q")
        self._box_total = 0  # boxes drained so far: where the next offsets start

    def add(self, sample: Sample) -> None:
        boxes = np.asarray(sample.boxes, np.float32).reshape(-1, 4)
        self._labels.append(int(sample.label))
        self._counts.append(len(boxes))
        if len(boxes):
            self._boxes.frombytes(np.ascontiguousarray(boxes).tobytes())
            self._box_labels.frombytes(np.asarray(sample.box_labels, np.int64).reshape(-1).tobytes())

    def drain(self) -> dict[str, np.ndarray]:
        """The rows added since the last drain. ``box_offsets`` holds their end offsets
        only (absolute): a writer starts the column with ``[0]`` and appends these."""
        # views of the arrays dropped below (no copy: they are never appended to again)
        col = lambda a, dtype: np.frombuffer(a, dtype) if len(a) else np.zeros(0, dtype)  # noqa: E731
        ends = self._box_total + np.cumsum(col(self._counts, np.int64), dtype=np.int64)
        out = {"labels": col(self._labels, np.int64), "boxes": col(self._boxes, np.float32).reshape(-1, 4),
               "box_labels": col(self._box_labels, np.int64), "box_offsets": ends.astype(np.int64)}
        if len(ends):
            self._box_total = int(ends[-1])
        self._labels, self._boxes, self._box_labels, self._counts = array("q"), array("f"), array("q"), array("q")
        return out


@dataclass(frozen=True)
class Columns:
    """The four columns of a dataset of ``n`` samples, checked against each other."""

    labels: np.ndarray
    boxes: np.ndarray
    box_labels: np.ndarray
    box_offsets: np.ndarray

    @classmethod
    def checked(cls, arrays: dict[str, Any], n: int, where: str) -> "Columns":
        """Validate columns read from a stranger's file: dtypes, shapes, offsets that
        start at 0, never decrease and end at the number of boxes."""
        try:
            labels, boxes, box_labels, off = (np.asarray(arrays[k]) for k in NAMES)
        except KeyError as exc:
            raise FormatError(f"{where}: the {exc} column is missing; the dataset is damaged, re-pack it") from None
        ok = (labels.shape == (n,) and labels.dtype == np.int64
              and boxes.dtype == np.float32 and boxes.ndim == 2 and boxes.shape[1] == 4
              and box_labels.shape == (len(boxes),) and box_labels.dtype == np.int64
              and off.shape == (n + 1,) and off.dtype == np.int64
              and off[0] == 0 and off[-1] == len(boxes) and bool(np.all(np.diff(off) >= 0)))
        if not ok:
            raise FormatError(f"{where}: label/box columns do not match the manifest's {n} samples; "
                              f"the dataset is damaged, re-pack it")
        return cls(labels, boxes, box_labels, off)

    def take(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(labels[B], boxes[M, 4], box_labels[M], counts[B])`` for these sample indices:
        the batch's boxes as one block, sample after sample (``counts`` boxes each), gathered
        with a few numpy calls whatever the batch size (a plain slice for a run of indices)."""
        starts, ends = self.box_offsets[idx], self.box_offsets[idx + 1]
        counts = ends - starts
        if len(idx) and bool(np.all(starts[1:] == ends[:-1])):  # consecutive samples: one run of rows
            rows: slice | np.ndarray = slice(int(starts[0]), int(ends[-1]))  # copied below: not a view of the column
        else:  # row r of the block is box (r - first row of its sample) of that sample
            firsts = np.cumsum(counts) - counts
            rows = np.repeat(starts - firsts, counts) + np.arange(int(counts.sum()))
        if isinstance(rows, slice):
            return self.labels[idx], self.boxes[rows].copy(), self.box_labels[rows].copy(), counts
        return self.labels[idx], self.boxes[rows], self.box_labels[rows], counts

    def counted(self) -> "LabelColumns":
        """The labels and each sample's box count (a reader's :meth:`columns`)."""
        return LabelColumns(self.labels, np.diff(self.box_offsets))


@dataclass(frozen=True)
class LabelColumns:
    """Every sample's ``labels`` (int64[N], -1: none) and ``box_counts`` (int64[N]), read
    without decoding an image (:meth:`packio.formats.reader.Reader.columns`)."""

    labels: np.ndarray
    box_counts: np.ndarray

    def __post_init__(self) -> None:
        for a in (self.labels, self.box_counts):
            a.flags.writeable = False  # read once, handed to every caller: nobody's edit may change them

    @classmethod
    def joined(cls, parts: list["LabelColumns"], maps: list[list[int]] | None = None) -> "LabelColumns":
        """Parts one after another; ``maps[k]``: part ``k``'s class ids as ids of one list (an id
        it does not map: -1), as a mix relabels its sources."""
        labels = [p.labels if maps is None else np.asarray([*maps[k], -1], np.int64)[
            np.where((p.labels >= 0) & (p.labels < len(maps[k])), p.labels, -1)] for k, p in enumerate(parts)]
        empty = np.zeros(0, np.int64)
        return cls(np.concatenate([empty, *labels]), np.concatenate([empty, *(p.box_counts for p in parts)]))

    def class_counts(self, names: list[str]) -> dict[str, int]:
        """Samples per class, every name of ``names`` in order (0 included): ``list(values())``
        is indexed by label. Samples without a label (-1) are not counted."""
        counts = np.bincount(self.labels[self.labels >= 0], minlength=len(names))
        return dict(zip(names, counts[:len(names)].tolist()))
