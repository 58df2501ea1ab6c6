"""`packio show`: boxes are drawn where the stored pixels say the object is, captions are
rendered, on every format and through a URL. Checked by pixels of the written PNG."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

import packio
from packio.preview import CAPTION, PALETTE

SIDE, LO, HI = 128, 32, 96  # a red square [LO, HI) on grey; its box says exactly that
CELL = 256  # tiles enlarge the 128 px image 2x


def _square_folder(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    img = np.full((SIDE, SIDE, 3), 128, np.uint8)
    img[LO:HI, LO:HI] = (0, 0, 255)  # BGR red
    cv2.imwrite(str(src / "sq.png"), img)
    other = np.full((SIDE, SIDE, 3), 90, np.uint8)
    cv2.imwrite(str(src / "plain.png"), other)
    csv = tmp_path / "boxes.csv"
    csv.write_text(f"filename,class,xmin,ymin,xmax,ymax\ncls/sq.png,square,{LO},{LO},{HI},{HI}\n")
    return tmp_path / "src", csv


def _read_png(path: Path) -> np.ndarray:
    img = cv2.imread(str(path), cv2.IMREAD_COLOR)
    assert img is not None, path
    return img[:, :, ::-1]  # RGB


def _check_square_tile(tile: np.ndarray, scale: float, cls: int = 0) -> None:
    green = np.array(PALETTE[cls][::-1])  # the box class's colour, RGB (box_classes: ["square"])
    lo, hi = round(LO * scale), round(HI * scale) - 1
    mid = range(lo + 8, hi - 8)
    for edge in ((lo, mid, "top"), (hi, mid, "bottom")):
        row = tile[edge[0], list(mid)]
        assert (np.abs(row.astype(int) - green).max(axis=1) < 40).mean() > 0.9, f"{edge[2]} edge not drawn"
    for col in (lo, hi):
        column = tile[list(mid), col]
        assert (np.abs(column.astype(int) - green).max(axis=1) < 40).mean() > 0.9, "side edge not drawn"
    centre = tile[round(64 * scale), round(64 * scale)].astype(int)
    assert centre[0] > 200 and centre[1] < 50 and centre[2] < 50, "the square is not where its box is"
    outside = tile[round(10 * scale), round(110 * scale)].astype(int)
    assert np.abs(outside - 128).max() < 10  # grey stays grey: nothing drawn off the box
    caption = tile[CELL:CELL + CAPTION]
    assert (caption.min(axis=2) < 128).sum() > 100, "no caption text rendered"


@pytest.mark.parametrize("suffix,resize", [(".lmdb", None), (".h5", None), (".wds", None), (".bmpdir", None),
                                           (".arrays", packio.ResizeSpec(size=(SIDE, SIDE)))])
def test_box_drawn_on_the_red_square_every_format(tmp_path, suffix, resize):
    src, csv = _square_folder(tmp_path)
    dst = tmp_path / f"d{suffix}"
    packio.convert(src, dst, csv=csv, resize=resize, progress=False)
    ds = packio.open_dataset(dst)
    i = next(k for k in range(len(ds)) if ds.sample(k).key.endswith("sq.png"))
    out = packio.show(dst, [i], tmp_path / "g.png", cell=CELL)
    grid = _read_png(out)
    assert grid.shape == (CELL + CAPTION, CELL, 3)
    _check_square_tile(grid, CELL / SIDE)


def test_cli_stored_and_read_side_by_side(tmp_path):
    src, csv = _square_folder(tmp_path)
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    ds = packio.open_dataset(tmp_path / "d.lmdb")
    i = next(k for k in range(len(ds)) if ds.sample(k).key.endswith("sq.png"))
    r = subprocess.run([sys.executable, "-m", "packio", "show", str(tmp_path / "d.lmdb"), str(i), "-o",
                        str(tmp_path / "g.png"), "--resize", "64", "--cell", str(CELL)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    grid = _read_png(tmp_path / "g.png")
    assert grid.shape == (CELL + CAPTION, 2 * CELL, 3)  # stored | read, one row
    _check_square_tile(grid[:, :CELL], CELL / SIDE)
    _check_square_tile(grid[:, CELL:], CELL / SIDE)  # read at 64x64, drawn at the same tile size


def test_bad_index_and_output_name_are_packio_errors(tmp_path):
    src, csv = _square_folder(tmp_path)
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    with pytest.raises(packio.PackioError, match="out of range: the dataset holds 2 samples"):
        packio.show(tmp_path / "d.lmdb", [5], tmp_path / "g.png")
    with pytest.raises(packio.PackioError, match="g.png"):
        packio.show(tmp_path / "d.lmdb", [0], tmp_path / "g.txt")
    r = subprocess.run([sys.executable, "-m", "packio", "show", str(tmp_path / "d.lmdb"), "7"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and "out of range" in r.stderr and not (tmp_path / "grid.png").exists()


def test_show_through_a_url(tmp_path, http_server):
    src, csv = _square_folder(tmp_path)
    packio.convert(src, http_server.root / "d.wds", csv=csv, progress=False)
    local = packio.open_dataset(http_server.root / "d.wds")
    i = next(k for k in range(len(local)) if local.sample(k).key.endswith("sq.png"))
    out = packio.show(f"{http_server.url}/d.wds", [i], tmp_path / "g.png", cell=CELL, cache_dir=tmp_path / "c")
    _check_square_tile(_read_png(out), CELL / SIDE)
