"""Nothing lost: the output never touches the source, one conversion at a time per
output, --overwrite swaps only a packio dataset, signals clean up, and readers notice
that the dataset they hold was replaced."""

from __future__ import annotations

import functools
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

import packio
from conftest import jpeg, relabelled
from packio.errors import DatasetReplacedError, OutputBusyError, OutputExistsError, PackioError
from packio.formats import formats
from packio.sample import checksum

SUFFIX = {name: spec.suffixes[0] for name, spec in formats().items()}
RESIZE = {"arrays": packio.ResizeSpec(size=(48, 64)), "bmp": packio.ResizeSpec(short_side=40)}


def _tree(root: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if not p.is_symlink())


@pytest.fixture
def other_folder(tmp_path: Path) -> Path:
    """A second source: other classes, other pictures, another count than gen_folder."""
    root = tmp_path / "other"
    for c, cls in enumerate(("xa", "xb", "xc")):
        (root / cls).mkdir(parents=True)
        for k in range(3):
            (root / cls / f"o{k}.jpg").write_bytes(jpeg(50 + k, 70, seed=500 + 10 * c + k))
    return root


@pytest.mark.parametrize("case", ["same", "inside", "ancestor", "ancestor-via-symlink", "holds-csv"])
def test_output_related_to_source_is_refused(gen_folder, tmp_path, case):
    src, csv = gen_folder
    (tmp_path / "unrelated.txt").write_text("keep me")
    (tmp_path / "alias").symlink_to(tmp_path)
    dst = {"same": src, "inside": src / "out.lmdb", "ancestor": tmp_path,
           "ancestor-via-symlink": tmp_path / "alias", "holds-csv": csv.parent}[case]
    kwargs = {"format": "lmdb"} if case != "inside" else {}
    if case == "holds-csv":
        src = tmp_path / "elsewhere"
        src.mkdir()
        (src / "a.jpg").write_bytes(jpeg(30, 30, 1))
        dst = tmp_path / "ann"
        dst.mkdir()
        csv.rename(dst / "boxes.csv")
        csv = dst / "boxes.csv"
    before = _tree(tmp_path)
    needle = {"same": "are the same", "inside": "lies inside the source", "ancestor": "holds the source",
              "ancestor-via-symlink": "holds the source", "holds-csv": "holds the CSV"}[case]
    with pytest.raises(PackioError, match=needle):
        packio.convert(src, dst, csv=csv, overwrite=True, progress=False, **kwargs)
    assert _tree(tmp_path) == before  # the source, the CSV and unrelated files are untouched


