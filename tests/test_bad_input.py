"""What real data brings while packing: each case is reported, skipped or packed right."""

from __future__ import annotations

import builtins
import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import packio
from conftest import jpeg, photo, shared
from packio.errors import SourceError


def _bomb() -> bytes:
    """A valid small JPEG whose SOF header claims 65,000 x 65,000 pixels (a JPEG
    header cannot say more than 65,535; the PNG bomb below claims 100,000²)."""
    data = bytearray(jpeg(16, 16, 1))
    i = 2
    while i < len(data):
        marker, seg = data[i + 1], int.from_bytes(data[i + 2:i + 4], "big")
        if marker in (0xC0, 0xC1, 0xC2):
            data[i + 5:i + 9] = (65_000).to_bytes(2, "big") * 2
            return bytes(data)
        i += 2 + seg
    raise AssertionError("no SOF marker")


def _png_bomb() -> bytes:
    """A PNG whose IHDR claims 100,000 x 100,000 pixels (valid CRC)."""
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    idat = b"IDAT" + zlib.compress(b"\0" * 64)
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))
            + struct.pack(">I", len(idat) - 4) + idat + struct.pack(">I", zlib.crc32(idat))
            + struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND")))


def _pil_bytes(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.fixture
def bad_folder(tmp_path: Path) -> Path:
    root = tmp_path / "bad" / "things"
    root.mkdir(parents=True)
    good = jpeg(40, 60, 3)
    (root / "good.jpg").write_bytes(good)
    (root / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "empty.jpg").write_bytes(b"")
    (root / "notes.jpg").write_text("this is text, not a picture\n")
    (root / "bomb.jpg").write_bytes(_bomb())
    (root / "bomb.png").write_bytes(_png_bomb())
    rgb = Image.fromarray(photo(30, 50, 4))
    (root / "png_named.jpg").write_bytes(_pil_bytes(rgb, "PNG"))
    (root / "anim.gif").write_bytes(_pil_bytes(rgb.convert("P"), "GIF"))
    (root / "cmyk.jpg").write_bytes(_pil_bytes(rgb.convert("CMYK"), "JPEG", quality=92))
    (root / "gray.jpg").write_bytes(_pil_bytes(rgb.convert("L"), "JPEG"))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to display
    (root / "rotated.jpg").write_bytes(_pil_bytes(rgb, "JPEG", exif=exif.tobytes()))
    (root / "unreadable.jpg").write_bytes(good)
    os.symlink(root / "loop_b.jpg", root / "loop_a.jpg")
    os.symlink(root / "loop_a.jpg", root / "loop_b.jpg")
    os.mkfifo(root / "fifo.jpg")
    fd = os.open(os.fsencode(root) + b"/bad\xffname.jpg", os.O_CREAT | os.O_WRONLY)
    os.write(fd, good)
    os.close(fd)
    return tmp_path / "bad"


EXPECTED_SKIPS = {
    "truncated JPEG (no end marker)": 1,
    "empty file": 1,
    "not an image": 1,
    "image too large (decompression bomb guard)": 2,
    "unsupported image type (gif)": 1,
    "unreadable file": 1,
    "broken or looping symlink": 2,
    "not a regular file": 1,
}


@pytest.fixture
def deny_unreadable(monkeypatch):
    """Root reads any file whatever its mode, so deny one the way the OS would."""
    real_open = builtins.open

    def fake_open(file, *a, **kw):
        if str(file).endswith("unreadable.jpg"):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", fake_open)


def test_bad_inputs_are_skipped_and_counted(bad_folder, tmp_path, deny_unreadable):
    before = sorted((p.name, p.stat().st_size) for p in (bad_folder / "things").iterdir() if not p.is_symlink()
                    and p.is_file())
    s = packio.convert(bad_folder, tmp_path / "out.lmdb", progress=False)
    assert dict(s.skipped) == EXPECTED_SKIPS
    for reason in EXPECTED_SKIPS:
        assert any(reason in p for p in s.problems)
    assert any("truncated.jpg" in p for p in s.problems) and any("bomb.jpg" in p for p in s.problems)
    ds = packio.open_dataset(tmp_path / "out.lmdb")
    by_key = {ds.sample(i).key: i for i in range(len(ds))}
    assert sorted(by_key) == ["things/bad\\xffname.jpg", "things/cmyk.jpg", "things/good.jpg", "things/gray.jpg",
                              "things/png_named.jpg", "things/rotated.jpg"]  # a name not UTF-8: packed, \xNN
    assert ds.sample(by_key["things/png_named.jpg"]).encoding == "png"  # by content, not by name
    for key, i in by_key.items():
        img = ds[i]["image"]
        assert img.shape[0] == 3 and ds[i]["label"] == -1  # a single folder names no image class
    assert ds.classes == []
    # CMYK and grayscale decode to RGB close to the source picture
    src = photo(30, 50, 4).astype(int)
    cmyk = ds[by_key["things/cmyk.jpg"]]["image"].permute(1, 2, 0).numpy().astype(int)
    assert np.abs(cmyk - src).mean() < 12
    # the input folder is untouched
    after = sorted((p.name, p.stat().st_size) for p in (bad_folder / "things").iterdir() if not p.is_symlink()
                   and p.is_file())
    assert before == after


def test_exif_orientation_applied_when_resizing(bad_folder, tmp_path, deny_unreadable):
    s = packio.convert(bad_folder / "things", tmp_path / "r.arrays", resize=packio.ResizeSpec(short_side=20,
                       crop=(20, 20)), progress=False)
    ds = packio.open_dataset(tmp_path / "r.arrays", decode=False)
    assert all(ds.sample(i).payload.shape == (20, 20, 3) for i in range(len(ds)))
    s2 = packio.convert(bad_folder / "things", tmp_path / "r.bmpdir", resize=packio.ResizeSpec(short_side=20),
                        progress=False)
    bmp = packio.open_dataset(tmp_path / "r.bmpdir")
    rotated = next(bmp[i] for i in range(len(bmp)) if bmp[i]["key"].endswith("rotated.jpg"))
    plain = next(bmp[i] for i in range(len(bmp)) if bmp[i]["key"].endswith("png_named.jpg"))
    assert tuple(plain["image"].shape[1:]) == (20, 33)  # 30x50 source, landscape
    assert tuple(rotated["image"].shape[1:]) == (33, 20)  # same source, EXIF says rotate: portrait
    assert s.packed == s2.packed == len(ds) == 6  # bad\xffname.jpg too


def test_strict_turns_skips_into_errors(bad_folder, tmp_path):
    with pytest.raises(SourceError, match="strict"):
        packio.convert(bad_folder, tmp_path / "out.lmdb", strict=True, progress=False)
    assert not (tmp_path / "out.lmdb").exists()


def _csv(tmp_path: Path, text: str, bom: bool = False) -> Path:
    p = tmp_path / "ann.csv"
    p.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return p


def test_csv_problems(tmp_path):
    root = tmp_path / "imgs"
    root.mkdir()
    for n in ("a.jpg", "b.jpg", "c.jpg"):
        (root / n).write_bytes(jpeg(50, 50, hash(n) % 100))
    text = ("filename,class,xmin,ymin,xmax,ymax,extra\r\n"
            "a.jpg,cat,1,2,10,20,x\r\n"
            "a.jpg,cat,1,2,10,20,x\r\n"  # duplicate
            "a.jpg,dog,5,5,5,5,x\r\n"  # zero area: kept
            "b.jpg,cat,one,2,10,20,x\r\n"  # non-numeric
            "b.jpg,cat,-1,2,10,20,x\r\n"  # negative
            "b.jpg,cat,30,2,10,20,x\r\n"  # inverted
            "b.jpg,cat,1,2\r\n"  # too few fields
            "missing.jpg,cat,1,2,3,4,x\r\n")
    s = packio.convert(root, tmp_path / "o.lmdb", csv=_csv(tmp_path, text, bom=True), progress=False)
    assert dict(s.skipped) == {"duplicate CSV row": 1, "non-numeric box": 1, "negative or non-finite box": 1,
                               "inverted box (max < min)": 1, "CSV row with a wrong number of fields": 1,
                               "CSV row for a missing file": 1}
    assert any("ann.csv:9" in p and "missing.jpg" in p for p in s.problems)  # names the row
    ds = packio.open_dataset(tmp_path / "o.lmdb", decode=False)
    a = next(ds.sample(i) for i in range(3) if ds.sample(i).key == "a.jpg")
    np.testing.assert_array_equal(a.boxes, [[1, 2, 10, 20], [5, 5, 5, 5]])
    assert [ds.box_classes[c] for c in a.box_labels] == ["cat", "dog"]
    c = next(ds.sample(i) for i in range(3) if ds.sample(i).key == "c.jpg")
    assert len(c.boxes) == 0  # an image without rows is kept
    with pytest.raises(SourceError, match="missing.jpg"):
        packio.convert(root, tmp_path / "o2.lmdb", csv=_csv(tmp_path, text), strict=True, progress=False)


def test_csv_missing_columns_is_a_clear_error(tmp_path):
    root = tmp_path / "imgs"
    root.mkdir()
    (root / "a.jpg").write_bytes(jpeg(20, 20, 1))
    with pytest.raises(SourceError, match=r"box columns \['ymax'\] are missing.*--csv-columns"):
        packio.convert(root, tmp_path / "o.lmdb", csv=_csv(tmp_path, "filename,xmin,ymin,xmax\na.jpg,1,2,3\n"))
    with pytest.raises(SourceError, match="no column 'filename'"):
        packio.convert(root, tmp_path / "o.lmdb", csv=_csv(tmp_path, "name,xmin\na.jpg,1\n"))
    with pytest.raises(SourceError, match="FIELD=COLUMN"):
        packio.sources.parse_columns("filename")


def test_real_bccd_zero_area_boxes_kept(tmp_path):
    root = shared("bccd")
    s = packio.convert(root / "BCCD" / "JPEGImages", tmp_path / "b.lmdb", csv=root / "test.csv",
                       columns={"class": "cell_type"}, progress=False)
    ds = packio.open_dataset(tmp_path / "b.lmdb", decode=False)
    zero = [ds.sample(i).key for i in range(len(ds))
            if any((b[2] - b[0]) * (b[3] - b[1]) == 0 for b in ds.sample(i).boxes)]
    assert sorted(zero) == ["BloodImage_00338.jpg", "BloodImage_00343.jpg"] and s.packed == 364


def test_existing_output_needs_overwrite(tmp_path, gen_folder):
    src, _ = gen_folder
    packio.convert(src, tmp_path / "o.lmdb", progress=False)
    with pytest.raises(packio.OutputExistsError, match="--overwrite"):
        packio.convert(src, tmp_path / "o.lmdb", progress=False)
    s = packio.convert(src, tmp_path / "o.lmdb", overwrite=True, progress=False)
    assert s.packed == 14 and packio.verify(tmp_path / "o.lmdb").ok
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_disk_full_is_clear_and_leaves_nothing(tmp_path, gen_folder, monkeypatch):
    import errno

    from packio.formats import lmdb as lmdb_fmt

    def full(self, sample):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lmdb_fmt.LMDBWriter, "add", full)
    src, _ = gen_folder
    with pytest.raises(packio.PackioError, match="No space left.*partial output was removed.*free some disk"):
        packio.convert(src, tmp_path / "o.lmdb", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["boxes.csv", "images"]
