"""Round trips on the shared real photo sets (skipped when ../shared/data is absent)."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import packio
from conftest import shared


def _check_bytes_and_boxes(out: Path, src: Path, rows_by_file: dict[str, list[list[float]]], classes_col: dict):
    ds = packio.open_dataset(out, decode=False)
    assert len(ds) == len(list(src.glob("*.jpg")))
    for i in range(len(ds)):
        s = ds.sample(i)
        assert s.payload == (src / s.key).read_bytes()
        want = np.asarray(rows_by_file.get(s.key, []), np.float32).reshape(-1, 4)
        # CSV row order is kept per image
        np.testing.assert_array_equal(s.boxes, want)
        assert [ds.box_classes[c] for c in s.box_labels] == classes_col.get(s.key, [])


@pytest.mark.parametrize("fmt", ["lmdb", "wds", "h5"])
def test_raccoon(tmp_path, fmt):
    root = shared("raccoon")
    csv_path = root / "data" / "raccoon_labels.csv"
    rows, cls = defaultdict(list), defaultdict(list)
    with open(csv_path, newline="") as f:
        for r in csv.DictReader(f):
            rows[r["filename"]].append([float(r[k]) for k in ("xmin", "ymin", "xmax", "ymax")])
            cls[r["filename"]].append(r["class"])
    s = packio.convert(root / "images", tmp_path / f"r.{fmt}", csv=csv_path, workers=2, progress=False)
    assert s.packed == 200 and not s.skipped
    assert s.info["duplicate_content"] == 4  # the four byte-identical pairs, kept
    _check_bytes_and_boxes(tmp_path / f"r.{fmt}", root / "images", rows, cls)


def test_bccd_column_mapping(tmp_path):
    root = shared("bccd")
    csv_path = root / "test.csv"
    rows, cls = defaultdict(list), defaultdict(list)
    with open(csv_path, newline="") as f:
        for r in csv.DictReader(f):  # columns: filename,cell_type,xmin,xmax,ymin,ymax (CRLF)
            rows[r["filename"]].append([float(r[k]) for k in ("xmin", "ymin", "xmax", "ymax")])
            cls[r["filename"]].append(r["cell_type"])
    s = packio.convert(root / "BCCD" / "JPEGImages", tmp_path / "b.lmdb", csv=csv_path,
                       columns={"class": "cell_type"}, progress=False)
    assert s.packed == 364 and not s.skipped
    _check_bytes_and_boxes(tmp_path / "b.lmdb", root / "BCCD" / "JPEGImages", rows, cls)
    m = packio.open_reader(tmp_path / "b.lmdb").manifest
    assert m.source["csv_columns"]["class"] == "cell_type"
    assert sum(map(len, rows.values())) == 4888


FORMATS = {"lmdb": {}, "h5": {}, "wds": {"shard_samples": 100},
           "bmpdir": {"resize": packio.ResizeSpec(short_side=64)},
           "arrays": {"resize": packio.ResizeSpec(size=(64, 64))}}


@pytest.mark.parametrize("suffix", sorted(FORMATS))
def test_hymenoptera_every_format(tmp_path, suffix):
    root = shared("hymenoptera") / "hymenoptera_data"
    s = packio.convert(root, tmp_path / f"h.{suffix}", workers=2, progress=False, **FORMATS[suffix])
    assert s.packed == 397
    assert dict(s.skipped) == {"unsupported image type (gif)": 1}
    assert any("imageNotFound.gif" in p for p in s.problems)
    ds = packio.open_dataset(tmp_path / f"h.{suffix}", resize=(32, 32))
    assert ds.classes == ["ants", "bees"]
    keys = {ds.sample(i).key: ds.sample(i) for i in range(len(ds))}
    assert "train/ants/ant photos.jpg" in keys and "train/ants/formica.jpeg" in keys
    for key, smp in keys.items():
        assert ds.classes[smp.label] == key.split("/")[1]
        if not FORMATS[suffix]:
            assert smp.payload == (root / key).read_bytes()
    batch = packio.collate([ds[i] for i in range(8)])
    assert tuple(batch["image"].shape) == (8, 3, 32, 32)
    assert packio.verify(tmp_path / f"h.{suffix}").ok
