"""packio.geometry against ground truth: masks drawn where a box says, PIL's own EXIF transpose."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from packio import geometry as geo


def _mask_box(mask: np.ndarray) -> list[float]:
    """Tight continuous xyxy box of the True pixels."""
    ys, xs = np.nonzero(mask)
    return [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]


def _with_orientation(img: np.ndarray, orientation: int) -> Image.Image:
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(img).save(buf, "PNG", exif=exif)
    return Image.open(io.BytesIO(buf.getvalue()))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_matches_pil_exif_transpose(orientation: int) -> None:
    h, w = 7, 11
    box = [2, 1, 6, 3]  # x0, y0, x1, y1 in the stored image
    img = np.zeros((h, w, 3), np.uint8)
    img[box[1]:box[3], box[0]:box[2]] = 255
    img[0, 0] = (0, 0, 255)  # a marker corner, so flips that keep the box's place still show
    upright = np.asarray(ImageOps.exif_transpose(_with_orientation(img, orientation)))
    assert np.array_equal(geo.orient_image(img, orientation), upright)
    assert geo.upright_size(orientation, w, h) == (upright.shape[1], upright.shape[0])
    got = geo.orient(np.array([box], np.float32), orientation, w, h)
    assert got.tolist() == [_mask_box(upright[..., 0] == 255)]
    back = geo.orient(got, geo.inverse_orientation(orientation), upright.shape[1], upright.shape[0])
    assert back.tolist() == [box]


def test_crop_rule_keeps_exactly_boxes_overlapping_the_interior() -> None:
    boxes = np.array([
        [2, 2, 4, 4],      # inside
        [0, 0, 10, 10],    # covers the window: clipped to it
        [5, 5, 5, 5],      # zero area, strictly inside: kept
        [0, 0, 1, 1],      # outside
        [1, 2, 2, 4],      # touches the left edge only: dropped
        [2, 6, 3, 9],      # touches the bottom edge only: dropped
        [1, 1, 1, 8],      # zero width on the left edge: dropped
        [5.5, 1, 7.5, 3],  # sticks out right: clipped
    ], np.float32)
    labels = np.arange(len(boxes), dtype=np.int64)
    b, lab = geo.crop(boxes, labels, top=1, left=2, height=5, width=4)  # window x [2,6], y [1,6]
    assert lab.tolist() == [0, 1, 2, 7]
    assert b.tolist() == [[0, 1, 2, 3], [0, 0, 4, 5], [3, 4, 3, 4], [3.5, 0, 4, 2]]
    assert b.dtype == np.float32 and lab.dtype == np.int64


def test_resize_puts_image_edges_exactly_on_the_new_edges() -> None:
    """A box spanning the whole image stays exactly inside the resized one, on the CPU and in
    the torch twin: a float32 factor (90 * f32(48/90) = 48.000004) put edges a ulp outside,
    which albumentations / torchvision box checks reject."""
    import torch

    from packio.cuda import boxes as bx

    rng = np.random.default_rng(0)
    for _ in range(300):
        h0, w0, h1, w1 = (int(v) for v in rng.integers(1, 400, 4))
        whole = np.array([[0, 0, w0, h0], [w0 / 2, 0, w0, h0]], np.float32)
        got = geo.resize(whole, (h0, w0), (h1, w1))
        assert got[0].tolist() == [0, 0, w1, h1], (h0, w0, h1, w1)
        p = bx.PackedBoxes.from_lists([torch.from_numpy(whole)], [torch.zeros(2, dtype=torch.int64)])
        twin = bx.resize(p, torch.tensor([[h0, w0]]), (h1, w1)).boxes.numpy()
        np.testing.assert_array_equal(twin, got)


def test_inputs_never_modified_and_shapes_checked() -> None:
    boxes = np.array([[1, 2, 3, 4]], np.float32)
    keep = boxes.copy()
    geo.scale(boxes, 2, 3)
    geo.hflip(boxes, 10)
    geo.vflip(boxes, 10)
    geo.orient(boxes, 6, 10, 20)
    geo.clip(boxes, 2, 2)
    geo.crop(boxes, [0], 0, 0, 2, 2)
    assert np.array_equal(boxes, keep)
    assert geo.scale(boxes, 2, 3).tolist() == [[2, 6, 6, 12]]
    assert geo.resize(boxes, (10, 20), (5, 40)).tolist() == [[2, 1, 6, 2]]
    assert geo.hflip(boxes, 10).tolist() == [[7, 2, 9, 4]]
    assert geo.vflip(boxes, 10).tolist() == [[1, 6, 3, 8]]
    assert geo.clip([[-1, 2, 30, 4]], 10, 3).tolist() == [[0, 2, 10, 3]]
    assert geo.as_boxes([]).shape == (0, 4)
    assert geo.crop(np.zeros((0, 4)), [], 0, 0, 3, 3)[0].shape == (0, 4)
    with pytest.raises(ValueError, match="1 boxes but 2 box labels"):
        geo.crop(boxes, [0, 1], 0, 0, 2, 2)
    with pytest.raises(ValueError, match="orientation"):
        geo.orient(boxes, 9, 10, 10)
    assert geo.center_window(10, 20, 4, 30) == (3, 0, 4, 20)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 12), st.integers(1, 12),
       st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12), st.integers(0, 12), st.integers(0, 12)),
                max_size=4),
       st.integers(0, 11), st.integers(0, 11), st.integers(1, 12), st.integers(1, 12))
def test_pixels_and_boxes_move_together(orientation: int, w: int, h: int, raw: list, top: int, left: int,
                                        ch: int, cw: int) -> None:
    """Any orientation then any crop: each kept box is the bounding box of its own mask's pixels,
    and a box is dropped exactly when its mask has no pixel left (positive-area boxes)."""
    boxes = np.array([[min(a, c) % (w + 1), min(b, d) % (h + 1), max(a, c) % (w + 1), max(b, d) % (h + 1)]
                      for a, b, c, d in raw], np.float32).reshape(-1, 4)
    boxes[:, 2:] = np.maximum(boxes[:, 2:], boxes[:, :2])
    area = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    boxes, labels = boxes[area], np.flatnonzero(area)
    masks = np.zeros((len(boxes), h, w), bool)
    for k, (x0, y0, x1, y1) in enumerate(boxes.astype(int)):
        masks[k, y0:y1, x0:x1] = True
    up = np.stack([geo.orient_image(m, orientation) for m in masks]) if len(masks) else masks
    ob = geo.orient(boxes, orientation, w, h)
    uw, uh = geo.upright_size(orientation, w, h)
    top, left = min(top, uh - 1), min(left, uw - 1)
    ch, cw = min(ch, uh - top), min(cw, uw - left)
    b, lab = geo.crop(ob, labels, top, left, ch, cw)
    window = up[:, top:top + ch, left:left + cw]
    visible = [k for k in range(len(boxes)) if window[k].any()]
    assert lab.tolist() == [int(labels[k]) for k in visible]
    for got, k in zip(b.tolist(), visible):
        assert got == _mask_box(window[k])


# --------------------------------------------------------------------------------------------
# Ground truth end to end: rectangles drawn exactly where their boxes say, in every EXIF
# orientation, packed into every format with every pack-time geometry, read back every way.
# --------------------------------------------------------------------------------------------

import csv  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

import packio  # noqa: E402
from packio import decode as dec  # noqa: E402
from packio.pack.prepare import REORIENTED  # noqa: E402
from packio.formats import formats  # noqa: E402

COLOURS = {"red": (230, 25, 25), "green": (25, 200, 25), "blue": (25, 25, 230)}
BACKGROUND = (128, 128, 128)
UPRIGHT_W, UPRIGHT_H = 96, 64
# Upright-frame boxes. At --short-side 48 --crop 40x40 the window is x 21.3..74.7, y 5.3..58.7 of
# this frame: red and green are cut, blue is cropped away.
TRUTH_BOXES = {"red": [8, 8, 40, 36], "green": [50, 20, 88, 56], "blue": [0, 44, 14, 64]}


def _draw(w: int, h: int, boxes: dict[str, list[float]]) -> np.ndarray:
    img = np.empty((h, w, 3), np.uint8)
    img[:] = BACKGROUND
    for name, (x0, y0, x1, y1) in boxes.items():
        img[int(y0):int(y1), int(x0):int(x1)] = COLOURS[name]
    return img


def _encode(img: np.ndarray, orientation: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    kw = {"quality": 95, "subsampling": 0} if fmt == "JPEG" else {}
    Image.fromarray(img).save(buf, fmt, exif=exif, **kw)
    return buf.getvalue()


def _colour_mask(img: np.ndarray, name: str, tol: float = 60) -> np.ndarray:
    return np.abs(img.astype(np.float32) - COLOURS[name]).max(-1) < tol


def check_truth(img: np.ndarray, boxes: np.ndarray, labels: list[str], where: str) -> None:
    """The ground truth in one image: every visible rectangle has exactly one box, every box has
    area; inside each box (shrunk, for JPEG edges) is its rectangle's colour, and the box covers
    all of that colour. Boxes thinner than 4 px (a rectangle cut to a sliver) skip the pixel checks."""
    img = np.asarray(img)
    if img.shape[0] == 3:
        img = img.transpose(1, 2, 0)
    img = np.clip(np.round(img.astype(np.float32)), 0, 255)
    h, w = img.shape[:2]
    assert len(set(labels)) == len(labels), f"{where}: several boxes for one rectangle: {labels}"
    visible = {c for c in COLOURS if _colour_mask(img, c).sum() >= 6}
    assert visible <= set(labels), f"{where}: rectangles {sorted(visible - set(labels))} are visible but have no box"
    for (x0, y0, x1, y1), name in zip(np.asarray(boxes, np.float64).tolist(), labels):
        assert 0 <= x0 < x1 <= w + 1e-3 and 0 <= y0 < y1 <= h + 1e-3, f"{where}: {name} box {x0, y0, x1, y1}"
        if min(x1 - x0, y1 - y0) < 4:
            continue
        mx, my = max(1.0, 0.2 * (x1 - x0)), max(1.0, 0.2 * (y1 - y0))
        inner = img[int(np.ceil(y0 + my)):int(y1 - my), int(np.ceil(x0 + mx)):int(x1 - mx)]
        share = _colour_mask(inner, name).mean()
        assert share > 0.95, f"{where}: only {share:.0%} of the {name} box {x0, y0, x1, y1}'s interior is {name}"
        mask = _colour_mask(img, name)
        covered = mask[max(0, int(y0 - 1.5)):int(np.ceil(y1 + 1.5)), max(0, int(x0 - 1.5)):int(np.ceil(x1 + 1.5))]
        assert covered.sum() >= 0.97 * mask.sum(), f"{where}: the {name} box misses part of its rectangle"


def _names(classes: list[str], box_labels) -> list[str]:
    return [classes[int(c)] for c in box_labels]


@pytest.fixture(scope="module")
def oriented_folder(tmp_path_factory) -> tuple[Path, Path]:
    """One photo per EXIF orientation (1..8, JPEG) plus a PNG with orientation 6; the CSV gives
    red in the upright frame (no width/height), green in the stored frame for 5..8 (width/height
    = the stored size), blue in a 2x upright copy (width/height = 192x128)."""
    root = tmp_path_factory.mktemp("oriented")
    src = root / "images"
    src.mkdir()
    upright = _draw(UPRIGHT_W, UPRIGHT_H, TRUTH_BOXES)
    rows = []
    for name, o, fmt in [*((f"o{o}.jpg", o, "JPEG") for o in range(1, 9)), ("o6.png", 6, "PNG")]:
        stored = np.ascontiguousarray(geo.orient_image(upright, geo.inverse_orientation(o)))
        data = _encode(stored, o, fmt)
        # independent check of the fixture itself: PIL turns the file upright into our drawing
        assert np.array_equal(np.asarray(ImageOps.exif_transpose(_with_orientation(stored, o)).convert("RGB")),
                              upright)
        (src / name).write_bytes(data)
        sh, sw = stored.shape[:2]
        rows.append([name, "", "", "red", *TRUTH_BOXES["red"]])
        if o >= 5:  # stored frame, told by the CSV's width/height (64x96 is not the upright 96x64)
            g = geo.orient(np.array([TRUTH_BOXES["green"]]), geo.inverse_orientation(o), UPRIGHT_W, UPRIGHT_H)[0]
            rows.append([name, sw, sh, "green", *g.tolist()])
        else:
            rows.append([name, UPRIGHT_W, UPRIGHT_H, "green", *TRUTH_BOXES["green"]])
        rows.append([name, 2 * UPRIGHT_W, 2 * UPRIGHT_H, "blue", *(2 * v for v in TRUTH_BOXES["blue"])])
    csv_path = root / "boxes.csv"
    with open(csv_path, "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["filename", "width", "height", "class", "xmin", "ymin", "xmax", "ymax"])
        wr.writerows(rows)
    return src, csv_path


SPECS = {"none": dec.ResizeSpec(), "size": dec.ResizeSpec(size=(40, 48)),
         "short": dec.ResizeSpec(short_side=40), "crop": dec.ResizeSpec(short_side=48, crop=(40, 40))}
CASES = [(f, s) for f in sorted(formats()) for s in SPECS
         if not (formats()[f].needs_fixed_shape and SPECS[s].fixed_shape is None)]


@pytest.mark.parametrize("fmt,spec", CASES)
def test_ground_truth_every_orientation_format_and_geometry(oriented_folder, tmp_path, fmt, spec):
    src, csv_path = oriented_folder
    out = tmp_path / f"ds{formats()[fmt].suffixes[0]}"
    s = packio.convert(src, out, csv=csv_path, resize=SPECS[spec], progress=False)
    assert s.packed == 9 and not s.skipped, s.problems
    notes = s.info["notes"]
    assert notes[REORIENTED] == 8
    assert notes["CSV boxes in the stored (not EXIF-upright) frame, told by the CSV's width/height"] == 5
    assert notes["CSV boxes given for a resized copy (width/height), scaled to the image"] == 9
    where = f"{fmt}/{spec}"

    ds = packio.open_dataset(out)
    classes = ds.box_classes
    for i in range(len(ds)):
        item = ds[i]
        check_truth(item["image"].numpy(), item["boxes"].numpy(), _names(classes, item["box_labels"]),
                    f"{where} {item['key']}")
        smp = ds.sample(i)
        if smp.encoding != "raw":
            assert dec.exif_orientation(smp.payload) == 1  # stored upright, whoever reads it
        if smp.key == "o1.jpg" and not SPECS[spec].active and formats()[fmt].payload == "encoded":
            assert smp.payload == (src / "o1.jpg").read_bytes()  # upright already: stored as found
        elif smp.key != "o1.jpg":
            assert smp.meta["exif_orientation"] == int(smp.key[1])

    for size in ((30, 50), (56, 36)):  # read-time resize (anisotropic; DCT-scaled decode where it can)
        ds = packio.open_dataset(out, resize=size)
        for i in range(len(ds)):
            item = ds[i]
            assert tuple(item["image"].shape[1:]) == size
            check_truth(item["image"].numpy(), item["boxes"].numpy(), _names(classes, item["box_labels"]),
                        f"{where} resize={size} {item['key']}")

    for resize in (None, (30, 50)):  # the batch fast paths
        ds = packio.open_dataset(out, resize=resize)
        if resize is None and not ds.reader.manifest.image.get("shape"):
            continue  # varying shapes do not stack
        for batch in packio.DataLoader(ds, batch_size=4):
            for k in range(len(batch["key"])):
                check_truth(batch["image"][k].numpy(), batch["boxes"][k].numpy(),
                            _names(classes, batch["box_labels"][k]),
                            f"{where} batch resize={resize} {batch['key'][k]}")


# --------------------------------------------------------------------------------------------
# Image labels from a CSV
# --------------------------------------------------------------------------------------------

FLAT = {"a.jpg": "wasp", "b.jpg": "bee", "c.png": "ant", "d.jpg": "bee", "e.jpg": "ant"}  # f.jpg: no row


def _flat_folder(root: Path) -> Path:
    from conftest import jpeg, photo

    root.mkdir()
    for n, name in enumerate([*FLAT, "f.jpg"]):
        if name.endswith(".png"):
            Image.fromarray(photo(20, 24, n)).save(root / name)
        else:
            (root / name).write_bytes(jpeg(20, 24, n))
    return root


@pytest.mark.parametrize("fmt", sorted(formats()))
def test_flat_folder_with_class_csv_labels_images_in_every_format(tmp_path, fmt):
    src = _flat_folder(tmp_path / "flat")
    csv_path = tmp_path / "labels.csv"
    csv_path.write_text("filename,class\n" + "".join(f"{k},{v}\n" for k, v in FLAT.items()))
    spec = formats()[fmt]
    s = packio.convert(src, tmp_path / f"o{spec.suffixes[0]}", csv=csv_path, progress=False,
                       resize=dec.ResizeSpec(size=(16, 16)) if spec.needs_fixed_shape else None)
    assert s.packed == 6 and not s.skipped
    assert s.info["notes"] == {"image without a label (no CSV label / class folder; packed with label -1)": 1}
    assert "1 x image without a label" in s.text()
    ds = packio.open_dataset(s.output, decode=False)
    assert ds.classes == ["ant", "bee", "wasp"]
    got = {ds.sample(i).key: ds.sample(i).label for i in range(len(ds))}
    assert got == {**{k: ds.classes.index(v) for k, v in FLAT.items()}, "f.jpg": -1}
    assert ds.reader.manifest.summary["notes"] == s.info["notes"]


def test_kaggle_style_csvs(tmp_path):
    src = _flat_folder(tmp_path / "flat")
    # image_id without extension, numeric labels (sorted as numbers), a row for a missing file
    p = tmp_path / "train.csv"
    p.write_text("image_id,label\na,10\nb,2\nc,10\nd,2\ne,9\nf,2\nzzz,3\n")
    s = packio.convert(src, tmp_path / "k.lmdb", csv=p, progress=False)
    assert dict(s.skipped) == {"CSV row for a missing file": 1} and not s.info["notes"]
    ds = packio.open_dataset(s.output, decode=False)
    assert ds.classes == ["2", "9", "10"]
    assert {ds.sample(i).key: ds.classes[ds.sample(i).label] for i in range(6)} == {
        "a.jpg": "10", "b.jpg": "2", "c.png": "10", "d.jpg": "2", "e.jpg": "9", "f.jpg": "2"}
    # one image given two labels: skipped and counted, never silently one of them
    p.write_text("Filename,Class\na.jpg,x\na.jpg,y\nb.jpg,x\n")
    s = packio.convert(src, tmp_path / "k2.lmdb", csv=p, progress=False)
    assert s.skipped == {"CSV gives the image several labels": 1} and s.packed == 5
    with pytest.raises(packio.SourceError, match="several labels"):
        packio.convert(src, tmp_path / "k3.lmdb", csv=p, progress=False, strict=True)
    # a CSV whose names match no image cannot label anything: an error, not 6 x -1
    p.write_text("filename,label\nimg_001.jpg,x\nimg_002.jpg,y\n")
    with pytest.raises(packio.SourceError, match="none of its 2 rows names an image.*filename=COLUMN"):
        packio.convert(src, tmp_path / "k4.lmdb", csv=p, progress=False)
    p.write_text("file,kind\na.jpg,x\n")
    with pytest.raises(packio.SourceError, match=r"names \['species'\], which the CSV does not have"):
        packio.convert(src, tmp_path / "k5.lmdb", csv=p, columns={"label": "species"}, progress=False)


def test_label_column_with_box_columns(tmp_path):
    from packio.cli import main

    src = _flat_folder(tmp_path / "flat")
    p = tmp_path / "ann.csv"
    p.write_text("filename,species,class,xmin,ymin,xmax,ymax\n"
                 "a.jpg,wasp,head,1,1,5,5\na.jpg,wasp,wing,6,6,9,9\nb.jpg,bee,head,2,2,4,4\nc.png,ant,,,,,\n")
    # without --label-column, 'class' labels the boxes and the images stay unlabelled (no folders)
    s = packio.convert(src, tmp_path / "plain.lmdb", csv=p, progress=False)
    ds = packio.open_dataset(s.output, decode=False)
    a = next(ds.sample(i) for i in range(6) if ds.sample(i).key == "a.jpg")
    assert a.label == -1 and _names(ds.box_classes, a.box_labels) == ["head", "wing"]
    assert main(["convert", str(src), str(tmp_path / "o.lmdb"), "--csv", str(p), "--label-column", "species",
                 "--quiet"]) == 0
    ds = packio.open_dataset(tmp_path / "o.lmdb", decode=False)
    got = {ds.sample(i).key: ds.sample(i) for i in range(6)}
    assert {k: ds.classes[v.label] if v.label >= 0 else None for k, v in got.items()} == {
        "a.jpg": "wasp", "b.jpg": "bee", "c.png": "ant", "d.jpg": None, "e.jpg": None, "f.jpg": None}
    assert _names(ds.box_classes, got["a.jpg"].box_labels) == ["head", "wing"]
    assert len(got["c.png"].boxes) == 0  # a row with empty box cells labels the image, adds no box
    assert ds.reader.manifest.summary["notes"] == {
        "image without a label (no CSV label / class folder; packed with label -1)": 3}


def test_csv_frame_that_fits_nothing_is_skipped_and_named(tmp_path):
    src = _flat_folder(tmp_path / "flat")  # 24x20 images
    p = tmp_path / "ann.csv"
    p.write_text("filename,width,height,class,xmin,ymin,xmax,ymax\n"
                 "a.jpg,24,20,x,1,1,5,5\nb.jpg,30,30,x,1,1,5,5\nd.jpg,12,10,x,2,2,6,6\n")
    s = packio.convert(src, tmp_path / "o.lmdb", csv=p, progress=False)
    assert s.skipped == {"CSV width/height fit neither the image nor its EXIF-upright view": 1}
    assert any("b.jpg" in q and "30x30" in q and "24x20" in q for q in s.problems)
    ds = packio.open_dataset(s.output, decode=False)
    got = {ds.sample(i).key: ds.sample(i).boxes.tolist() for i in range(len(ds))}
    assert got["a.jpg"] == [[1, 1, 5, 5]] and got["d.jpg"] == [[4, 4, 12, 12]]  # d: a half-size copy


# --------------------------------------------------------------------------------------------
# Foreign WebDataset shards: .json boxes, no sizes
# --------------------------------------------------------------------------------------------

def test_foreign_webdataset_boxes_scale_with_resize(tmp_path):
    import webdataset as wds

    big = {name: [4 * v for v in b] for name, b in TRUTH_BOXES.items()}  # 384x256: DCT-scaled on read
    img = _draw(4 * UPRIGHT_W, 4 * UPRIGHT_H, big)
    data = _encode(img, 1, "JPEG")
    names = sorted(big)
    (tmp_path / "shards").mkdir()
    with wds.TarWriter(str(tmp_path / "shards" / "x-000000.tar")) as sink:
        for k in range(3):
            sink.write({"__key__": f"s{k}", "jpg": data, "cls": str(k).encode(),
                        "json": {"boxes": [big[n] for n in names], "box_labels": [0, 1, 2]}})
    assert dec.decode(data, min_size=(40, 56)).shape[0] < 4 * UPRIGHT_H  # the read below decodes smaller
    for resize in (None, (40, 56), (64, 40)):
        ds = packio.open_dataset(tmp_path / "shards", resize=resize)
        for i in range(len(ds)):
            item = ds[i]
            check_truth(item["image"].numpy(), item["boxes"].numpy(), _names(names, item["box_labels"]),
                        f"foreign resize={resize}")
        if resize is not None:
            for batch in packio.DataLoader(ds, batch_size=3):
                for k in range(3):
                    check_truth(batch["image"][k].numpy(), batch["boxes"][k].numpy(),
                                _names(names, batch["box_labels"][k]), f"foreign batch resize={resize}")


# --------------------------------------------------------------------------------------------
# GPU transforms (packio.cuda, owned by issue 17) on CPU tensors, against the same ground truth.
# Boxes go through the torch twin of packio.geometry (PackedBoxes), box_labels with them.
# --------------------------------------------------------------------------------------------

def _gpu_apply(op: str, images: torch.Tensor, boxes: list, labels: list) -> tuple[torch.Tensor, list, list]:
    from packio.cuda import boxes as bx
    from packio.cuda import transforms as T

    g = torch.Generator().manual_seed(3)
    if op == "gpu_transform":  # the whole training pipeline: random crop + flip + resize (+ identity normalise)
        out = T.GPUTransform(size=(48, 48), crop_scale=(0.1, 0.6), mean=(0, 0, 0), std=(1 / 255,) * 3,
                             generator=g)({"image": images, "boxes": boxes, "box_labels": labels})
        return (out["image"], *out["boxes"].per_image())
    hw, full = T.image_sizes(images), tuple(images.shape[-2:])
    flip = torch.ones(len(images), dtype=torch.bool) if op == "hflip" else None
    if op == "random_resized_crop":
        size, window = (48, 48), T.sample_crops(hw, scale=(0.1, 0.4), generator=g)
    elif op == "center_crop":
        size, window = (40, 40), T.center_window(hw, (40, 40))
    else:
        size, window = ((40, 60) if op == "resize" else full), T.center_crops(hw, full)
    x = T.resized_crop(images, window, size, flip)
    p = bx.resize(bx.crop(bx.PackedBoxes.from_lists(boxes, labels), window), window[:, 2:], size)
    if flip is not None:
        p = bx.hflip(p, size[1], flip)
    return (x, *p.per_image())


GPU_OPS = ["resize", "hflip", "center_crop", "random_resized_crop", "gpu_transform"]


@pytest.mark.parametrize("op", GPU_OPS)
def test_gpu_transforms_ground_truth_on_cpu(oriented_folder, tmp_path, op):
    src, csv_path = oriented_folder
    s = packio.convert(src, tmp_path / "g.lmdb", csv=csv_path, progress=False)
    ds = packio.open_dataset(s.output, resize=(UPRIGHT_H, UPRIGHT_W))
    batch = next(iter(packio.DataLoader(ds, batch_size=9)))
    x, boxes, labels = _gpu_apply(op, batch["image"], batch["boxes"], batch["box_labels"])
    for k in range(len(x)):
        check_truth(x[k].numpy(), boxes[k].numpy(), _names(ds.box_classes, labels[k]), f"gpu {op} {batch['key'][k]}")


def test_foreign_shard_with_exif_orientation(tmp_path):
    """Read as found: pixels as stored, boxes in that frame (no EXIF applied at read time). Packed:
    the image is stored upright and its boxes turned with it."""
    import webdataset as wds

    upright = _draw(UPRIGHT_W, UPRIGHT_H, TRUTH_BOXES)
    names = sorted(TRUTH_BOXES)
    (tmp_path / "shards").mkdir()
    with wds.TarWriter(str(tmp_path / "shards" / "x-000000.tar")) as sink:
        for o in (3, 6):
            inv = geo.inverse_orientation(o)
            stored = np.ascontiguousarray(geo.orient_image(upright, inv))
            boxes = geo.orient(np.array([TRUTH_BOXES[n] for n in names]), inv, UPRIGHT_W, UPRIGHT_H)
            sink.write({"__key__": f"o{o}", "jpg": _encode(stored, o, "JPEG"),
                        "json": {"boxes": boxes.tolist(), "box_labels": [0, 1, 2]}})
    for i, item in enumerate(packio.open_dataset(tmp_path / "shards", resize=(48, 48))):
        check_truth(item["image"].numpy(), item["boxes"].numpy(), _names(names, item["box_labels"]), f"as found {i}")
    s = packio.convert(tmp_path / "shards", tmp_path / "p.lmdb", progress=False)
    assert s.info["notes"] == {REORIENTED: 2}
    for item in packio.open_dataset(s.output):
        assert tuple(item["image"].shape[1:]) == (UPRIGHT_H, UPRIGHT_W)
        check_truth(item["image"].numpy(), item["boxes"].numpy(), _names(names, item["box_labels"]),
                    f"packed {item['key']}")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.sampled_from([b"\xff\xd8\xff", b"\xff\xd8\xff\xe1\x00\x10Exif\x00\x00",
                                                 b"\x89PNG\r\n\x1a\n", b""]))
def test_exif_orientation_never_raises_on_garbage(tail: bytes, head: bytes) -> None:
    assert dec.exif_orientation(head + tail) in geo.ORIENTATIONS
