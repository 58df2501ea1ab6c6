"""A new user's first hour: packio's output used with webdataset, tar and numpy as they
are; conversions keep the bytes unless asked; the command line refuses what cannot work."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

import packio
from conftest import jpeg, shared
from packio import decode as dec
from packio.errors import FormatError
from packio.pack.plan import plan_shards
from packio.pack.workers import auto_workers

HYM_FILES = 397  # JPEGs in hymenoptera_data (plus one GIF that is skipped)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packio", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def hym_wds(tmp_path_factory) -> tuple[Path, Path, str]:
    """hymenoptera packed as a user would: `packio convert SRC h.wds`; (src, dst, printed pattern)."""
    src = shared("hymenoptera") / "hymenoptera_data"
    dst = tmp_path_factory.mktemp("hym") / "h.wds"
    r = cli("convert", str(src), str(dst))
    assert r.returncode == 0, r.stderr
    m = re.search(r"^shards:\s+\d+ × ~\d+ samples: (\S+)$", r.stdout, re.M)
    assert m, r.stdout
    return src, dst, m[1]


def test_webdataset_on_the_printed_pattern_two_workers_every_sample_once(hym_wds):
    import torch
    import webdataset as wds

    src, dst, pattern = hym_wds
    assert pattern == f"{dst}/shard-{{000000..000007}}.tar"  # 397 samples: 8 shards of ~50
    info = cli("info", str(dst))
    assert info.returncode == 0 and pattern in info.stdout

    def digest(s: dict) -> tuple[str, str, int]:
        import json

        return json.loads(s["json"])["key"], xxhash.xxh3_64_hexdigest(s["jpg"]), int(s["cls"])

    ds = wds.WebDataset(pattern, shardshuffle=False).map(digest)
    got = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    keys = [k for k, _, _ in got]
    assert len(keys) == HYM_FILES and len(set(keys)) == HYM_FILES  # every sample once
    classes = ["ants", "bees"]
    for key, h, cls in got:
        assert h == xxhash.xxh3_64_hexdigest((src / key).read_bytes())  # the source bytes, as found
        assert classes[cls] == key.split("/")[1]


def test_tar_tf_lists_key_jpg_cls_json(hym_wds):
    tar = shutil.which("tar")
    if tar is None:
        pytest.skip("no tar command")
    _, dst, _ = hym_wds
    per_shard = []
    for shard in sorted(dst.glob("shard-*.tar")):
        names = subprocess.run([tar, "tf", str(shard)], capture_output=True, text=True, check=True).stdout.split()
        members: dict[str, set[str]] = {}
        for n in names:
            key, _, ext = n.partition(".")
            members.setdefault(key, set()).add(ext)
        assert all(exts == {"jpg", "cls", "json"} for exts in members.values()), members
        per_shard.append(len(members))
    assert sum(per_shard) == HYM_FILES and len(per_shard) == 8 and max(per_shard) - min(per_shard) <= 1


def test_np_load_on_the_arrays_file(gen_folder, tmp_path):
    src, _ = gen_folder
    s = packio.convert(src, tmp_path / "d.arrays", resize=packio.ResizeSpec(size=(24, 32)), progress=False)
    assert str(tmp_path / "d.arrays" / "images.npy") in s.text()
    images = np.load(tmp_path / "d.arrays" / "images.npy", allow_pickle=False)  # a real .npy file
    labels = np.load(tmp_path / "d.arrays" / "labels.npy", allow_pickle=False)
    ds = packio.open_dataset(tmp_path / "d.arrays", decode=False)
    assert images.shape == (14, 24, 32, 3) and images.dtype == np.uint8
    for i in range(14):
        np.testing.assert_array_equal(images[i], ds.sample(i).payload)
        assert labels[i] == ds.sample(i).label


@pytest.mark.parametrize("name,fmt,better", [("x.tar", None, "x.wds"), ("x.npy", None, "x.arrays"),
                                             ("x.bmp", None, "x.bmpdir"), ("x.npy", "hdf5", "x.h5"),
                                             ("x.h5", "lmdb", "x.lmdb")])
def test_names_that_promise_something_else_are_refused(gen_folder, tmp_path, name, fmt, better):
    src, _ = gen_folder
    with pytest.raises(FormatError, match=re.escape(str(tmp_path / better))):
        packio.convert(src, tmp_path / name, format=fmt, resize=packio.ResizeSpec(size=(8, 8)), progress=False)
    assert not (tmp_path / name).exists()


def test_bmp_to_lmdb_keeps_the_bytes_or_encodes_jpeg(gen_folder, tmp_path, capsys):
    src, _ = gen_folder
    bmp = tmp_path / "b.bmpdir"
    packio.convert(src, bmp, resize=packio.ResizeSpec(short_side=40), progress=False)
    files = sorted((bmp / "images").rglob("*.bmp"))
    assert len(files) == 14

    packio.convert(bmp, tmp_path / "keep.lmdb", progress=False)  # default: keep
    kept = packio.open_dataset(tmp_path / "keep.lmdb", decode=False)
    for i, f in enumerate(files):
        s = kept.sample(i)
        assert s.encoding == "bmp" and s.payload == f.read_bytes()  # the same bytes as the BMP source
    m = kept.reader.manifest
    assert m.image["encodings"] == {"bmp": 14}
    assert [h["to"] for h in m.image["history"]] == ["bmp", "lmdb"]
    assert m.image["history"][0]["result"] == {"jpeg→bmp": 13, "png→bmp": 1}
    assert m.image["history"][1]["result"] == {"bmp kept": 14}

    packio.convert(bmp, tmp_path / "jpg.lmdb", encode="jpeg", quality=90, progress=False)
    enc = packio.open_dataset(tmp_path / "jpg.lmdb", decode=False)
    for i, f in enumerate(files):
        s = enc.sample(i)
        assert s.encoding == "jpeg" and s.payload[:3] == b"\xff\xd8\xff"
        want = dec.decode(f.read_bytes())
        assert np.abs(dec.decode(s.payload).astype(int) - want).mean() < 8  # q90 4:2:0 of the same noisy pixels
    m = enc.reader.manifest
    assert m.image["encodings"] == {"jpeg": 14} and m.image["history"][-1]["result"] == {"bmp→jpeg": 14}
    assert m.image["quality"] == 90
    from packio.cli import main

    assert main(["info", str(tmp_path / "jpg.lmdb")]) == 0
    out = capsys.readouterr().out
    assert "14 bmp→jpeg; JPEG quality 90" in out and re.search(r"history:\s+1\. image folder .*→ bmp", out)


def test_arrays_to_tar_stores_lossless_png_and_says_so(gen_folder, tmp_path):
    src, _ = gen_folder
    packio.convert(src, tmp_path / "a.arrays", resize=packio.ResizeSpec(size=(20, 24)), progress=False)
    s = packio.convert(tmp_path / "a.arrays", tmp_path / "t.wds", progress=False)
    assert "14 uint8 pixels→png" in s.text() and "lossless" in s.text()
    a, t = packio.open_dataset(tmp_path / "a.arrays", decode=False), packio.open_dataset(tmp_path / "t.wds")
    for i in range(14):
        assert t.sample(i).encoding == "png"
        np.testing.assert_array_equal(t[i]["image"].permute(1, 2, 0).numpy(), a.sample(i).payload)


def test_empty_source_exits_2_naming_the_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "gif").mkdir()
    (tmp_path / "gif" / "x.gif").write_bytes(b"GIF89a" + b"\x00" * 40)
    for folder, needle in (("empty", "no image files found"), ("gif", "none of its 1 inputs could be packed")):
        r = cli("convert", str(tmp_path / folder), str(tmp_path / f"{folder}.lmdb"), "--quiet")
        err = [x for x in r.stderr.splitlines() if x.startswith("packio: error:")]
        assert r.returncode == 2 and len(err) == 1 and str(tmp_path / folder) in err[0] and needle in err[0], r.stderr
        assert not (tmp_path / f"{folder}.lmdb").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "gif"]  # no temporary left either


@pytest.mark.parametrize("args,needle", [
    (["--short-side", "0"], "from 1 to 16384"), (["--short-side", "x"], "from 1 to 16384"),
    (["--size", "0x5"], "each side an integer from 1 to 16384"), (["--crop", "224x-1"], "from 1 to 16384"),
    (["--quality", "101"], "from 1 to 100"), (["--workers", "-1"], "'auto' or an integer from 0 to 1024"),
    (["--shards", "0"], "from 1 to"), (["--shard-samples", "0"], "from 1 to"), (["--parts", "0"], "from 1 to"),
    (["--shard-bytes", "12"], "from 1M"), (["--scheduler", "notaurl"], "tcp://host:8786"),
    (["--encode", "gif"], "invalid choice"),
])
def test_invalid_numbers_exit_2_with_the_range(gen_folder, tmp_path, capsys, args, needle):
    from packio.cli import main

    src, _ = gen_folder
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(src), str(tmp_path / "o.lmdb"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("packio: error:") and needle in err[0], err
    assert not (tmp_path / "o.lmdb").exists()


def test_api_checks_the_same_numbers(gen_folder, tmp_path):
    src, _ = gen_folder
    for kw in ({"workers": -1}, {"quality": 0}, {"shards": 0}, {"encode": "gif"}, {"shards": 2, "shard_samples": 3}):
        with pytest.raises(packio.PackioError):
            packio.convert(src, tmp_path / "o.lmdb", progress=False, **kw)
    with pytest.raises(ValueError):
        packio.ResizeSpec(short_side=0)
    with pytest.raises(packio.PackioError, match="Dask scheduler"):
        packio.convert(src, tmp_path / "o.lmdb", scheduler="notaurl", progress=False)


def test_shard_plan_and_auto_workers(gen_folder, tmp_path):
    assert plan_shards(397) >= 8 and plan_shards(64) == 8 and plan_shards(20) == 2 and plan_shards(5) == 1
    assert plan_shards(100, 3) == 3 and plan_shards(2, 8) == 2
    src, _ = gen_folder
    s = packio.convert(src, tmp_path / "t.wds", shards=3, progress=False)  # 14 samples, even split
    m = packio.open_reader(tmp_path / "t.wds").manifest
    index = np.load(tmp_path / "t.wds" / "index.npy")
    assert m.extra["shards"] == [f"shard-{i:06d}.tar" for i in range(3)]
    assert np.bincount(index[:, 0]).tolist() == [4, 5, 5]
    assert s.info["workers"].startswith("auto → 0")  # 14 tiny inputs: never worth a pool
    # small files never go to processes however many; slow ones do, given idle CPUs
    assert auto_workers(0.0004, 1_000_000, free_cpus=64) == 0
    assert auto_workers(0.05, 1000, free_cpus=1.2) == 0 and auto_workers(0.05, 1000, free_cpus=4.5) == 4


def test_example_refuses_unlabeled_data(tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(3):
        (flat / f"r{i}.jpg").write_bytes(jpeg(40, 50, seed=i))
    (tmp_path / "b.csv").write_text("filename,class,xmin,ymin,xmax,ymax\n" + "".join(
        f"r{i}.jpg,raccoon,1,2,30,40\n" for i in range(3)))
    packio.convert(flat, tmp_path / "r.lmdb", csv=tmp_path / "b.csv", progress=False)
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "examples" / "train_classifier.py"), str(tmp_path / "r.lmdb"),
                        "--steps", "2", "--device", "cpu", "--workers", "0", "--size", "16"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "has an image label" in r.stderr and "loss=" not in r.stdout, (r.stdout, r.stderr)


def test_enlarging_resize_and_unlabelled_folder_are_said(tmp_path):
    """128-px photos packed with ``--short-side 256`` are enlarged (4 x the pixels, a far larger
    dataset): the summary warns, naming the option, and so does ``--quiet``, which otherwise
    prints one line (it printed the whole summary). A flat folder packed without ``--csv`` has
    no labels: the summary says how to give them."""
    from packio.pack.prepare import ENLARGED

    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(3):
        (flat / f"p{i}.jpg").write_bytes(jpeg(128, 160 + 200 * (i == 2), seed=i))
    (flat / "big.jpg").write_bytes(jpeg(300, 400, seed=9))  # shrunk, not enlarged
    s = packio.convert(flat, tmp_path / "s.bmpdir", resize=packio.ResizeSpec(short_side=256), progress=False)
    assert s.info["notes"] == {ENLARGED: 3}
    warning = "warning:  3 of 4 images are smaller than --short-side 256 asks and were enlarged"
    hint = "hint:     no image has a label"
    assert warning in s.text() and hint in s.text() and "--csv FILE" in s.text(), s.text()
    r = cli("convert", str(flat), str(tmp_path / "q.bmpdir"), "--short-side", "256", "--quiet")
    assert r.returncode == 0 and r.stdout.splitlines() == [
        f"packed 4 samples into {tmp_path / 'q.bmpdir'} (bmp, {s.bytes / 1e6:.1f} MB) in "
        f"{r.stdout.split(' in ')[-1].split(' s,')[0]} s, skipped 0"], r.stdout
    assert "packio: warning: 3 of 4 images" in r.stderr and "packio: hint: no image has a label" in r.stderr
    small = packio.convert(flat, tmp_path / "t.lmdb", resize=packio.ResizeSpec(short_side=64), progress=False)
    labelled = packio.convert(tmp_path / "s.bmpdir", tmp_path / "u.lmdb", progress=False)  # a packed source
    assert not small.info["notes"] and "warning" not in small.text() and "hint" not in labelled.text()
