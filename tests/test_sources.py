"""The source listing: which CSV row belongs to which file, and which class list a label indexes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import packio
from conftest import jpeg
from packio.cli import main
from packio.manifest import Manifest


def _images(root: Path, names: list[str]) -> Path:
    for n, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(jpeg(24, 32, n))
    return root


def _by_key(path: Path) -> dict[str, packio.Sample]:
    ds = packio.open_dataset(path, decode=False)
    return {ds.sample(i).key: ds.sample(i) for i in range(len(ds))}


def test_csv_rows_from_other_folders_do_not_merge(tmp_path):
    # the source is data/train; the CSV names paths relative to data/
    train = _images(tmp_path / "data" / "train", ["x.jpg", "y.jpg"])
    p = tmp_path / "ann.csv"
    p.write_text("filename,class,xmin,ymin,xmax,ymax\n"
                 "train/x.jpg,cat,1,1,5,5\nval/x.jpg,dog,2,2,9,9\ntrain/y.jpg,cat,3,3,4,4\n")
    s = packio.convert(train, tmp_path / "a.lmdb", csv=p, progress=False)
    assert dict(s.skipped) == {"CSV row for a missing file": 1}
    assert any("ann.csv:3" in q and "val/x.jpg" in q for q in s.problems)
    got = _by_key(tmp_path / "a.lmdb")
    np.testing.assert_array_equal(got["x.jpg"].boxes, [[1, 1, 5, 5]])  # not val/x.jpg's box too
    np.testing.assert_array_equal(got["y.jpg"].boxes, [[3, 3, 4, 4]])
    with pytest.raises(packio.SourceError, match="val/x.jpg"):
        packio.convert(train, tmp_path / "b.lmdb", csv=p, progress=False, strict=True)


def test_bare_file_name_matches_only_when_unique_across_the_csv(tmp_path):
    src = _images(tmp_path / "src", ["sub/x.jpg", "sub/y.jpg", "z.jpg"])
    p = tmp_path / "ann.csv"
    p.write_text("filename,class,xmin,ymin,xmax,ymax\n"
                 "x.jpg,cat,1,1,5,5\nother/x.jpg,dog,2,2,9,9\ny.jpg,cat,3,3,4,4\nsub/../z.jpg,cat,1,1,2,2\n")
    s = packio.convert(src, tmp_path / "a.lmdb", csv=p, progress=False)
    assert dict(s.skipped) == {"CSV row for a missing file": 2,
                               "CSV file name given with several paths in the CSV (give the path relative to "
                               "the folder)": 1}
    got = _by_key(tmp_path / "a.lmdb")
    assert len(got["sub/x.jpg"].boxes) == 0  # neither x.jpg row is trusted to mean sub/x.jpg
    np.testing.assert_array_equal(got["sub/y.jpg"].boxes, [[3, 3, 4, 4]])  # a unique bare name still finds it
    assert len(got["z.jpg"].boxes) == 0


def _bccd_like(root: Path) -> tuple[Path, Path]:
    """A wrapper folder: JPEGImages/ with the photos, Annotations/ and ImageSets/Main/ without."""
    _images(root / "JPEGImages", ["a.jpg", "b.jpg"])
    (root / "Annotations").mkdir()
    (root / "Annotations" / "a.xml").write_text("<annotation/>")
    (root / "ImageSets" / "Main").mkdir(parents=True)
    (root / "ImageSets" / "Main" / "train.txt").write_text("a\n")
    p = root.parent / "boxes.csv"
    p.write_text("filename,cell_type,xmin,ymin,xmax,ymax\n"
                 "a.jpg,WBC,1,1,5,5\na.jpg,RBC,2,2,6,6\nb.jpg,Platelets,3,3,7,7\n")
    return root, p


@pytest.mark.parametrize("sub", ["", "JPEGImages"])
def test_box_classes_have_their_own_list(tmp_path, sub):
    root, p = _bccd_like(tmp_path / "BCCD")
    out = tmp_path / "b.lmdb"
    s = packio.convert(root / sub if sub else root, out, csv=p, columns={"class": "cell_type"}, progress=False)
    assert s.packed == 2
    ds = packio.open_dataset(out, decode=False)
    assert ds.classes == []  # no folder names a class: not JPEGImages, not Annotations or Main
    assert ds.box_classes == ["Platelets", "RBC", "WBC"]
    got = _by_key(out)
    key = "JPEGImages/a.jpg" if not sub else "a.jpg"
    assert got[key].label == -1
    assert [ds.box_classes[c] for c in got[key].box_labels] == ["WBC", "RBC"]
    # a conversion of the packed dataset keeps both lists
    s2 = packio.convert(out, tmp_path / "b.wds", progress=False)
    ds2 = packio.open_dataset(s2.output, decode=False)
    assert ds2.classes == [] and ds2.box_classes == ["Platelets", "RBC", "WBC"]


def test_class_folders_and_box_classes_are_separate(tmp_path):
    src = _images(tmp_path / "src", ["cats/a.jpg", "dogs/b.jpg"])
    p = tmp_path / "ann.csv"
    p.write_text("filename,class,xmin,ymin,xmax,ymax\ncats/a.jpg,head,1,1,5,5\ndogs/b.jpg,tail,1,1,5,5\n")
    s = packio.convert(src, tmp_path / "c.lmdb", csv=p, progress=False)
    ds = packio.open_dataset(s.output, decode=False)
    assert ds.classes == ["cats", "dogs"] and ds.box_classes == ["head", "tail"]
    got = _by_key(tmp_path / "c.lmdb")
    assert ds.classes[got["dogs/b.jpg"].label] == "dogs"
    assert [ds.box_classes[c] for c in got["dogs/b.jpg"].box_labels] == ["tail"]
    assert "boxes:    2 classes: head, tail" in _info(tmp_path / "c.lmdb")


def _info(path: Path) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["info", str(path)]) == 0
    return buf.getvalue()


def test_manifest_without_box_classes_reads_as_shared_list():
    m = Manifest(format="lmdb", count=0, classes=["a", "b"])
    assert m.box_class_names() == ["a", "b"]
    assert "box_classes" not in m.to_json()  # datasets packed before the field keep their digest
    back = Manifest.from_json(Manifest(format="lmdb", count=0, classes=["a"], box_classes=["x"]).to_json(), "m")
    assert back.box_class_names() == ["x"] and back.classes == ["a"]


def test_csv_with_a_packed_source_is_an_error(tmp_path):
    src = _images(tmp_path / "src", ["a.jpg", "b.jpg"])
    packed = packio.convert(src, tmp_path / "p.lmdb", progress=False).output
    p = tmp_path / "ann.csv"
    p.write_text("filename,class,xmin,ymin,xmax,ymax\na.jpg,cat,1,1,5,5\n")
    with pytest.raises(packio.SourceError, match="packed dataset.*CSV"):
        packio.convert(packed, tmp_path / "q.lmdb", csv=p, progress=False)
    assert main(["convert", packed, str(tmp_path / "r.lmdb"), "--csv", str(p), "--strict", "--quiet"]) == 2
    assert not (tmp_path / "q.lmdb").exists() and not (tmp_path / "r.lmdb").exists()


@pytest.mark.parametrize("ends", ["\r", "\r\n", "mixed"])
def test_csv_line_ends_other_than_newline_read_like_newline(tmp_path, ends):
    """The columns are sized from a count of line ends: a CSV ending its lines with a lone
    ``\\r`` (old Mac files; the csv module reads them) or mixing them must give the rows its
    ``\\n`` twin gives, not 'the CSV grew while it was read'."""
    from packio.sources.csvrows import read_csv

    lines = ["filename,label"] + [f"x/i{k}.jpg,{'cat' if k % 3 else 'dog'}" for k in range(9)]
    (tmp_path / "lf.csv").write_bytes(("\n".join(lines) + "\n").encode())
    text = "".join(line + (ends if ends != "mixed" else ("\r", "\n", "\r\n")[k % 3])
                   for k, line in enumerate(lines))
    (tmp_path / "other.csv").write_bytes(text.encode())
    skipped = []
    want, _ = read_csv(tmp_path / "lf.csv", {}, lambda *a: skipped.append(a))
    got, _ = read_csv(tmp_path / "other.csv", {}, lambda *a: skipped.append(a))
    assert not skipped
    assert list(got.names) == list(want.names) and len(got) == 9
    assert got.image_label.tolist() == want.image_label.tolist() and got.image_names == want.image_names


def test_a_csv_that_is_no_regular_file_is_refused_at_once(tmp_path):
    """The CSV's row bound is read off the file first: /dev/zero never ends and a FIFO blocks
    (or cannot be read at an offset); both are a SourceError before any read."""
    import os

    from packio.sources.csvrows import read_csv

    import threading

    os.mkfifo(tmp_path / "rows.csv")
    for path in (Path("/dev/zero"), tmp_path / "rows.csv"):
        got: list[BaseException] = []

        def read(path=path):
            try:
                read_csv(path, {}, lambda *a: None)
            except BaseException as exc:
                got.append(exc)

        t = threading.Thread(target=read, daemon=True)  # daemon: a hang fails the test, not the suite
        t.start()
        t.join(10)
        assert got and isinstance(got[0], packio.SourceError) and "not a regular file" in str(got[0]), (path, got)
