"""A dataset is a closed world: no read reaches outside its folder (symlinks, manifest
paths, HDF5 external storage / links / virtual layouts), and packing follows symlinks
only inside the source unless asked, counting everything it leaves out."""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest

import packio
from conftest import jpeg, sealed
from packio.errors import FormatError, PackioError
from packio.formats import formats

SUFFIX = {name: spec.suffixes[0] for name, spec in formats().items()}
RESIZE = {"arrays": packio.ResizeSpec(size=(48, 64)), "bmp": packio.ResizeSpec(short_side=40)}
SECRET = b"root:x:0:0:SECRET-TOKEN-" + bytes(range(256)) * 64  # stands in for /etc/passwd


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    p = tmp_path / "secret.txt"
    p.write_bytes(SECRET)
    return p


def _pack(gen_folder, tmp_path: Path, fmt: str) -> Path:
    src, csv = gen_folder
    return Path(packio.convert(src, tmp_path / f"ds{SUFFIX[fmt]}", csv=csv, resize=RESIZE.get(fmt),
                               progress=False).output)


def _leaks(path: Path) -> bool:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return any(b"SECRET-TOKEN" in p.read_bytes() for p in files)


def _refused_everywhere(path: Path, tmp_path: Path) -> None:
    """Reading, converting and verifying all refuse; nothing of the secret gets out."""
    with pytest.raises(FormatError, match="outside the dataset|can read other files"):
        ds = packio.open_dataset(path, decode=False)
        for i in range(len(ds)):
            ds.sample(i)
    out = tmp_path / "copy.wds"
    try:
        packio.convert(path, out, progress=False)
    except PackioError:
        pass
    assert not out.exists() or not _leaks(out)
    report = packio.verify(path)
    assert not report.ok and "SECRET-TOKEN" not in report.text()


