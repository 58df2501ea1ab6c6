"""The convert summary and `packio info` say how many boxes and box classes a dataset has,
how many images lack a label, and warn when every box came out without a class while the
CSV held an unused text column (bccd's `cell_type`)."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import pytest

import packio
from conftest import TRUTH, jpeg, shared
from packio.census import merge
from packio.cli import main


def _info(path: Path, capsys) -> str:
    assert main(["info", str(path)]) == 0
    return capsys.readouterr().out


def _flat(tmp_path: Path, n: int = 5) -> tuple[Path, Path]:
    flat = tmp_path / "flat"
    flat.mkdir()
    rows = ["filename,cell_type,xmin,xmax,ymin,ymax"]
    for i in range(n):
        (flat / f"b{i}.jpg").write_bytes(jpeg(48, 64, seed=i))
        rows += [f"b{i}.jpg,{'RBC' if k % 2 else 'WBC'},{2 + k},{20 + k},3,30" for k in range(i + 1)]
    (tmp_path / "cells.csv").write_text("\n".join(rows) + "\n")
    return flat, tmp_path / "cells.csv"


def test_unmapped_class_column_warns_and_names_it(tmp_path, capsys):
    flat, table = _flat(tmp_path)
    cols = {"xmin": "xmin", "xmax": "xmax", "ymin": "ymin", "ymax": "ymax"}
    s = packio.convert(flat, tmp_path / "a.lmdb", csv=table, columns=cols, progress=False)
    want = "warning:  every box has label -1 (no class): did you mean `--csv-columns class=cell_type`?"
    assert "boxes:    15 on 5 images; classes: -1 (no class) 15" in s.text() and want in s.text(), s.text()
    assert want in _info(tmp_path / "a.lmdb", capsys)
    args = ["--csv", str(table), "--csv-columns", ",".join(f"{k}={v}" for k, v in cols.items()), "--quiet"]
    assert main(["convert", str(flat), str(tmp_path / "q.lmdb"), *args]) == 0  # one line, the warning still said
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 1 and "packio: warning: every box has label -1 (no class): did you mean " \
        "`--csv-columns class=cell_type`?" in out.err, out
    s = packio.convert(flat, tmp_path / "b.lmdb", csv=table, columns={**cols, "class": "cell_type"}, progress=False)
    assert "classes: WBC 9, RBC 6" in s.text() and "warning" not in s.text(), s.text()
    out = _info(tmp_path / "b.lmdb", capsys)
    assert "boxes:    15 on 5 images; classes: WBC 9, RBC 6" in out and "warning" not in out


def test_labels_and_images_without_a_label_counted(gen_folder, tmp_path, capsys):
    src, table = gen_folder
    (src / "loose.jpg").write_bytes(jpeg(40, 40, seed=77))  # outside the class folders: no label
    s = packio.convert(src, tmp_path / "g.wds", csv=table, progress=False)
    truth = TRUTH[str(src)]
    per_label = Counter(lab for lab, _, _ in truth.values())
    boxes = Counter(c for _, _, cls in truth.values() for c in cls)
    with_boxes = sum(1 for _, b, _ in truth.values() if b)
    want_labels = ", ".join(f"{k} {v}" for k, v in sorted(per_label.items(), key=lambda kv: -kv[1]))
    for text in (s.text(), _info(tmp_path / "g.wds", capsys)):
        assert f"labels:   {want_labels}; 1 images without a label" in text, text
        assert f"boxes:    {sum(boxes.values())} on {with_boxes} images; classes: " in text
        for name, n in boxes.items():
            assert f"{name} {n}" in text
        assert "warning" not in text


def test_bccd_box_counts_match_the_csv(tmp_path, capsys):
    root = shared("bccd")
    with open(root / "test.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    per_class = Counter(r["cell_type"] for r in rows)
    images = len({r["filename"] for r in rows})
    s = packio.convert(root / "BCCD" / "JPEGImages", tmp_path / "bccd.h5", csv=root / "test.csv", progress=False)
    assert f"boxes:    {len(rows):,} on {images} images; classes: -1 (no class) {len(rows):,}" in s.text()
    assert "did you mean `--csv-columns class=cell_type`?" in s.text()
    packio.convert(root / "BCCD" / "JPEGImages", tmp_path / "ok.h5", csv=root / "test.csv",
                   columns={"class": "cell_type"}, progress=False)
    out = _info(tmp_path / "ok.h5", capsys)
    assert f"boxes:    {len(rows):,} on {images} images" in out and "warning" not in out
    for name, n in per_class.items():
        assert f"{name} {n:,}" in out


def test_parts_merge():
    a = {"images_without_label": 1, "labels": {"x": 2}, "boxes": 3, "images_with_boxes": 2, "box_classes": {"c": 3}}
    b = {"images_without_label": 0, "labels": {"x": 1, "y": 4}, "boxes": 1, "images_with_boxes": 1,
         "box_classes": {"c": 1}}
    assert merge([a, b]) == {"images_without_label": 1, "labels": {"x": 3, "y": 4}, "boxes": 4,
                             "images_with_boxes": 3, "box_classes": {"c": 4}}


@pytest.mark.parametrize("value", ["1.5", "-2", "3e4", " 7 "])
def test_numbers_are_not_text_columns(tmp_path, value):
    from packio.census import unused_text_columns

    p = tmp_path / "t.csv"
    p.write_text(f"filename,n,kind\na.jpg,{value},cat\n")
    assert unused_text_columns(p, {"filename": "filename"}) == ["kind"]
