"""Issue 23: states, manifests, descriptors, opens and the doctor against strangers' files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import packio
from conftest import jpeg, sealed
from packio.errors import FormatError, PackioError


def _folder(root: Path, n: int = 8, classes: tuple[str, ...] = ("a", "b")) -> Path:
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for k in range(n // len(classes)):
            (root / c / f"{c}{k}.jpg").write_bytes(jpeg(32, 40, seed=k + 100 * len(c) + ord(c[0])))
    return root


def _pack(tmp_path: Path, name: str = "d.lmdb", **kw) -> Path:
    src = _folder(tmp_path / "src")
    return Path(packio.convert(src, tmp_path / name, progress=False, **kw).output)


def test_edited_manifest_is_refused_on_open(tmp_path):
    path = _pack(tmp_path)
    m = json.loads((path / "packio.json").read_text())
    m["classes"].reverse()  # relabels every image
    (path / "packio.json").write_text(json.dumps(m, indent=1))
    with pytest.raises(FormatError, match="no longer matches its digest"):
        packio.open_dataset(path)
    with packio.trust_manifest():  # the documented escape
        assert packio.open_dataset(path).classes == ["b", "a"]
    assert not packio.verify(path).ok  # verify still opens it and reports
    m.pop("digest")
    (path / "packio.json").write_text(json.dumps(m, indent=1))
    with pytest.raises(FormatError, match="no content digest"):
        packio.open_dataset(path)


def test_manifest_image_shape_not_a_list(tmp_path):
    path = _pack(tmp_path)
    m = json.loads((path / "packio.json").read_text())
    for bad in (5, [5], [32, 32, 4], [32, "x", 3], [0, 32, 3]):
        m["image"]["shape"] = bad
        (path / "packio.json").write_text(json.dumps(sealed(m)))
        with pytest.raises(FormatError, match="image.shape"):
            packio.open_dataset(path)[0]


def test_fifo_in_place_of_manifest_does_not_block(tmp_path):
    path = _pack(tmp_path)
    code = f"""
import os, packio
ds = packio.open_dataset({str(path)!r})
os.unlink({str(path / "packio.json")!r})
os.mkfifo({str(path / "packio.json")!r})
try:
    ds[0]
except packio.FormatError as exc:
    print("ERR", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)  # blocked: hangs
    assert "ERR" in out.stdout, out.stderr[-2000:]  # refused at once (replaced, not a regular file)