def test_cli_refuses_output_holding_the_source(gen_folder, tmp_path):
    src, _ = gen_folder
    r = subprocess.run([sys.executable, "-m", "packio", "convert", str(src), str(tmp_path), "--format", "lmdb",
                        "--overwrite", "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "holds the source" in r.stderr and len(list(src.rglob("*.jpg"))) == 12


@pytest.mark.parametrize("kind", ["folder", "file", "foreign-hdf5", "broken-manifest"])
def test_overwrite_replaces_only_a_packio_dataset(gen_folder, tmp_path, kind):
    src, _ = gen_folder
    dst = tmp_path / ("out.h5" if kind in ("file", "foreign-hdf5") else "out.lmdb")
    if kind == "folder":
        dst.mkdir()
        (dst / "thesis.tex").write_text("years of work")
    elif kind == "file":
        dst.write_text("not a dataset")
    elif kind == "foreign-hdf5":
        with h5py.File(dst, "w") as f:
            f["data"] = np.arange(10)
    else:
        dst.mkdir()
        (dst / "packio.json").write_text("{not json")
        (dst / "notes.txt").write_text("keep")
    before = _tree(tmp_path)
    with pytest.raises(OutputExistsError, match="not a packio dataset"):
        packio.convert(src, dst, overwrite=True, progress=False)
    assert _tree(tmp_path) == before


WATCH = """
import os, sys
probe, stop = sys.argv[1], sys.argv[2]
open(stop + ".ready", "w").close()
looks = missing = 0
while not os.path.exists(stop):
    looks += 1
    missing += not os.path.exists(probe)
print(looks, missing)
"""


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_overwrite_swaps_atomically(gen_folder, other_folder, tmp_path, fmt):
    src, _ = gen_folder
    dst = tmp_path / f"out{SUFFIX[fmt]}"
    packio.convert(src, dst, progress=False)
    probe = dst / "packio.json" if dst.is_dir() else dst
    stop = tmp_path / "stop"
    watcher = subprocess.Popen([sys.executable, "-c", WATCH, str(probe), str(stop)], stdout=subprocess.PIPE, text=True)
    _wait_for(lambda: (tmp_path / "stop.ready").exists())
    try:
        s = packio.convert(other_folder, dst, overwrite=True, progress=False)
    finally:
        stop.touch()
        out, _ = watcher.communicate(timeout=60)
    looks, missing = map(int, out.split())
    assert looks > 0 and missing == 0  # the path named a complete dataset at every moment
    stop.unlink()
    (tmp_path / "stop.ready").unlink()
    assert s.packed == 9 and packio.verify(dst).ok
    assert packio.open_dataset(dst).classes == ["xa", "xb", "xc"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


SLOW = """
import sys, time, packio
from packio.formats import format_for_path
writer = format_for_path(sys.argv[2]).writer
add = writer.add
def slow_add(self, sample):
    time.sleep(float(sys.argv[3]))
    add(self, sample)
writer.add = slow_add
try:
    s = packio.convert(sys.argv[1], sys.argv[2], workers=int(sys.argv[4]), progress=False)
    print("packed", s.packed)
except packio.PackioError as exc:
    print("error:", exc)
    sys.exit(2)
"""


def _slow(src: Path, dst: Path, delay: float, workers: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SLOW, str(src), str(dst), str(delay), str(workers)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(cond, timeout: float = 60) -> None:
    end = time.time() + timeout
    while not cond():
        assert time.time() < end, "timed out"
        time.sleep(0.02)


def test_second_conversion_to_same_output_fails_clearly(gen_folder, other_folder, tmp_path):
    src, _ = gen_folder
    dst = tmp_path / "out.lmdb"
    first = _slow(src, dst, 0.15)
    try:
        _wait_for(lambda: any(p.name.startswith(".out.lmdb.packio-tmp-") for p in tmp_path.iterdir()))
        for overwrite in (False, True):
            with pytest.raises(OutputBusyError, match="another packio conversion is writing it"):
                packio.convert(other_folder, dst, overwrite=overwrite, progress=False)
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0 and "packed 14" in out, err
    r = packio.verify(dst)
    assert r.ok and r.count == 14
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # lock and temporaries gone


def test_output_appearing_during_conversion_is_not_replaced(gen_folder, tmp_path, monkeypatch):
    from packio.formats import lmdb as lmdb_fmt

    src, _ = gen_folder
    dst = tmp_path / "out.lmdb"
    close = lmdb_fmt.LMDBWriter.close

    def close_while_another_program_writes(self):  # someone else creates dst before our commit
        dst.mkdir()
        (dst / "theirs.txt").write_text("theirs")
        return close(self)

    monkeypatch.setattr(lmdb_fmt.LMDBWriter, "close", close_while_another_program_writes)
    with pytest.raises(OutputExistsError, match="appeared while converting"):
        packio.convert(src, dst, progress=False)
    assert sorted(p.name for p in dst.iterdir()) == ["theirs.txt"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("workers", [0, 2])
def test_sigterm_removes_the_temporary_output(gen_folder, tmp_path, workers):
    src, _ = gen_folder
    dst = tmp_path / "out.lmdb"
    proc = _slow(src, dst, 0.3, workers)
    try:
        _wait_for(lambda: any(p.name.startswith(".out.lmdb.packio-tmp-") for p in tmp_path.iterdir()))
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM  # still dies of the signal, after cleaning up
    assert not dst.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def _pack(src: Path, dst: Path, fmt: str, overwrite: bool = False) -> None:
    packio.convert(src, dst, resize=RESIZE.get(fmt), overwrite=overwrite, progress=False)


def _consistent(reader, i: int, keys: set[str]) -> bool:
    """A read from a reader whose dataset was replaced: a sample of its own dataset,
    intact, or DatasetReplacedError (returns False then)."""
    try:
        s = reader.read(i)
    except DatasetReplacedError:
        return False
    assert s.key in keys and checksum(s.payload) == s.checksum, f"#{i}: {s.key} mixed from two datasets"
    return True


@pytest.mark.parametrize("fmt", sorted(formats()))
def test_readers_notice_a_replaced_dataset(real_folder, other_folder, tmp_path, fmt):
    src = real_folder
    dst = tmp_path / f"out{SUFFIX[fmt]}"
    _pack(src, dst, fmt)
    old = packio.open_dataset(dst, decode=False)
    old_keys = {old.sample(i).key for i in range(len(old))}
    old.sample(0)  # handles open
    later = pickle.dumps(old.reader)  # e.g. a DataLoader worker that starts after the swap
    skipping = packio.open_dataset(dst, decode=False, on_error="skip")  # handles open on first read
    _pack(other_folder, dst, fmt, overwrite=True)

    new = packio.open_dataset(dst, decode=False)  # a fresh reader sees only the new dataset
    new_keys = {f"{c}/o{k}.jpg" for c in ("xa", "xb", "xc") for k in range(3)}
    assert len(new) == 9 and new.classes == ["xa", "xb", "xc"]
    for i in range(9):
        s = new.sample(i)
        assert s.key in new_keys and new.classes[s.label] == s.key.split("/")[0]
        assert checksum(s.payload) == s.checksum
    # the reader that was open: its own samples, intact, or a clear error — never a mix
    results = [_consistent(old.reader, i, old_keys) for i in range(len(old))]
    if fmt == "bmp":  # a file opened per read: the old ones are gone
        assert not any(results)
    with pytest.raises(DatasetReplacedError, match="open the dataset again"):
        pickle.loads(later).read(0)
    with pytest.raises(DatasetReplacedError):  # not a corrupt sample to skip: every sample would be
        skipping[0]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def _open_then_wait(ready: Any, go: Any, worker: int) -> None:
    """worker_init_fn: open the reader in this worker (sample 0: shard 0), then wait."""
    torch.utils.data.get_worker_info().dataset.reader.read(0)
    ready.release()
    go.wait(60)


def test_wds_repacked_under_two_workers_hands_out_no_new_sample(tmp_path):
    """Issue 37: a .wds re-packed with --overwrite (same images, same member sizes, other
    labels) while a 2-worker DataLoader streams it. Each worker opened the old version;
    the shards it opens afterwards are the new one's: the batches handed out are the old
    version's, then DatasetReplacedError; never a record of the new version."""
    n, src = 32, tmp_path / "images"
    dst = tmp_path / "ds.wds"
    packio.convert(src, dst, csv=relabelled(src, n, 0), shard_samples=8, progress=False, workers=0)
    old = packio.open_reader(dst)
    truth = [(s.key, s.label, s.checksum) for s in map(old.read, range(n))]
    fork = torch.multiprocessing.get_context("fork")
    ready, go = fork.Semaphore(0), fork.Event()
    ds = packio.open_dataset(dst, iterable=True, decode=False)
    loader = packio.DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=fork,
                               worker_init_fn=functools.partial(_open_then_wait, ready, go))
    batches, got = iter(loader), []

    def take() -> None:  # the loader's workers start with its first batch
        try:
            for batch in batches:
                got.extend(zip(batch["index"].tolist(), batch["key"], batch["label"].tolist(),
                               map(checksum, batch["image"])))
        except Exception as exc:  # noqa: BLE001 - asserted on below
            got.append(exc)

    taker = threading.Thread(target=take)
    taker.start()
    assert ready.acquire(timeout=60) and ready.acquire(timeout=60)  # both workers hold the old version
    packio.convert(src, dst, csv=relabelled(src, n, 1), shard_samples=8, overwrite=True, progress=False, workers=0)
    go.set()
    taker.join(120)
    assert got and isinstance(got[-1], DatasetReplacedError), got[-1:]
    assert all((key, label, digest) == truth[i] for i, key, label, digest in got[:-1]), got