def _hdf5_with(path: Path, name: str, kind: str, secret: Path, tmp_path: Path) -> None:
    """Replace dataset ``name`` of a packed HDF5 file by one that reads ``secret``."""
    with h5py.File(path, "r+") as f:
        old = f[name]
        shape, dtype = old.shape, old.dtype
        del f[name]
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if kind == "external":
            f.create_dataset(name, shape=shape, dtype=dtype, external=[(str(secret), 0, nbytes)])
            return
        other = tmp_path / "other.h5"
        with h5py.File(other, "w") as g:
            raw = np.frombuffer((SECRET * (nbytes // len(SECRET) + 1))[:nbytes], dtype)
            g.create_dataset("data", data=raw.reshape(shape))
        if kind == "external-link":
            f[name] = h5py.ExternalLink(str(other), "/data")
        else:
            layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
            layout[...] = h5py.VirtualSource(str(other), "data", shape=shape)
            f.create_virtual_dataset(name, layout)


@pytest.mark.parametrize("kind", ["external", "external-link", "virtual"])
@pytest.mark.parametrize("name", ["images_bytes", "records"])
def test_hdf5_reading_other_files_is_refused(gen_folder, tmp_path, secret, kind, name):
    path = _pack(gen_folder, tmp_path, "hdf5")
    _hdf5_with(path, name, kind, secret, tmp_path)
    with h5py.File(path, "r") as f:  # the crafted file does reach the secret through plain h5py
        assert b"SECRET-TOKEN" in f[name][:4096].tobytes() or b"SECRET-TOKEN" in f[name][:].tobytes()
    _refused_everywhere(path, tmp_path)


def test_hdf5_labels_as_external_link_refused_by_batch_reader(tmp_path, gen_folder, secret):
    src, _ = gen_folder
    path = Path(packio.convert(src, tmp_path / "fixed.h5", resize=packio.ResizeSpec(size=(32, 32)),
                               progress=False).output)
    _hdf5_with(path, "labels", "external-link", secret, tmp_path)
    with pytest.raises(FormatError, match="can read other files"):
        packio.open_dataset(path).reader.read_batch([0, 1])


@pytest.mark.parametrize("fmt,target", [
    ("bmp", "images/000000/0000000003.bmp"), ("bmp", "images/000000"), ("bmp", "records.bin"),
    ("arrays", "images.npy"), ("arrays", "labels.npy"), ("arrays", "records.idx.npy"),
    ("lmdb", "data.mdb"), ("tar", "shard-000000.tar"), ("tar", "index.npy"), ("tar", "packio.json"),
])
def test_symlink_out_of_the_dataset_is_refused(gen_folder, tmp_path, fmt, target):
    path = _pack(gen_folder, tmp_path, fmt)
    victim = path / target
    outside = tmp_path / "outside" / victim.name
    outside.parent.mkdir()
    os.rename(victim, outside)  # the same bytes, now outside: only the location is wrong
    victim.symlink_to(outside, target_is_directory=outside.is_dir())
    with pytest.raises(FormatError, match="outside the dataset"):
        ds = packio.open_dataset(path, decode=False)
        for i in range(len(ds)):
            ds.sample(i)
        if fmt == "arrays":
            ds.reader.read_batch([0, 1])
    try:
        report = packio.verify(path)
    except FormatError as exc:  # the manifest itself (or a file open_reader needs) lies outside
        assert "outside the dataset" in str(exc)
    else:
        assert not report.ok and "outside the dataset" in report.text()


def test_symlink_inside_the_dataset_is_followed(gen_folder, tmp_path):
    path = _pack(gen_folder, tmp_path, "bmp")
    a, b = path / "images/000000/0000000003.bmp", path / "images/000000/0000000004.bmp"
    keep = tmp_path / "kept.bmp"
    os.rename(a, keep)
    a.symlink_to(b)  # resolves inside: read (and found damaged by its checksum)
    ds = packio.open_dataset(path, decode=False, verify=True)
    with pytest.raises(packio.CorruptSampleError, match="checksum mismatch"):
        ds[3]
    a.unlink()
    (path / "images/000000/moved.bmp").write_bytes(keep.read_bytes())
    a.symlink_to("moved.bmp")
    assert packio.open_dataset(path, decode=False, verify=True)[3]["key"]  # a link inside, to the right bytes


def test_manifest_paths_outside_are_refused(gen_folder, tmp_path, secret, monkeypatch):
    import packio.verifier as verifier

    path = _pack(gen_folder, tmp_path, "tar")
    m = json.loads((path / "packio.json").read_text())
    m["files"]["../secret.txt"] = {"bytes": len(SECRET), "xxh3_128": "0"}
    m["files"][str(secret)] = {"bytes": len(SECRET), "xxh3_128": "0"}
    (path / "packio.json").write_text(json.dumps(sealed(m)))
    hashed: list[Path] = []
    real = verifier.file_digest
    monkeypatch.setattr(verifier, "file_digest", lambda p, *a: hashed.append(Path(p).resolve()) or real(p, *a))
    report = packio.verify(path)
    assert not report.ok and sum("outside the dataset" in b for b in report.bad_files) == 2
    assert hashed and all(path.resolve() in p.parents for p in hashed)
    for shard in ("../secret.txt", str(secret), "sub/../../secret.txt"):
        m["extra"]["shards"] = [shard]
        (path / "packio.json").write_text(json.dumps(sealed(m)))
        with pytest.raises(FormatError, match="outside the dataset"):
            packio.open_dataset(path)


# ---- packing: symlinks in the source -------------------------------------------------


@pytest.fixture
def linked_source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "real").mkdir(parents=True)
    (src / "real" / "a.jpg").write_bytes(jpeg(30, 40, 1))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "b.jpg").write_bytes(jpeg(30, 40, 2))
    (src / "real" / "in_link.jpg").symlink_to(src / "real" / "a.jpg")  # file link, inside
    (src / "real" / "out_link.jpg").symlink_to(elsewhere / "b.jpg")  # file link, outside
    (src / "dir_in").symlink_to(src / "real", target_is_directory=True)  # folder link, inside
    (src / "dir_out").symlink_to(elsewhere, target_is_directory=True)  # folder link, outside
    (src / "real" / "loop").symlink_to(src, target_is_directory=True)  # folder link to an ancestor
    (src / ".hidden.jpg").write_bytes(jpeg(30, 40, 3))
    return src


def test_source_symlinks_followed_only_inside(linked_source, tmp_path):
    s = packio.convert(linked_source, tmp_path / "o.lmdb", progress=False)
    keys = {packio.open_dataset(tmp_path / "o.lmdb").sample(i).key for i in range(s.packed)}
    assert keys == {"real/a.jpg", "real/in_link.jpg"}
    assert dict(s.skipped) == {
        "symlink to outside the source (--follow-symlinks packs it)": 2,  # out_link.jpg, dir_out
        "symlinked folder inside the source (packed under its own path; --follow-symlinks packs it twice)": 2,
        "hidden file or folder (name starts with '.')": 1,
    }
    assert any("out_link.jpg" in p for p in s.problems) and any("dir_out" in p for p in s.problems)


def test_follow_symlinks_packs_every_path_and_ends_loops(linked_source, tmp_path):
    s = packio.convert(linked_source, tmp_path / "o.lmdb", follow_symlinks=True, progress=False)
    ds = packio.open_dataset(tmp_path / "o.lmdb")
    keys = {ds.sample(i).key for i in range(s.packed)}
    real = {"a.jpg", "in_link.jpg", "out_link.jpg"}
    assert keys == {f"real/{k}" for k in real} | {f"dir_in/{k}" for k in real} | {"dir_out/b.jpg"}
    assert dict(s.skipped) == {"symlink loop (a folder inside itself)": 2,  # real/loop, dir_in/loop
                               "hidden file or folder (name starts with '.')": 1}


def test_cli_follow_symlinks(linked_source, tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "packio", "convert", str(linked_source), str(tmp_path / "o.wds"),
                        "--follow-symlinks", "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "packed 7 samples" in r.stdout, r.stderr
