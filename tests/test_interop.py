"""Other tools read packio's files, and packio reads theirs."""

from __future__ import annotations

import json

import h5py
import numpy as np
import webdataset as wds

import packio
from conftest import jpeg


def test_webdataset_reads_packio_shards(gen_folder, tmp_path):
    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.wds", csv=csv, shard_samples=5, progress=False)
    ds = packio.open_dataset(tmp_path / "d.wds", decode=False)
    want = {ds.sample(i).key: ds.sample(i) for i in range(len(ds))}
    shards = sorted(str(p) for p in (tmp_path / "d.wds").glob("shard-*.tar"))
    assert len(shards) == 3
    got = list(wds.WebDataset(shards, shardshuffle=False))
    assert len(got) == len(want)
    for g in got:
        rec = json.loads(g["json"])
        s = want[rec["key"]]
        img_key = next(k for k in ("jpg", "png") if k in g)
        assert g[img_key] == s.payload
        assert int(g["cls"]) == s.label
        np.testing.assert_allclose(np.asarray(rec["boxes"], np.float32).reshape(-1, 4), s.boxes)


def test_packio_reads_webdataset_shardwriter(tmp_path):
    out = tmp_path / "wds"
    out.mkdir()
    blobs = {}
    with wds.ShardWriter(str(out / "part-%06d.tar"), maxcount=4) as sink:
        for i in range(10):
            blobs[f"s{i:03d}"] = jpeg(30 + i, 40, seed=i)
            sink.write({"__key__": f"s{i:03d}", "jpg": blobs[f"s{i:03d}"], "cls": i % 3})
    for pattern in (str(out), str(out / "part-{000000..000002}.tar")):
        ds = packio.open_dataset(pattern, decode=False)
        assert len(ds) == 10
        for i in range(10):
            s = ds.sample(i)
            assert s.payload == blobs[s.key] and s.label == int(s.key[1:]) % 3
        it = packio.open_dataset(pattern, iterable=True, resize=16)
        assert sorted(x["key"] for x in it) == sorted(blobs)
    # and into any other format
    s = packio.convert(out, tmp_path / "from_wds.lmdb", progress=False)
    assert s.packed == 10


def test_plain_h5py_reads_packio_hdf5(gen_folder, tmp_path):
    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.h5", csv=csv, progress=False)
    ds = packio.open_dataset(tmp_path / "d.h5", decode=False)
    with h5py.File(tmp_path / "d.h5", "r") as f:
        manifest = json.loads(f.attrs["packio_manifest"])
        assert manifest["count"] == len(ds) == len(f["labels"])
        off, boff = f["offsets"][:], f["box_offsets"][:]
        for i in range(len(ds)):
            s = ds.sample(i)
            assert f["images_bytes"][off[i]:off[i + 1]].tobytes() == s.payload
            assert f["labels"][i] == s.label
            np.testing.assert_array_equal(f["boxes"][boff[i]:boff[i + 1]], s.boxes)
            np.testing.assert_array_equal(f["box_labels"][boff[i]:boff[i + 1]], s.box_labels)
    packio.convert(src, tmp_path / "f.h5", resize=packio.ResizeSpec(size=(24, 32)), progress=False)
    with h5py.File(tmp_path / "f.h5", "r") as f:
        assert f["images"].shape == (14, 24, 32, 3) and f["images"].chunks == (1, 24, 32, 3)


def test_plain_numpy_reads_arrays(gen_folder, tmp_path):
    src, _ = gen_folder
    packio.convert(src, tmp_path / "d.arrays", resize=packio.ResizeSpec(size=(24, 32)), progress=False)
    images = np.load(tmp_path / "d.arrays" / "images.npy", mmap_mode="r", allow_pickle=False)
    labels = np.load(tmp_path / "d.arrays" / "labels.npy", allow_pickle=False)
    ds = packio.open_dataset(tmp_path / "d.arrays", decode=False)
    assert images.shape == (14, 24, 32, 3) and len(labels) == 14
    for i in range(14):
        np.testing.assert_array_equal(images[i], ds.sample(i).payload)
        assert labels[i] == ds.sample(i).label
