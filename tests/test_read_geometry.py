"""Read-time geometry (issue 39): random-resized crops, flips, short side + center crop.

Against ground truth: squares drawn where each box says are found where the crop puts them,
flipped and not; crop windows follow torchvision's RandomResizedCrop rule (statistics with a
fixed seed, and its fallback); a sample's plan is a pure function of (seed, epoch, index)."""

from __future__ import annotations

import csv
import math
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch

import packio
from packio import decode as dec
from packio import geometry as geo

H, W = 120, 160
COLORS = {"red": (255, 0, 0), "green": (0, 255, 0)}


def _squares_folder(tmp_path: Path, n: int = 12) -> tuple[Path, Path, dict[str, list]]:
    """``n`` JPEGs (4:4:4, q95) of H x W, black, with a red and a green square; a CSV of their boxes."""
    rng = np.random.default_rng(5)
    root, rows, truth = tmp_path / "sq", [], {}
    root.mkdir()
    for k in range(n):
        img, boxes = np.zeros((H, W, 3), np.uint8), []
        for name, color in COLORS.items():
            s = int(rng.integers(24, 44))
            x, y = int(rng.integers(0, W - s)), int(rng.integers(0, H - s))
            img[y:y + s, x:x + s] = color
            boxes.append((name, [x, y, x + s, y + s]))
            rows.append([f"{k:02d}.jpg", W, H, name, x, y, x + s, y + s])
        (root / f"{k:02d}.jpg").write_bytes(simplejpeg.encode_jpeg(img, 95, colorsubsampling="444"))
        truth[f"{k:02d}.jpg"] = boxes
    csv_path = tmp_path / "boxes.csv"
    with open(csv_path, "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["filename", "width", "height", "class", "xmin", "ymin", "xmax", "ymax"])
        wr.writerows(rows)
    return root, csv_path, truth


def _found(img: np.ndarray, color: str) -> list[float] | None:
    """Tight xyxy box of the pixels of ``color`` in an HWC image (None when none shows)."""
    r, g = img[..., 0].astype(int), img[..., 1].astype(int)
    mask = (r > 140) & (g < 90) if color == "red" else (g > 140) & (r < 90)
    ys, xs = np.nonzero(mask)
    return None if len(xs) < 4 else [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]


def _expected(box: list[int], p: geo.Plan) -> tuple[list[float], float]:
    """Where the plan puts ``box`` in the output, worked out here (crop, scale, mirror), and
    the share of its area inside the window."""
    x0, y0, x1, y1 = box
    cx0, cx1 = max(x0, p.left), min(x1, p.left + p.width)
    cy0, cy1 = max(y0, p.top), min(y1, p.top + p.height)
    seen = max(0, cx1 - cx0) * max(0, cy1 - cy0) / ((x1 - x0) * (y1 - y0))
    sx, sy = p.out_w / p.width, p.out_h / p.height
    bx0, bx1 = (cx0 - p.left) * sx, (cx1 - p.left) * sx
    if p.flip:
        bx0, bx1 = p.out_w - bx1, p.out_w - bx0
    return [bx0, (cy0 - p.top) * sy, bx1, (cy1 - p.top) * sy], seen


RECIPES = {"train": dict(random_resized_crop=(48, 64), crop_scale=(0.2, 1.0), flip_p=0.5, min_visible=0.25),
           "eval": dict(short_side=96, center_crop=(80, 88), flip_p=1.0)}


@pytest.fixture(scope="module")
def squares(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("squares")
    src, csv_path, truth = _squares_folder(tmp)
    out = {}
    for fmt, suffix in (("lmdb", ".lmdb"), ("arrays", ".arrays")):  # JPEG bytes, and raw pixels
        out[fmt] = tmp / f"d{suffix}"
        size = {"resize": packio.ResizeSpec(size=(H, W))} if fmt == "arrays" else {}  # the same size: as found
        packio.convert(src, out[fmt], csv=csv_path, progress=False, **size)
    return out, truth


@pytest.mark.parametrize("fmt", ["lmdb", "arrays"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_squares_are_found_where_the_crop_puts_the_boxes(squares, fmt, recipe):
    paths, truth = squares
    kw = RECIPES[recipe]
    r = geo.Recipe(**kw)
    ds = packio.open_dataset(paths[fmt], threads=2, crop_seed=3, **kw)
    names = ds.box_classes
    flips, dropped, looked = set(), 0, 0
    batch = ds.__getitems__(list(range(len(ds))))
    for k, item in enumerate(batch):
        assert item is not None and tuple(item["image"].shape) == (3, *r.size)
        p = geo.plan(r, H, W, 3, 0, item["index"])
        flips.add(p.flip)
        img = item["image"].permute(1, 2, 0).numpy()
        got = {names[int(lab)]: b for lab, b in zip(item["box_labels"], item["boxes"].tolist())}
        single = ds[item["index"]]  # ds[i] takes the same path: the same pixels and boxes
        assert torch.equal(single["image"], item["image"]) and torch.equal(single["boxes"], item["boxes"])
        for color, box in truth[item["key"]]:
            want, seen = _expected(box, p)
            kept = seen > 0 and seen >= r.min_visible
            assert (color in got) == kept, (item["key"], color, seen)
            dropped += not kept
            if kept:
                np.testing.assert_allclose(got[color], want, atol=1e-3)
                if (want[2] - want[0]) >= 3 and (want[3] - want[1]) >= 3:
                    found = _found(img, color)
                    assert found is not None, (item["key"], color, p)
                    np.testing.assert_allclose(found, want, atol=1.6, err_msg=f"{item['key']} {color} {p}")
                    looked += 1
            elif seen == 0:
                assert _found(img, color) is None
    assert looked >= 10
    if recipe == "train":
        assert flips == {True, False} and dropped > 0  # both cases met, and the crops did drop boxes
    else:
        assert flips == {True}


def test_plan_follows_torchvisions_rule_statistically():
    """Windows of a 300 x 400 image against torchvision's ``RandomResizedCrop.get_params``
    transcribed with Python's RNG: the same distributions of area share, aspect ratio and
    position (two-sample Kolmogorov-Smirnov, fixed seeds), and the same fallback rate."""
    def reference(h: int, w: int, rng: random.Random, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        area, log_ratio = h * w, (math.log(ratio[0]), math.log(ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
            if 0 < cw <= w and 0 < ch <= h:
                return rng.randint(0, h - ch), rng.randint(0, w - cw), ch, cw
        return None  # the fallback: counted

    def ks(a: np.ndarray, b: np.ndarray) -> float:
        grid = np.sort(np.concatenate([a, b]))
        return float(np.abs(np.searchsorted(np.sort(a), grid, "right") / len(a)
                            - np.searchsorted(np.sort(b), grid, "right") / len(b)).max())

    h, w, n = 300, 400, 4000
    r = geo.Recipe(random_resized_crop=224)
    ours = np.array([geo.plan(r, h, w, 11, 0, i)[:4] for i in range(n)], np.float64)
    rng = random.Random(7)
    ref = [reference(h, w, rng) for _ in range(n)]
    theirs = np.array([x for x in ref if x is not None], np.float64)

    def stats(win: np.ndarray) -> dict[str, np.ndarray]:
        top, left, ch, cw = win.T
        return {"area": ch * cw / (h * w), "log ratio": np.log(cw / ch), "top": top / np.maximum(1, h - ch),
                "left": left / np.maximum(1, w - cw)}

    for key, a in stats(ours).items():
        assert ks(a, stats(theirs)[key]) < 0.045, key  # 1.95 * sqrt(2 / n): p ~ 0.001
    a = stats(ours)
    assert 0.08 <= a["area"].min() < 0.09 and a["area"].max() > 0.98
    assert abs(a["log ratio"].min() - math.log(3 / 4)) < 0.01 and abs(a["log ratio"].max() - math.log(4 / 3)) < 0.01
    fallback = [geo.random_resized_window(h, w, [0.99, 0.99, 0, 0] * 10, (0.9, 1.0), (3 / 4, 4 / 3))]
    assert fallback == [(0, 0, h, w)]  # no try fits: the whole image (its ratio is inside the range)


@pytest.mark.parametrize("h,w,ratio,want", [
    (100, 100, (2.0, 3.0), (25, 0, 50, 100)),   # narrower than the range: full width, h = w / 2, centered
    (100, 400, (0.5, 2.0), (0, 100, 100, 200)),  # wider than the range: full height, w = 2 h, centered
    (90, 120, (0.5, 2.0), (0, 0, 90, 120)),     # inside the range: the whole image
])
def test_fallback_is_torchvisions_ratio_clamped_center_crop(h, w, ratio, want):
    u = [0.999, 0.999, 0.5, 0.5] * geo.ATTEMPTS  # the largest area at the widest ratio: no try fits
    assert geo.random_resized_window(h, w, u, (0.99, 1.0), ratio) == want
    if want != (0, 0, h, w):  # here no try can fit at all: every plan is the fallback
        r = geo.Recipe(random_resized_crop=32, crop_scale=(0.99, 1.0), crop_ratio=ratio)
        assert {tuple(geo.plan(r, h, w, 0, 0, i)[:4]) for i in range(50)} == {want}


def test_center_crop_after_short_side_resize():
    r = geo.Recipe(short_side=256, center_crop=224)
    p = geo.plan(r, 375, 500)
    # resized to 256 x 341; the centered 224 x 224 window is rows 16..240, columns 58..282
    assert (p.top, p.height) == (round(16 * 375 / 256), round(240 * 375 / 256) - round(16 * 375 / 256))
    assert (p.left, p.width) == (round(58 * 500 / 341), round(282 * 500 / 341) - round(58 * 500 / 341))
    assert (p.out_h, p.out_w, p.flip) == (224, 224, False)
    assert geo.plan(geo.Recipe(center_crop=(50, 80)), 40, 60)[:6] == (0, 0, 40, 60, 50, 80)  # smaller: stretched


def test_plan_is_a_pure_function_of_seed_epoch_and_index():
    r = geo.Recipe(random_resized_crop=224, flip_p=0.5)
    states = (np.random.get_state()[1].copy(), random.getstate(), torch.get_rng_state().clone())
    ids = list(range(300))
    ahead = [geo.plan(r, 375, 500, 1, 2, i) for i in ids]
    backwards = [geo.plan(r, 375, 500, 1, 2, i) for i in reversed(ids)][::-1]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda i: geo.plan(r, 375, 500, 1, 2, i), ids))
    assert ahead == backwards == threaded
    assert np.array_equal(states[0], np.random.get_state()[1]) and states[1] == random.getstate()
    assert torch.equal(states[2], torch.get_rng_state())  # no global RNG drawn from
    other_epoch = [geo.plan(r, 375, 500, 1, 3, i) for i in ids]
    other_seed = [geo.plan(r, 375, 500, 2, 2, i) for i in ids]
    assert sum(a != b for a, b in zip(ahead, other_epoch)) > 290
    assert sum(a != b for a, b in zip(ahead, other_seed)) > 290
    # the flip takes the first draw: switching the crop on or off leaves the flips as they were
    flips = [geo.plan(geo.Recipe(flip_p=0.5), 375, 500, 1, 2, i).flip for i in ids]
    assert flips == [p.flip for p in ahead] and 100 < sum(flips) < 200


def _alone(path: Path, kw: dict, epoch: int) -> list[dict]:
    """Every sample read alone (``ds[i]``, this process, one thread) in ``epoch``."""
    ds = packio.open_dataset(path, threads=1, **kw)
    ds.set_epoch(epoch)
    return [ds[i] for i in range(len(ds))]


def _check_batch(b: dict, ref: list, mixed: bool = False) -> list[int]:
    """Each sample of a handed-out batch is its fresh read alone (pixels, boxes, labels; ``mixed``:
    ``ref[source][index]``), and the batch counts the boxes its crops dropped (2 stored per
    sample); returns its indices."""
    ids = b["index"].tolist()
    for j, i in enumerate(ids):
        r = ref[int(b["source"][j])][i] if mixed else ref[i]
        assert torch.equal(b["image"][j], r["image"]), (i, j)
        assert torch.equal(b["boxes"][j], r["boxes"]) and torch.equal(b["box_labels"][j], r["box_labels"])
    assert b["dropped"] == 2 * len(ids) - sum(len(x) for x in b["boxes"])
    return ids


def test_same_crops_on_any_threads_and_workers_and_set_epoch_changes_them(squares):
    """Real worker processes (persistent: set_epoch must reach them): a sample's crop in epoch e is
    its read alone in epoch e, whoever decodes it; another epoch crops anew; dropped boxes counted."""
    paths, _ = squares
    kw = dict(RECIPES["train"], crop_seed=9)
    refs = {e: _alone(paths["lmdb"], kw, e) for e in (0, 1)}
    differ = sum(not torch.equal(a["image"], b["image"]) for a, b in zip(refs[0], refs[1]))
    assert differ >= len(refs[0]) - 1  # the epoch is in the plan
    dropped = 0
    for threads, nw in ((1, 0), (4, 0), (1, 2), (4, 2)):
        ds = packio.open_dataset(paths["lmdb"], threads=threads, **kw)
        more = dict(multiprocessing_context="fork", persistent_workers=True) if nw else {}
        dl = packio.DataLoader(ds, batch_size=5, shuffle=True, num_workers=nw, **more)
        for epoch in (1, 0):
            dl.set_epoch(epoch)
            got = []
            for b in dl:
                got += _check_batch(b, refs[epoch])
                dropped += b["dropped"]
            assert sorted(got) == list(range(len(ds)))
    assert dropped > 0
    plain = next(iter(packio.DataLoader(packio.open_dataset(paths["lmdb"]), batch_size=4)))
    assert "dropped" not in plain  # no read-time crops: no count


@pytest.mark.parametrize("iterable", [True, False])
def test_crops_after_a_resume_on_another_world_size(squares, iterable):
    """Two ranks stop after a batch in epoch 1; one rank with 2 workers resumes from their state
    (no set_epoch: the state says the epoch): every crop is the sample's read alone in epoch 1,
    and the epoch is read once in all. Iterable, and map-style with a ResumableSampler."""
    paths, _ = squares
    kw = dict(RECIPES["train"], crop_seed=4)
    ref = _alone(paths["lmdb"], kw, 1)

    def loader(rank: int, world: int, batch: int, **more) -> packio.DataLoader:
        if iterable:
            ds = packio.open_dataset(paths["lmdb"], iterable=True, shuffle=True, seed=3, rank=rank, world_size=world,
                                     **kw)
        else:
            ds = packio.open_dataset(paths["lmdb"], **kw)
            more["sampler"] = packio.ResumableSampler(len(ds), seed=3, rank=rank, world_size=world)
        return packio.DataLoader(ds, batch_size=batch, **more)

    taken, states = [], []
    for rank in (0, 1):
        dl = loader(rank, 2, 2)
        dl.set_epoch(1)
        taken += _check_batch(next(iter(dl)), ref)
        states.append(dl.state_dict())
    assert states[0] == states[1] and states[0]["epoch"] == 1
    dl = loader(0, 1, 3, num_workers=2, multiprocessing_context="fork")
    dl.load_state_dict(states[0])
    taken += [i for b in dl for i in _check_batch(b, ref)]
    assert sorted(taken) == list(range(len(ref)))


def test_a_sample_in_a_mix_is_cropped_as_it_is_read_alone(squares):
    """A mix hands each source its own indices and the epoch: a sample's crop is the one it has
    read alone (its own source, same epoch); the mix's batches count the dropped boxes."""
    paths, _ = squares
    kw = dict(RECIPES["train"], crop_seed=2)
    refs = [_alone(paths[fmt], kw, 1) for fmt in ("lmdb", "arrays")]
    mixed = packio.mix([paths["lmdb"], paths["arrays"]], seed=1, batch_size=6, threads=4, **kw)
    dl = packio.DataLoader(mixed, batch_size=6)
    dl.set_epoch(1)
    seen = [(s, i) for b in dl for s, i in zip(b["source"].tolist(), _check_batch(b, refs, mixed=True))]
    assert sorted(seen) == [(s, i) for s in (0, 1) for i in range(len(refs[0]))]


def test_box_crop_min_visible_rule():
    boxes = np.array([[0, 0, 10, 10], [8, 0, 18, 10], [5, 5, 5, 5], [-4, 0, 6, 10]], np.float32)
    b, lab = geo.crop(boxes, np.arange(4), top=0, left=0, height=10, width=10, min_visible=0.5)
    # wholly in; 20 % in (dropped); zero area inside (kept); 60 % in (kept, clipped)
    assert lab.tolist() == [0, 2, 3] and b.tolist() == [[0, 0, 10, 10], [5, 5, 5, 5], [0, 0, 6, 10]]
    p = geo.Plan(2, 3, 10, 10, 20, 20, True, 30, 30)
    pb, plab, dropped = geo.plan_boxes(boxes + 3, np.arange(4), p, 0.5)
    assert dropped == 1 and plab.tolist() == [0, 2, 3]
    # window x 3..13, y 2..12: 90 %, 18 % (dropped), zero area, 54 % inside; then x2 and mirrored in 20
    assert pb.tolist() == [[0, 2, 20, 20], [10, 12, 10, 12], [8, 2, 20, 20]]


def test_plan_boxes_is_crop_resize_flip_composed():
    """plan_boxes' one pass equals the rule functions one after the other, bit for bit."""
    rng = np.random.default_rng(2)
    for k in range(200):
        h, w = int(rng.integers(20, 400)), int(rng.integers(20, 400))
        xy = rng.uniform(-20, [w + 20, h + 20], (int(rng.integers(0, 12)), 2, 2)).astype(np.float32)
        boxes = np.concatenate([xy.min(1), xy.max(1)], 1).astype(np.float32)
        boxes[::5, 2] = boxes[::5, 0]  # some zero-width boxes
        ch, cw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        p = geo.Plan(int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw,
                     int(rng.integers(8, 300)), int(rng.integers(8, 300)), bool(k % 2), h, w)
        mv = (0.0, 0.3, 1.0)[k % 3]
        got = geo.plan_boxes(boxes, np.arange(len(boxes)), p, mv)
        b, lab = geo.crop(boxes, np.arange(len(boxes)), p.top, p.left, p.height, p.width, mv)
        b = geo.resize(b, (p.height, p.width), (p.out_h, p.out_w))
        b = geo.hflip(b, p.out_w) if p.flip else b
        assert np.array_equal(got[0], b) and np.array_equal(got[1], lab) and got[2] == len(boxes) - len(b)


def test_decode_window_into_a_batch_row_and_dct_scaling():
    img = np.zeros((480, 640, 3), np.uint8)
    img[100:300, 200:400] = 255
    data = simplejpeg.encode_jpeg(img, 95, colorsubsampling="444")
    p = geo.Plan(80, 160, 320, 320, 64, 64, False, 480, 640)  # window 5x the output: decoded at 1/4
    assert dec.dct_factor(p) == 4
    row = np.zeros((2, 64, 64, 3), np.uint8)
    got = dec.decode_window(data, p, row[1])
    assert got is row[1] or np.shares_memory(got, row[1])
    ys, xs = np.nonzero(row[1, ..., 0] > 128)  # the square: columns 200..400, rows 100..300 of the image
    assert [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1] == pytest.approx([8, 4, 48, 44], abs=1)
    assert not row[0].any()  # nothing written outside the row
    full = dec.decode_window(data, p, dct=False)
    assert np.abs(full.astype(int) - got).mean() < 4


def test_crop_region_decode_equals_the_whole_decode_there(tmp_path, monkeypatch):
    """Where libjpeg-turbo 3 is found, a window decoded alone is pixel for pixel what a whole
    decode holds there; where it is not (a path that is no library), the whole decode serves."""
    from conftest import jpeg

    datas = [jpeg(200 + 9 * k, 300 - 7 * k, k) for k in range(6)]
    datas.append(simplejpeg.encode_jpeg(np.ascontiguousarray(np.full((150, 170, 1), 90, np.uint8)), 90,
                                        colorspace="gray"))
    r = geo.Recipe(random_resized_crop=64, flip_p=0.5)
    plans = [geo.plan(r, *simplejpeg.decode_jpeg_header(d)[:2], 0, 0, i) for i, d in enumerate(datas)]
    whole = [dec.decode_window(d, p, region=False) for d, p in zip(datas, plans)]
    found = []
    for env in (None, str(tmp_path / "absent.so")):  # as set outside ($PACKIO_LIBTURBOJPEG), then no such file
        if env:
            monkeypatch.setenv("PACKIO_LIBTURBOJPEG", env)
        dec.turbojpeg3.cache_clear()
        try:
            found.append(dec.turbojpeg3())
            got = [dec.decode_window(d, p) for d, p in zip(datas, plans)]
        finally:
            dec.turbojpeg3.cache_clear()
        assert all(np.array_equal(a, b) for a, b in zip(got, whole)), env
    if found[0] is None:
        pytest.skip("no libturbojpeg >= 3.0 here (Debian 12 ships 2.1.5): the whole decode served")
