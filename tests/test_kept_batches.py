"""A batch handed out is never written again by packio: a training loop that keeps
batches (the tensor, a slice, a numpy view, the untyped storage, a DLPack capsule)
still holds, after the epoch, exactly what a fresh per-sample read gives, for every
format, map-style and iterable, with and without workers and pinned memory."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

import packio
from conftest import jpeg

N, BATCH = 20, 2
FORMATS = {"lmdb": ".lmdb", "hdf5": ".h5", "tar": ".wds", "bmp": ".bmpdir", "arrays": ".arrays"}


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> dict[str, Path]:
    """Every registered format, packed from one small folder (boxes on some samples)."""
    root = tmp_path_factory.mktemp("kept")
    rows = []
    for k in range(N):
        cls = ("a", "b")[k % 2]
        (root / "images" / cls).mkdir(parents=True, exist_ok=True)
        h, w = 20 + k, 24 + 2 * k
        (root / "images" / cls / f"{k:02d}.jpg").write_bytes(jpeg(h, w, seed=k))
        if k % 3 == 0:
            rows.append([f"{k:02d}.jpg", w, h, "thing", 1.0, 2.0, 10.0 + k % 5, 12.0])
    with open(root / "boxes.csv", "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["filename", "width", "height", "class", "xmin", "ymin", "xmax", "ymax"])
        wr.writerows(rows)
    out = {}
    for name, suffix in FORMATS.items():
        fixed = name in ("arrays", "hdf5")  # raw pixels of one shape: the whole-batch gather route
        out[name] = root / f"d{suffix}"
        packio.convert(root / "images", out[name], csv=root / "boxes.csv", progress=False,
                       resize=packio.ResizeSpec(size=(16, 16)) if fixed else None)
    assert set(out) == set(packio.formats.formats()), "a format is missing from this test"
    return out


def _keep(img: torch.Tensor, way: str) -> tuple[str, object]:
    if way == "tensor":
        return way, img
    if way == "slice":
        return way, img[1:]
    if way == "numpy":
        return way, img.numpy()
    if way == "storage":
        return way, (img.untyped_storage(), img.storage_offset(), tuple(img.shape), img.stride())
    return way, to_dlpack(img)


def _back(way: str, kept: object) -> torch.Tensor:
    if way in ("tensor", "slice"):
        return kept  # type: ignore[return-value]
    if way == "numpy":
        return torch.from_numpy(kept)  # type: ignore[arg-type]
    if way == "storage":
        storage, offset, shape, stride = kept  # type: ignore[misc]
        return torch.empty(0, dtype=torch.uint8).set_(storage, offset, shape, stride)
    return from_dlpack(kept)


WAYS = ("tensor", "slice", "numpy", "storage", "dlpack")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_kept_batches_never_change(packed, fmt):
    path = packed[fmt]
    resize = None if fmt in ("arrays", "hdf5") else (16, 16)
    fresh = packio.open_dataset(path, resize=resize)
    ref = {i: fresh[i]["image"].clone() for i in range(len(fresh))}  # one sample at a time
    for workers in (0, 2):
        for iterable in (False, True):
            for pin in (False, True):
                ds = packio.open_dataset(path, iterable=iterable, resize=resize)
                kw = {"multiprocessing_context": "fork"} if workers else {}
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # pin_memory without an accelerator
                    loader = packio.DataLoader(ds, batch_size=BATCH, num_workers=workers, pin_memory=pin, **kw)
                    kept, k = [], 0
                    for _epoch in range(2):
                        for b in loader:
                            if k % 3 == 0:
                                way = WAYS[(k // 3) % len(WAYS)]
                                idx = b["index"].tolist()
                                kept.append((idx[1:] if way == "slice" else idx, _keep(b["image"], way)))
                            k += 1
                            del b
                where = f"{fmt} workers={workers} iterable={iterable} pin={pin}"
                assert len(kept) >= len(WAYS), where
                for idx, (way, obj) in kept:
                    images = _back(way, obj)
                    assert images.shape[0] == len(idx), where
                    for j, i in enumerate(idx):
                        assert torch.equal(images[j], ref[i]), f"{where}: kept via {way}, sample {i} changed"