def test_emfile_is_not_called_a_foreign_dataset(tmp_path):
    path = _pack(tmp_path)
    code = f"""
import os, resource, packio, packio.read.datasets, packio.formats, packio.remote
packio.open_dataset({str(path)!r})  # every module loaded
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
keep = []
try:
    while True:
        keep.append(os.open('/dev/null', os.O_RDONLY))
except OSError:
    pass
try:
    packio.open_dataset({str(path)!r})
except packio.PackioError as exc:
    print("ERR", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ERR" in out.stdout, out.stderr[-2000:]
    assert "packed by packio" not in out.stdout and "open files" in out.stdout, out.stdout


def test_lock_file_planted_as_symlink_is_not_followed(tmp_path):
    src = _folder(tmp_path / "src")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / ".d.lmdb.packio-lock").symlink_to(target / "planted")
    with pytest.raises(PackioError, match="lock file"):
        packio.convert(src, tmp_path / "d.lmdb", progress=False)
    assert not (target / "planted").exists()  # nothing created where the link points
    assert not (tmp_path / "d.lmdb").exists()


def _many(root: Path, n: int) -> Path:
    (root / "x").mkdir(parents=True)
    for k in range(n):
        (root / "x" / f"{k:03d}.jpg").write_bytes(jpeg(8, 8, seed=k))
    return root


def test_state_from_another_packing_is_refused(tmp_path):
    src = _many(tmp_path / "src", 48)
    four = packio.convert(src, tmp_path / "four.wds", shard_samples=12, progress=False).output
    twelve = packio.convert(src, tmp_path / "twelve.wds", shard_samples=4, progress=False).output
    a = packio.open_dataset(four, iterable=True, decode=False, shuffle=True, seed=3, batch_size=4)
    it = iter(packio.DataLoader(a, batch_size=4))
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(packio.DataLoader(a, batch_size=4).state_dict()))
    b = packio.open_dataset(twelve, iterable=True, decode=False, shuffle=True, seed=3, batch_size=4)
    with pytest.raises(packio.StateError, match="dataset|units"):
        b.load_state_dict(state)
    same = packio.open_dataset(four, iterable=True, decode=False, shuffle=True, seed=3, batch_size=4)
    same.load_state_dict(state)  # the same dataset resumes
    assert same.state_dict()["units"] == state["units"] and state["units"].startswith("4:")
    for change in ({"dataset": "0" * 32}, {"units": "4:0"}, {"dataset": None}):
        with pytest.raises(packio.StateError):
            same.load_state_dict({**state, **change})


@pytest.mark.parametrize("done", [-3, 10**6, 2.5, None])
def test_worker_state_done_is_checked(tmp_path, monkeypatch, done):
    """torchdata's per-worker state (what StatefulDataLoader hands each worker back),
    loaded and iterated as worker 0 of 2 would."""
    import types

    import packio.read.datasets as pd

    path = packio.convert(_many(tmp_path / "src", 64), tmp_path / "d.lmdb", progress=False).output
    ds = packio.open_dataset(path, iterable=True, decode=False, shuffle=True, seed=1, batch_size=4)
    monkeypatch.setattr(pd, "get_worker_info", lambda: types.SimpleNamespace(id=0, num_workers=2))
    good = {**ds.state_dict(), "packio_worker_state": 1, "rank": 0, "worker": 0, "num_workers": 2, "chunk": 4,
            "done": 8}
    ds.load_state_dict(good)
    assert len(list(ds)) == 32 - 8  # the worker's share (32) less what it had done
    ds.load_state_dict({**good, "done": done})
    with pytest.raises(packio.StateError, match="done"):
        list(ds)


def test_huge_epochs_are_state_errors(tmp_path):
    path = _pack(tmp_path)
    it = packio.open_dataset(path, iterable=True, decode=False)
    s = packio.ResumableSampler(8)
    for target in (it, s):
        with pytest.raises(packio.StateError, match="2\\*\\*63"):
            target.set_epoch(2**63)
        with pytest.raises(packio.StateError, match="2\\*\\*63"):
            target.load_state_dict({**target.state_dict(), "epoch": 2**63})
        target.set_epoch(2**63 - 1)
        assert target.epoch == 2**63 - 1
        assert len(list(iter(target))) == 8


@pytest.mark.parametrize("args, says", [
    (["--seconds", "nan"], "--seconds"), (["--seconds", "inf"], "--seconds"), (["--size", "20000"], "--size"),
    (["--batch-size", "100000"], "--batch-size"), (["--sample", "nan"], "--sample"), (["--sample", "2"], "--sample"),
    (["--cpus", "0"], "--cpus"), (["--step-ms", "-1"], "--step-ms")])
def test_doctor_options_are_range_checked(tmp_path, capsys, args, says):
    from packio import cli

    src = _folder(tmp_path / "src")
    with pytest.raises(SystemExit) as exc:
        cli.main(["doctor", str(src), "--quiet", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and says in err and "Traceback" not in err, err


@pytest.mark.parametrize("opts", [{"seconds": float("nan")}, {"size": 20000}, {"batch_size": 100000},
                                  {"fraction": float("nan")}, {"batch_size": 4096, "size": 4096}])
def test_doctor_library_checks_ranges(tmp_path, opts):
    from packio.doctor.offline import diagnose

    with pytest.raises(PackioError, match="doctor: "):
        diagnose(_folder(tmp_path / "src"), **opts)


def test_doctor_counts_one_damaged_record_and_goes_on(tmp_path):
    from packio.doctor.offline import diagnose

    path = packio.convert(_many(tmp_path / "src", 300), tmp_path / "d.wds", progress=False).output
    index = np.load(Path(path) / "index.npy")
    # the record the doctor samples first (its order is a seeded permutation): found however
    # little a busy machine lets it sample in its seconds (#150 was missed under two test processes)
    first = int(np.random.default_rng(0).permutation(300)[0])
    shard, off, size = (int(v) for v in index[first, [0, 3, 4]])
    name = json.loads((Path(path) / "packio.json").read_text())["extra"]["shards"][shard]
    with open(Path(path) / name, "r+b") as f:
        f.seek(off)
        f.write(b"\xff" * size)  # one damaged record among 300
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "cgroup.controllers").write_text("cpu")
    (cg / "cpu.max").write_text("100000 100000")
    d = diagnose(path, size=32, batch_size=8, seconds=6, fraction=1.0, min_samples=300, max_samples=300, seed=0,
                 cgroup_root=cg, work=tmp_path)
    assert d.stages.skipped >= 1 and any("did not decode" in n for n in d.notes), d.notes
    assert d.candidates and not [c.error for c in d.candidates if c.error]


def test_resize_spec_is_validated_and_normalised(tmp_path):
    spec = packio.ResizeSpec(size=[32, 32])
    assert spec.size == (32, 32) and spec == packio.ResizeSpec(size=(32, 32))
    for bad in ({"size": (32,)}, {"size": (32, 32, 3)}, {"short_side": True}, {"crop": [8, 0]}, {"size": "32"},
                {"short_side": 2.5}):
        with pytest.raises(ValueError, match="ResizeSpec"):
            packio.ResizeSpec(**bad)
    s = packio.convert(_folder(tmp_path / "src"), tmp_path / "d.arrays", resize=spec, progress=False)
    assert s.packed == 8  # none skipped as "shape differs"


def test_source_replaced_while_converting_aborts(tmp_path, monkeypatch):
    from packio import cli
    from packio.formats.tar import TarReader as LMDBReader

    src = packio.convert(_many(tmp_path / "imgs", 160), tmp_path / "src.wds", shard_samples=8, progress=False).output
    real, calls = LMDBReader.read, []

    def read(self, i):
        calls.append(i)
        if len(calls) == 20:  # another job re-packs the source under us
            packio.convert(tmp_path / "imgs", src, overwrite=True, shard_samples=8, progress=False)
        return real(self, i)

    monkeypatch.setattr(LMDBReader, "read", read)
    code = cli.main(["convert", src, str(tmp_path / "out.lmdb"), "--quiet", "--workers", "0"])
    assert code == 2 and not (tmp_path / "out.lmdb").exists(), len(calls)


def test_idle_iterable_datasets_hold_no_descriptor(tmp_path):
    """1,100 iterable datasets built and left idle under a 1,024-descriptor limit."""
    path = _pack(tmp_path)
    code = f"""
