"""A column a writer streams to disk as it grows, made into an ``.npy`` at close: held in
memory, per-sample columns were tens of bytes a sample at a pack's peak (issue 25).
The ``.npy`` is byte for byte what ``np.save`` writes of the whole column."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = ["SpilledColumn", "npy_header"]


def npy_header(f: Any, dtype: Any, shape: tuple[int, ...]) -> None:
    """Write the header ``np.save`` writes for a C-order array of ``dtype`` and ``shape``
    (then its raw bytes follow): a column streamed to disk is byte for byte np.save's."""
    header = np.lib.format.header_data_from_array_1_0(np.empty(0, dtype))
    header["shape"] = shape
    np.lib.format.write_array_header_1_0(f, header)


class SpilledColumn:
    """Rows of one dtype and row shape, appended a block at a time to ``path`` (a hidden
    file beside the output), then put behind an ``.npy`` header by :meth:`finish` or read
    back with :meth:`read_back`. The spill file is removed by ``finish`` and ``discard``."""

    def __init__(self, path: Path, dtype: Any, row_shape: tuple[int, ...] = ()) -> None:
        self.path, self.dtype, self.row_shape = path, np.dtype(dtype), row_shape
        self.rows = 0
        self._f = open(path, "wb")

    def append(self, rows: np.ndarray) -> None:
        """Append ``rows``: an array of this column's dtype and row shape."""
        self._f.write(self._checked(rows).data)
        self.rows += len(rows)

    def _checked(self, rows: np.ndarray) -> np.ndarray:
        if rows.dtype != self.dtype or rows.shape[1:] != self.row_shape:
            raise ValueError(f"{self.path.name}: rows of {rows.dtype}{list(rows.shape[1:])}, "
                             f"the column holds {self.dtype}{list(self.row_shape)}")
        return np.ascontiguousarray(rows)

    def finish(self, dst: Path, head: np.ndarray | None = None) -> None:
        """``dst``: an ``.npy`` of ``head``'s rows (if any) then every row appended. On failure
        neither ``dst`` nor the spill file is left."""
        lead = self._checked(np.zeros((0, *self.row_shape), self.dtype) if head is None else head)
        try:
            with self.read_back() as src, open(dst, "wb") as f:
                npy_header(f, self.dtype, (len(lead) + self.rows, *self.row_shape))
                f.write(lead.data)
                shutil.copyfileobj(src, f, 1 << 16)  # shutil's own size; 1 MiB was a MiB more of peak
        except BaseException:
            dst.unlink(missing_ok=True)
            raise
        finally:
            self.discard()

    def read_back(self) -> BinaryIO:
        """The spill file, written out and opened for reading (the caller closes it)."""
        self._f.close()
        return open(self.path, "rb")

    def discard(self) -> None:
        """Close and remove the spill file (a failed or finished write)."""
        self._f.close()
        self.path.unlink(missing_ok=True)
