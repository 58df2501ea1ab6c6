"""The spilled column the arrays and tar writers share: what it writes is np.save's, at the
writers' spill edges (8,192 rows), and it leaves no spill file behind, finished or failed."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from packio.formats.spill import SpilledColumn

EDGES = (0, 1, 8191, 8192, 8193)
EVERY = 8192  # rows the writers hold before they append them


def _saved(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


@pytest.mark.parametrize("n", EDGES)
@pytest.mark.parametrize("dtype,row", [("<i8", ()), ("<f4", (4,)), ("<i8", (5,)), ("u1", ())])
def test_spilled_column_is_what_np_save_writes(tmp_path, n, dtype, row):
    data = (np.arange(n * int(np.prod(row)), dtype=np.int64) * 7919 % 251).astype(dtype).reshape(n, *row)
    col = SpilledColumn(tmp_path / ".x.spill", dtype, row)
    for k in range(0, n, EVERY):
        col.append(data[k:k + EVERY])
    col.append(data[:0])  # an empty block, as a writer's close appends when n is a multiple of EVERY
    col.finish(tmp_path / "x.npy")
    assert (tmp_path / "x.npy").read_bytes() == _saved(data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]


@pytest.mark.parametrize("n", EDGES)
def test_spilled_column_with_a_head_row(tmp_path, n):
    """box_offsets: a leading 0 the spill does not hold, then every end appended."""
    ends = np.cumsum(np.arange(n, dtype=np.int64) % 3)
    col = SpilledColumn(tmp_path / ".o.spill", np.int64)
    for k in range(0, n, EVERY):
        col.append(ends[k:k + EVERY])
    col.finish(tmp_path / "o.npy", np.zeros(1, np.int64))
    assert (tmp_path / "o.npy").read_bytes() == _saved(np.concatenate([[0], ends]).astype(np.int64))


def test_spilled_column_refuses_other_rows_and_cleans_up(tmp_path):
    col = SpilledColumn(tmp_path / ".b.spill", np.float32, (4,))
    with pytest.raises(ValueError, match=r"float32\[4\]"):
        col.append(np.zeros((2, 4), np.float64))
    with pytest.raises(ValueError):
        col.append(np.zeros((2, 5), np.float32))
    col.append(np.ones((3, 4), np.float32))
    with pytest.raises(OSError):  # the .npy cannot be made: neither it nor the spill is left
        col.finish(tmp_path / "missing" / "b.npy")
    assert list(tmp_path.iterdir()) == []
    col = SpilledColumn(tmp_path / ".c.spill", np.int64)
    col.append(np.arange(3))
    col.discard()
    col.discard()  # twice: a writer's abort after a failed finish
    assert list(tmp_path.iterdir()) == []


def _pack(fmt: str, path: Path, n: int, abort: bool = False) -> None:
    from packio.formats import get_format
    from packio.formats.base import WriteOptions
    from packio.sample import Sample

    enc = {"arrays": "raw", "bmp": "bmp"}.get(fmt, "jpeg")
    payload = np.full((2, 2, 3), 7, np.uint8) if enc == "raw" else b"\xff\xd8\xff" + bytes(20)  # never decoded
    w = get_format(fmt).writer(path, WriteOptions(fixed_shape=(2, 2), shard_samples=5000))
    for i in range(n):
        k = i % 3
        w.add(Sample(key=f"k{i}" + "é" * (i % 5), payload=payload, encoding=enc,
                     label=i % 4 - 1, width=2, height=2, boxes=np.full((k, 4), i, np.float32),
                     box_labels=np.full(k, i, np.int64), checksum="0" * 16))
    w.abort() if abort else w.close()


@pytest.fixture
def small_spills(monkeypatch):
    """The writers append what they hold every 4 samples (8,192 in use): edges at 4, 8, ..."""
    import packio.formats.arrays as arrays
    import packio.formats.tar as tar
    from packio.formats.base import RecordFile

    for where, name in ((arrays, "_SPILL"), (tar, "_SPILL"), (RecordFile, "SPILL")):
        assert getattr(where, name) == EVERY
        monkeypatch.setattr(where, name, 4)


@pytest.mark.parametrize("n", (0, 1, 3, 4, 5, 9))
def test_writers_spilled_files_at_the_spill_edges(tmp_path, small_spills, n):
    """Through the writers: every column file is np.save's of the whole column, the record
    offsets read back, and no spill file is left."""
    _pack("arrays", tmp_path / "a.arrays", n)
    k = np.arange(n) % 3
    want = {"labels": np.arange(n, dtype=np.int64) % 4 - 1,
            "boxes": np.repeat(np.arange(n), k).astype(np.float32)[:, None].repeat(4, 1),
            "box_labels": np.repeat(np.arange(n, dtype=np.int64), k),
            "box_offsets": np.concatenate([[0], np.cumsum(k)]).astype(np.int64),
            "keys": np.array([f"k{i}" + "é" * (i % 5) for i in range(n)] or np.zeros(0, "U1"))}
    for name, arr in want.items():
        assert (tmp_path / "a.arrays" / f"{name}.npy").read_bytes() == _saved(arr), name
    from packio.formats.base import RecordFile

    idx = np.load(tmp_path / "a.arrays" / RecordFile.IDX)  # the record offsets, spilled the same way
    assert (tmp_path / "a.arrays" / RecordFile.IDX).read_bytes() == _saved(idx)
    assert len(idx) == n + 1 and idx[-1] == (tmp_path / "a.arrays" / RecordFile.BIN).stat().st_size
    idx, blob = RecordFile.load(tmp_path / "a.arrays", n)
    assert [RecordFile.get(idx, blob, i)["key"] for i in range(n)] == want["keys"].tolist()
    blob.close()
    _pack("tar", tmp_path / "t.wds", n)
    index = np.load(tmp_path / "t.wds" / "index.npy")
    assert index.shape == (n, 5) and index[:, 0].tolist() == [0] * n
    assert (tmp_path / "t.wds" / "index.npy").read_bytes() == _saved(index)
    assert not [p for p in tmp_path.rglob(".*")]


@pytest.mark.parametrize("fmt", ["arrays", "tar", "bmp"])
def test_an_aborted_writer_leaves_no_spill_file(tmp_path, small_spills, fmt):
    _pack(fmt, tmp_path / "out", 9, abort=True)
    assert not [p.name for p in (tmp_path / "out").rglob(".*")]
