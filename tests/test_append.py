"""convert(..., append=True): a dataset grown by parts; old readers, classes, keys, kills, the lock, states."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import cv2
import numpy as np
import pytest

import packio
from packio.decode import decode
from packio.errors import OutputBusyError, PackioError, StateError
from packio.pack.commit import output_lock

from conftest import photo

FORK = multiprocessing.get_context("fork")


def make(root: Path, classes: list[str], n: int, tag: str) -> Path:
    """Class folders of PNGs named ``{tag}{i}.png`` (lossless: pixels compare exactly)."""
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            img = photo(12 + i, 16, seed=hash((tag, c, i)) % 2**31)
            cv2.imwrite(str(root / name / f"{tag}{i}.png"), img[:, :, ::-1])
    return root


def contents(path: Path) -> list[tuple[str, str]]:
    """(key, class name) of every sample, in order."""
    r = packio.open_reader(path)
    names = r.manifest.classes
    return [(s.key, names[s.label]) for s in map(r.read, range(len(r)))]


def _read_keys(reader, out) -> None:  # in a forked child: the reader opens its files there
    try:
        out.put([reader.read(i).key for i in range(len(reader))])
    except Exception as exc:  # noqa: BLE001 - the parent asserts on it
        out.put(repr(exc))


def keys_in_child(reader) -> list[str] | str:
    q = FORK.Queue()
    p = FORK.Process(target=_read_keys, args=(reader, q))
    p.start()
    got = q.get(timeout=30)
    p.join(10)
    return got


@pytest.mark.parametrize("suffix", [".wds", ".lmdb", ".bmpdir"])
def test_three_appends_with_new_classes(tmp_path: Path, suffix: str) -> None:
    batches = [(["cat", "dog"], "a"), (["dog", "emu"], "b"), (["ant", "cat"], "c"), (["bee", "fox"], "d")]
    srcs = [make(tmp_path / tag, classes, 3, tag) for classes, tag in batches]
    ds = tmp_path / f"ds{suffix}"
    packio.convert(srcs[0], ds, progress=False, workers=0)
    for k, src in enumerate(srcs[1:], 1):
        before = packio.open_reader(ds).manifest.classes
        s = packio.convert(src, ds, append=True, progress=False, workers=0)
        assert s.packed == 6
        m = packio.open_reader(ds).manifest
        assert m.classes[:len(before)] == before  # old ids never change
        assert [p["count"] for p in m.extra["parts"]] == [6] * (k + 1)
        assert packio.verify(ds).ok, packio.verify(ds).text()
    assert packio.open_reader(ds).manifest.classes == ["cat", "dog", "emu", "ant", "bee", "fox"]
    got = contents(ds)
    keys = Counter(k for k, _ in got)
    want = {f"{c}/{tag}{i}.png" for classes, tag in batches for c in classes for i in range(3)}
    assert set(keys) == want and set(keys.values()) == {1}  # every sample exactly once
    assert all(key.split("/")[0] == name for key, name in got)  # labels name the right class
    r = packio.open_reader(ds)
    for i in range(len(r)):
        s = r.read(i)
        src = next(p for p in srcs if (p / s.key).exists()) / s.key
        pixels = s.payload if isinstance(s.payload, np.ndarray) else decode(s.payload)
        assert np.array_equal(pixels, cv2.imread(str(src))[:, :, ::-1])


def test_reader_opened_before_keeps_its_version(tmp_path: Path) -> None:
    a, b, c = (make(tmp_path / t, ["x", "y"], 4, t) for t in "abc")
    ds = tmp_path / "ds.wds"
    packio.convert(a, ds, progress=False, workers=0, shards=2)
    single = packio.open_reader(ds)  # a single-part dataset's reader
    old_keys = [single.read(i).key for i in range(len(single))]
    packio.convert(b, ds, append=True, progress=False, workers=0)
    multi = packio.open_reader(ds)  # a multi-part one's, before the next append
    mid_keys = [multi.read(i).key for i in range(len(multi))]
    packio.convert(c, ds, append=True, progress=False, workers=0)
    assert keys_in_child(single) == old_keys  # opens its files afresh in the child: still its version
    assert keys_in_child(multi) == mid_keys
    assert len(packio.open_reader(ds)) == 24
    loader = packio.DataLoader(packio.open_dataset(ds), batch_size=5, num_workers=2)
    assert sorted(k for b in loader for k in b["key"]) == sorted(k for k, _ in contents(ds))
    packio.convert(c, ds, overwrite=True, progress=False, workers=0)  # a replacement still is one
    assert "DatasetReplacedError" in keys_in_child(multi)


def test_settings_and_names_checked(tmp_path: Path) -> None:
    a, b = make(tmp_path / "a", ["x", "y"], 2, "a"), make(tmp_path / "b", ["y", "z"], 2, "b")
    ds = tmp_path / "ds.wds"
    packio.convert(a, ds, progress=False, workers=0, encode="jpeg", quality=80)
    text = (ds / "packio.json").read_bytes()
    for bad, word in [({"encode": "png"}, "encode"), ({"quality": 70}, "quality"),
                      ({"resize": packio.ResizeSpec(size=(8, 8))}, "resize"), ({"overwrite": True}, "overwrite"),
                      ({"format": "lmdb"}, "lmdb")]:
        with pytest.raises(PackioError, match=word):
            packio.convert(b, ds, append=True, progress=False, **bad)
    with pytest.raises(PackioError, match="no such dataset"):
        packio.convert(b, tmp_path / "new.wds", append=True, progress=False)
    packio.convert(a, tmp_path / "one.h5", progress=False, resize=packio.ResizeSpec(size=(8, 8)))
    with pytest.raises(PackioError, match="one file"):
        packio.convert(b, tmp_path / "one.h5", append=True, progress=False)
    with pytest.raises(PackioError, match="URL is not supported"):
        packio.convert(b, "s3://bucket/ds.wds", append=True, progress=False)
    with pytest.raises(PackioError, match=r"key 'x/a0.png' \(#0\)"):  # the first colliding key named
        packio.convert(a, ds, append=True, progress=False)
    assert (ds / "packio.json").read_bytes() == text and sorted(os.listdir(ds)) == sorted(
        ["packio.json", "index.npy", "record_digests.npy", *[f for f in os.listdir(ds) if f.endswith(".tar")]]
    )
    s = packio.convert(b, ds, append=True, progress=False, workers=0)  # the stored settings are used
    m = packio.open_reader(ds).manifest
    assert s.manifest.image["encodings"] == {"jpeg": 8} and m.image["quality"] == 80
    assert m.image["history"][-1]["appended"] == "part-00001.wds"


def _append_forever(src: Path, ds: Path) -> None:
    packio.convert(src, ds, append=True, progress=False, workers=0)
    os._exit(0)


def test_killed_append_leaves_the_old_version(tmp_path: Path) -> None:
    srcs = [make(tmp_path / f"s{k}", ["x", "y"], 3, f"s{k}") for k in range(6)]
    ds = tmp_path / "ds.lmdb"
    packio.convert(srcs[0], ds, progress=False, workers=0)
    rng, done = random.Random(7), 1
    for src in srcs[1:5]:
        want_before = {k for k, _ in contents(ds)}
        p = FORK.Process(target=_append_forever, args=(src, ds))
        p.start()
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        got = contents(ds)
        keys = {k for k, _ in got}
        assert len(got) == len(keys)  # each sample once
        assert keys == want_before or keys == want_before | {k for k, _ in contents_of(src)}
        done += keys != want_before
        assert packio.verify(ds).ok
    packio.convert(srcs[5], ds, append=True, progress=False, workers=0)  # leftovers cleaned or ignored
    assert len(contents(ds)) == 6 * (done + 1) and packio.verify(ds).ok
    assert not [f for f in os.listdir(ds) if "packio-tmp" in f]


HOLD_TQDM_LOCK = r"""
import os, signal, sys
import packio
from tqdm import tqdm
src, ds = sys.argv[1:3]
packio.convert(src, ds + "/a.lmdb", progress=False, workers=0)
lock = tqdm.get_lock()  # shared with forked children, as a conversion's own bar lock is
pid = os.fork()
if pid == 0:  # a forked conversion killed inside tqdm: it dies holding the lock
    lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)