import resource, packio
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
keep = [packio.open_dataset({str(path)!r}, iterable=True, decode=False) for _ in range(1100)]
keep[-1].set_epoch(3)
assert keep[-1].epoch == 3 and keep[0].epoch == 0
print("OK", sum(len(list(d)) for d in keep[:3]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "OK 24" in out.stdout, out.stderr[-2000:]


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    import io
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_foreign_tar_duplicate_key_is_refused(tmp_path):
    _tar(tmp_path / "s" / "a.tar", [("x.jpg", jpeg(8, 8, 1)), ("x.cls", b"0"), ("y.jpg", jpeg(8, 8, 2)),
                                     ("x.jpg", jpeg(8, 8, 3))])
    with pytest.raises(FormatError, match="duplicate key"):
        packio.open_dataset(tmp_path / "s")


def test_foreign_tar_json_with_ordinary_metadata(tmp_path):
    metas = [{"label": "cat"}, {"boxes": [[1.0, 2.0, 6.0, 7.0]]}, {"caption": "a photo", "label": 1},
             {"boxes": [[1.0, 2.0, 6.0, 7.0]], "box_labels": [0]}]
    members = []
    for k, meta in enumerate(metas):
        members += [(f"s{k}.jpg", jpeg(8, 8, k)), (f"s{k}.json", json.dumps(meta).encode())]
    _tar(tmp_path / "s" / "a.tar", members)
    ds = packio.open_dataset(tmp_path / "s")
    items = [ds[i] for i in range(4)]
    assert [it["label"] for it in items] == [-1, -1, 1, -1]
    assert [len(it["boxes"]) for it in items] == [0, 1, 0, 1]
    assert items[1]["box_labels"].tolist() == [-1] and items[3]["box_labels"].tolist() == [0]


def test_thousands_of_shards_under_a_descriptor_limit(tmp_path):
    src = _many(tmp_path / "src", 1200)
    path = packio.convert(src, tmp_path / "d.wds", shard_samples=1, progress=False).output
    code = f"""
import resource, packio
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
ds = packio.open_dataset({str(path)!r}, decode=False)
n = sum(1 for i in range(len(ds)) if ds[i] is not None)
it = packio.open_dataset({str(path)!r}, iterable=True, decode=False, shuffle=True)
print("OK", n, sum(1 for _ in it))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "OK 1200 1200" in out.stdout, out.stderr[-2000:]


def test_simplejpeg_backend_reads_png_and_webp_samples(tmp_path):
    import cv2

    from conftest import photo

    src = _folder(tmp_path / "src")
    for k, ext in enumerate((".png", ".webp")):
        ok, data = cv2.imencode(ext, photo(20, 24, k))
        (src / "a" / f"other{k}{ext}").write_bytes(data.tobytes())
    path = packio.convert(src, tmp_path / "d.lmdb", progress=False).output
    ds = packio.open_dataset(path, backend="simplejpeg", on_error="skip")
    items = [ds[i] for i in range(len(ds))]
    assert len(items) == 10 and all(it is not None for it in items)
    assert sorted(tuple(it["image"].shape) for it in items if it["key"].startswith("a/other")) == [(3, 20, 24)] * 2


def test_paths_over_path_max_are_each_counted(tmp_path):
    src = _folder(tmp_path / "src", n=20, classes=("a",))
    fd = os.open(src / "a", os.O_RDONLY)
    try:
        for level in range(18):  # 18 x 250 bytes: past PATH_MAX (4096)
            name = f"{level:02d}" + "d" * 248
            os.mkdir(name, dir_fd=fd)
            nxt = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        for k in range(10):
            w = os.open(f"deep{k}.jpg", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
            os.write(w, jpeg(8, 8, k))
            os.close(w)
    finally:
        os.close(fd)
    s = packio.convert(src, tmp_path / "d.lmdb", progress=False)
    too_long = sum(n for reason, n in s.skipped.items() if "path longer" in reason)
    assert s.packed == 20 and too_long == 10, s.text()


@pytest.mark.parametrize("name", ["x" * 300, "x" * 300 + ".lmdb", "x" * 300 + "-{0..3}.tar", "x" * 300 + "/y.h5"])
def test_a_name_over_the_file_name_limit_is_a_packio_error(tmp_path, name, capsys):
    """Attack review: a path whose part is longer than the file-name limit (255 bytes)
    raised a raw OSError (ENAMETOOLONG) from open, convert and the CLI."""
    path = str(tmp_path / name)
    with pytest.raises(packio.PackioError, match="cannot be"):
        packio.open_dataset(path)
    with pytest.raises(packio.PackioError, match="cannot be"):
        packio.convert(path, tmp_path / "out.lmdb", progress=False)
    from packio.cli import main

    assert main(["info", path]) != 0
    assert "Traceback" not in capsys.readouterr().err