os.waitpid(pid, 0)
packio.convert(src, ds + "/b.lmdb", progress=False, workers=0)
print("done")
"""


def test_a_conversion_killed_holding_tqdms_lock_does_not_hang_the_next(tmp_path: Path) -> None:
    """With no bar shown, a conversion makes no tqdm object: a forked conversion SIGKILLed while
    holding tqdm's lock (shared across fork) hung the next conversion of its parent forever."""
    import subprocess
    import sys

    src = make(tmp_path / "s", ["x", "y"], 2, "s")
    try:
        out = subprocess.run([sys.executable, "-c", HOLD_TQDM_LOCK, str(src), str(tmp_path)], capture_output=True,
                             text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the conversion after a killed one hung on tqdm's lock")
    assert out.returncode == 0 and out.stdout.split() == ["done"], out.stderr[-2000:]


def contents_of(folder: Path) -> list[tuple[str, str]]:
    return [(p.relative_to(folder).as_posix(), p.parent.name) for p in sorted(folder.rglob("*.png"))]


def test_second_append_waits_for_the_lock(tmp_path: Path) -> None:
    a, b = make(tmp_path / "a", ["x", "y"], 2, "a"), make(tmp_path / "b", ["x", "y"], 2, "b")
    ds = tmp_path / "ds.wds"
    packio.convert(a, ds, progress=False, workers=0)
    (tmp_path / "link.wds").symlink_to(ds)  # the same dataset by another name: the same lock
    with output_lock(ds):  # another conversion or append holds it
        for name in (ds, tmp_path / "link.wds"):
            with pytest.raises(OutputBusyError, match="another packio conversion"):
                packio.convert(b, name, append=True, progress=False)
    assert len(packio.open_reader(ds)) == 4


def _loader(ds: Path, iterable: bool) -> packio.DataLoader:
    if iterable:
        return packio.DataLoader(packio.open_dataset(ds, iterable=True, shuffle=True), batch_size=2)
    data = packio.open_dataset(ds)
    return packio.DataLoader(data, batch_size=2, sampler=packio.ResumableSampler(len(data), shuffle=True))


@pytest.mark.parametrize("iterable", [False, True])
def test_state_from_before_an_append_is_refused(tmp_path: Path, iterable: bool) -> None:
    a, b = make(tmp_path / "a", ["x", "y"], 4, "a"), make(tmp_path / "b", ["x", "z"], 2, "b")
    ds = tmp_path / "ds.wds"
    packio.convert(a, ds, progress=False, workers=0)
    loader = _loader(ds, iterable)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    packio.convert(b, ds, append=True, progress=False, workers=0)
    grown = _loader(ds, iterable)
    with pytest.raises(StateError, match="saved on 8 samples, but the dataset now holds 12: it grew"):
        grown.load_state_dict(state)


def test_cli_append_and_info_shows_parts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from packio.cli import main

    a, b = make(tmp_path / "a", ["x", "y"], 2, "a"), make(tmp_path / "b", ["y", "z"], 2, "b")
    ds = tmp_path / "ds.wds"
    assert main(["convert", str(a), str(ds), "--quiet"]) == 0
    assert main(["convert", str(b), str(ds), "--append", "--quiet"]) == 0
    assert "appended: part-00001.wds: the dataset now holds 8 samples in 2 parts" in capsys.readouterr().out
    assert main(["info", str(ds)]) == 0
    out = capsys.readouterr().out
    assert "parts:    2: . (4 samples), part-00001.wds (4 samples)" in out and "classes:  3: x, y, z" in out


def _boxes_csv(folder: Path, rows: list[tuple[str, str]]) -> Path:
    path = folder.parent / f"{folder.name}.csv"
    path.write_text("filename,class,xmin,ymin,xmax,ymax\n" + "".join(f"{f},{c},1,2,8,9\n" for f, c in rows))
    return path


def test_box_class_names_merged_with_stable_ids(tmp_path: Path) -> None:
    a, b = make(tmp_path / "a", ["x", "y"], 2, "a"), make(tmp_path / "b", ["y", "z"], 2, "b")
    truth = {"x/a0.png": "whisker", "x/a1.png": "ear", "y/a0.png": "ear", "y/b1.png": "nose", "z/b0.png": "whisker"}
    ds = tmp_path / "ds.lmdb"
    packio.convert(a, ds, csv=_boxes_csv(a, [(k, c) for k, c in truth.items() if "a" in k]), progress=False)
    before = packio.open_reader(ds).manifest.box_class_names()
    packio.convert(b, ds, csv=_boxes_csv(b, [(k, c) for k, c in truth.items() if "b" in k]), append=True,
                   progress=False)
    r = packio.open_reader(ds)
    names = r.manifest.box_class_names()
    assert names[:len(before)] == before and set(names) == {"whisker", "ear", "nose"}
    got = {s.key: [names[j] for j in s.box_labels] for s in map(r.read, range(len(r))) if len(s.box_labels)}
    assert got == {k: [c] for k, c in truth.items()}
    assert all(r.manifest.classes[s.label] == s.key[0] for s in map(r.read, range(len(r))))


def test_append_one_class_folder_as_a_user_types_it(tmp_path: Path) -> None:
    """``more/`` holding one class folder (one the dataset has, then a new one) is labelled by
    it, as the dataset's own folders were (issue 38: every appended image got -1)."""
    from test_cli import run

    ds = tmp_path / "grown.wds"
    assert run("convert", str(make(tmp_path / "a", ["cat", "dog"], 2, "a")), str(ds), "--quiet").returncode == 0
    for name, tag in (("cat", "b"), ("bird", "c")):
        r = run("convert", str(make(tmp_path / tag, [name], 3, tag)), str(ds), "--append", "--quiet")
        assert r.returncode == 0 and "without a label" not in r.stdout, r.stdout + r.stderr
    assert packio.open_reader(ds).manifest.classes == ["cat", "dog", "bird"]
    got = contents(ds)
    assert len(got) == 10 and all(key.split("/")[0] == name for key, name in got)
    assert "labels:   cat 5, bird 3, dog 2" in run("info", str(ds)).stdout


def test_append_of_unlabelled_images_to_a_labelled_dataset_is_refused(tmp_path: Path) -> None:
    from test_cli import run

    ds = tmp_path / "grown.wds"
    packio.convert(make(tmp_path / "a", ["cat", "dog"], 2, "a"), ds, progress=False, workers=0)
    before = contents(ds)
    flat = tmp_path / "flat"
    flat.mkdir()
    for p in make(tmp_path / "b", ["cat"], 2, "b").glob("cat/*.png"):
        p.rename(flat / p.name)
    r = run("convert", str(flat), str(ds), "--append", "--quiet")
    assert r.returncode == 2 and "is labelled (classes: cat, dog)" in r.stderr and "class folders" in r.stderr
    unlabelled = tmp_path / "unlabelled.lmdb"
    packio.convert(flat, unlabelled, progress=False, workers=0)
    with pytest.raises(PackioError, match="its samples have no class names"):
        packio.convert(unlabelled, ds, append=True, progress=False, workers=0)
    assert contents(ds) == before and len(packio.open_reader(ds).manifest.extra.get("parts", [])) == 0


def test_append_one_folder_labelled_by_csv_is_no_class(tmp_path: Path) -> None:
    """Where a CSV labels the images, their one folder (``JPEGImages/``) names no class."""
    ds = tmp_path / "grown.lmdb"
    packio.convert(make(tmp_path / "a", ["cat", "dog"], 1, "a"), ds, progress=False, workers=0)
    src = make(tmp_path / "b", ["JPEGImages"], 2, "b")
    (tmp_path / "b.csv").write_text("filename,label\nb0.png,dog\nb1.png,emu\n")
    packio.convert(src, ds, csv=tmp_path / "b.csv", append=True, progress=False, workers=0)
    assert packio.open_reader(ds).manifest.classes == ["cat", "dog", "emu"]
    assert contents(ds)[2:] == [("JPEGImages/b0.png", "dog"), ("JPEGImages/b1.png", "emu")]
