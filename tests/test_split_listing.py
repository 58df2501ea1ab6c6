"""The Dask listing split (packio.sources.split): the same samples as one process, the driver listing nothing."""

from __future__ import annotations

import os
import random
import unicodedata
from pathlib import Path

import numpy as np
import pytest

import packio
import packio.pack.split_listing as sl
from conftest import jpeg

distributed = pytest.importorskip("dask.distributed")

_IMG: dict[int, bytes] = {}


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                                  silence_logs=40) as c, distributed.Client(c) as cl:
        yield cl


@pytest.fixture(autouse=True)
def small_steps(monkeypatch):
    """Tiny CSV ranges, buckets and many chunks: every step split on small data (driver-side settings)."""
    monkeypatch.setattr(sl, "RANGE_BYTES", 60)
    monkeypatch.setattr(sl, "BUCKET_ITEMS", 4)
    monkeypatch.setattr(sl, "CHUNKS_PER_WORKER", 50)  # folders listed alone down to the deepest split


def _img(seed: int) -> bytes:
    if seed not in _IMG:
        _IMG[seed] = jpeg(8, 8, seed)
    return _IMG[seed]


def _write(root: Path, rel: str, seed: int) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(_img(seed))


def _dump(path: Path) -> tuple:
    r = packio.open_reader(path)
    m = r.manifest
    samples = []
    for i in range(len(r)):
        s = r.read(i)
        samples.append((s.key, s.label, np.asarray(s.boxes).tolist(), np.asarray(s.box_labels).tolist(), s.payload))
    return m.classes, m.box_classes, samples, m.source


def _same(client, tmp: Path, src: Path, csv: Path | None, **kw) -> tuple:
    one = packio.convert(src, tmp / "one.lmdb", csv=csv, progress=False, **kw)
    dist = packio.convert(src, tmp / "dist.lmdb", csv=csv, progress=False, scheduler=client, parts=3, **kw)
    assert dist.packed == one.packed and dist.skipped == one.skipped
    assert sorted(dist.problems) == sorted(one.problems)
    assert _dump(tmp / "dist.lmdb") == _dump(tmp / "one.lmdb")
    assert not [p for p in tmp.iterdir() if ".packio-tmp-" in p.name]  # spills gone with the temporary
    return one, dist


def _battery(root: Path) -> Path:
    """Class folders, nesting, loose files, NFC/NFD names, hidden files, a symlink, and a CSV
    with every way of naming a file (and of failing to)."""
    src = root / "data" / "train"
    for k in range(3):
        _write(src, f"cats/{k}.jpg", k)
        _write(src, f"dogs/{k}.jpg", 10 + k)
        _write(src, f"deep/a/b/{k}.png" if k else f"deep/a/{k}.jpg", 20 + k)
    _write(src, "loose.jpg", 30)
    _write(src, "cats/same.jpg", 31)
    _write(src, "dogs/same.jpg", 32)
    _write(src, unicodedata.normalize("NFC", "café/é.jpg"), 33)
    _write(src, unicodedata.normalize("NFD", "café/é.jpg"), 34)
    _write(src, ".hidden/x.jpg", 35)
    _write(src, "cats/.h.jpg", 36)
    os.symlink(src / "cats" / "0.jpg", src / "dogs" / "link.jpg")
    os.symlink("/etc/hostname", src / "dogs" / "out.jpg")
    (src / "notes.txt").write_text("x")
    csv = root / "a.csv"
    abs_ = src / "dogs" / "1.jpg"
    csv.write_text("filename,label,xmin,ymin,xmax,ymax,class,width,height\n"
                   "cats/0.jpg,kit,1,1,5,5,whisker,8,8\n"        # a path
                   "0.png,,1,1,2,2,dot,,\n"                      # a bare name, unique
                   "1,,2,2,3,3,dot,,\n"                          # a bare stem (deep/a/b/1.png)
                   "train/dogs/0.jpg,pup,,,,,,,\n"               # relative to the folder above the root
                   f"{abs_},pup,0,0,1,1,nose,,\n"                # absolute
                   "same.jpg,x,,,,,,,\n"                         # a name in two folders
                   "loose.jpg,a,,,,,,,\n"
                   "x/loose.jpg,a,,,,,,,\n"                      # one name, two paths (the bare one fails)
                   "nope.jpg,a,,,,,,,\n"                         # missing
                   "cats/0.jpg,kit,1,1,5,5,whisker,8,8\n"        # a duplicate row
                   "cats/1.jpg,a,,,,,,,\n"
                   "cats/1.jpg,b,,,,,,,\n"                       # conflicting labels
                   "cats/2.jpg,,1,1,2,2,whisker,16,16\n"         # a frame
                   "cats/2.jpg,,2,2,3,3,,16,16\n"                # a box without class
                   "cats/0.jpg,kit,3,3,4,4,nose,8,8\n"           # a second box, later in the CSV
                   "dogs/2.jpg/,pup,,,,,,,\n"                    # a trailing slash
                   "./dogs/./1.jpg,pup,,,,,,,\n"
                   "bad,row\n")
    return csv


def test_battery_matches_one_process(client, tmp_path):
    csv = _battery(tmp_path)
    src = tmp_path / "data" / "train"
    one, _ = _same(client, tmp_path, src, csv)
    assert one.skipped and len(one.skipped) >= 6  # the battery hits the skips it means to


def test_battery_without_csv_and_flat(client, tmp_path, monkeypatch):
    monkeypatch.setattr(sl, "CHUNKS_PER_WORKER", 1)  # one chunk per top folder
    _battery(tmp_path)
    _same(client, tmp_path, tmp_path / "data" / "train", None)
    flat = tmp_path / "flat"
    for k in range(7):
        _write(flat, f"{k:03d}.jpg", k)
    (tmp_path / "one.lmdb").rename(tmp_path / "one0.lmdb")
    (tmp_path / "dist.lmdb").rename(tmp_path / "dist0.lmdb")
    csv = tmp_path / "f.csv"
    csv.write_text("file,label\n" + "".join(f"{k:03d}.jpg,c{k % 2}\n" for k in range(7)))
    _same(client, tmp_path, flat, csv)


def test_nested_runs_match_one_process(client, tmp_path, monkeypatch):
    """Folders listed alone at the top, then runs of sibling sub-folders walked whole: never
    a run across two parents (the second parent's own files come between in the walk)."""
    monkeypatch.setattr(sl, "CHUNKS_PER_WORKER", 3)  # 2 workers: 6 chunks wanted
    src = tmp_path / "src"
    for i, top in enumerate("abc"):
        _write(src, f"{top}/own.jpg", 40 + i)
        for j, sub in enumerate("xyz"):
            _write(src, f"{top}/{sub}/{j}.jpg", 10 * i + j)
    _same(client, tmp_path, src, None)
    r = packio.open_reader(tmp_path / "dist.lmdb")
    assert [r.read(i).key for i in range(4)] == ["a/own.jpg", "a/x/0.jpg", "a/y/1.jpg", "a/z/2.jpg"]


def test_relative_paths_are_the_drivers(client, tmp_path, monkeypatch):
    """A source and CSV named relative to the driver's working folder (not the workers')."""
    src = tmp_path / "src"
    for k in range(4):
        _write(src, f"{'ab'[k % 2]}/{k}.jpg", k)
    (tmp_path / "a.csv").write_text("filename,label\na/0.jpg,x\n1.jpg,y\n")
    one = packio.convert(src, tmp_path / "one.lmdb", csv=tmp_path / "a.csv", progress=False)
    monkeypatch.chdir(tmp_path)
    dist = packio.convert("src", "dist.lmdb", csv="a.csv", progress=False, scheduler=client, parts=2)
    assert dist.packed == one.packed == 4 and dist.skipped == one.skipped
    assert _dump(tmp_path / "dist.lmdb")[:3] == _dump(tmp_path / "one.lmdb")[:3]
    assert packio.open_reader(tmp_path / "dist.lmdb").manifest.source["path"] == "src"


def test_follow_symlinks_matches_one_process(client, tmp_path):
    """--follow-symlinks: a linked folder packed under its own path, a loop skipped, across chunks."""
    src = tmp_path / "src"
    for k in range(3):
        _write(src, f"a/{k}.jpg", k)
        _write(src, f"b/in/{k}.jpg", 10 + k)
    _write(tmp_path / "outside", "o.jpg", 20)
    os.symlink(src / "a", src / "c")  # the same folder again
    os.symlink(src / "b", src / "b" / "in" / "loop")  # a folder inside itself
    os.symlink(tmp_path / "outside", src / "b" / "out")
    csv = tmp_path / "a.csv"
    csv.write_text("filename,label\nc/0.jpg,x\n0.jpg,y\nb/out/o.jpg,z\n")
    one, _ = _same(client, tmp_path, src, csv, follow_symlinks=True)
    assert one.packed == 10 and one.skipped


def _random_source(root: Path, rng: random.Random) -> Path | None:
    """A seeded source: random folders and names, and a CSV naming them (or not) every way."""
    folders = ["", *[rng.choice(["a", "b", "c", "a/x", "b/y/z", "é", "e\u0301"]) for _ in range(rng.randint(0, 4))]]
    stems = ["p", "q", "r", "s", "1", "10", "9"]
    keys = sorted({"/".join(filter(None, [rng.choice(folders), rng.choice(stems) + rng.choice([".jpg", ".png"])]))
                   for _ in range(rng.randint(1, 12))})
    for k, key in enumerate(keys):
        _write(root / "src", key, k)
    if rng.random() < 0.2:
        return None
    lines = []
    for _ in range(rng.randint(0, 15)):
        key = rng.choice(keys + ["gone.jpg", "a/gone.png"])
        name = rng.choice([key, key.rsplit("/", 1)[-1], key.rsplit("/", 1)[-1].rsplit(".", 1)[0], "src/" + key,
                           str(root / "src" / key)])
        box = rng.choice(["", "1,1,2,2", "0,0,3,3"])
        lines.append(f"{name},{rng.choice(['', 'l1', 'l2', '3'])},{box or ',,,'},{rng.choice(['', 'k', 'm'])}")
        if rng.random() < 0.15:
            lines.append(lines[-1])
    quoted = rng.random() < 0.2
    csv = root / "a.csv"
    body = "".join(f'"{x}"\n' if quoted and not i else x + rng.choice(["\n", "\r\n", "\r"]) for i, x in enumerate(lines))
    body = body.rstrip("\r\n") if rng.random() < 0.2 else body  # no line end at the end
    bom = "\ufeff" if rng.random() < 0.3 else ""
    csv.write_text(bom + "filename,label,xmin,ymin,xmax,ymax,class" + rng.choice(["\n", "\r\n"]) + body, newline="")
    return csv


@pytest.mark.parametrize("seed", range(20))
def test_fuzz_matches_one_process(client, tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    monkeypatch.setattr(sl, "CHUNKS_PER_WORKER", rng.choice([1, 2, 50]))  # runs of sibling folders, or each alone
    csv = _random_source(tmp_path, rng)
    try:
        packio.convert(tmp_path / "src", tmp_path / "probe.lmdb", csv=csv, progress=False)
    except packio.SourceError as exc:  # a CSV naming none of the images: the same error
        with pytest.raises(packio.SourceError) as got:
            packio.convert(tmp_path / "src", tmp_path / "dist.lmdb", csv=csv, progress=False, scheduler=client)
        assert str(got.value) == str(exc)
        return
    _same(client, tmp_path, tmp_path / "src", csv)


@pytest.mark.parametrize("case", ["missing", "conflict", "hidden", "none named", "one bucket"])
def test_strict_first_error_is_the_same(client, tmp_path, monkeypatch, case):
    if case == "one bucket":  # many errors in one CSV range and one bucket: the first line's is told
        monkeypatch.setattr(sl, "BUCKET_ITEMS", 10**6)
        monkeypatch.setattr(sl, "RANGE_BYTES", 10**6)
    src = tmp_path / "src"
    for k in range(6):
        _write(src, f"{'ab'[k % 2]}/{k}.jpg", k)
    rows = {"missing": "a/0.jpg,x\nb/9.jpg,y\nnope.jpg,z\nb/1.jpg,y\n",
            "conflict": "b/5.jpg,x\nb/3.jpg,x\nb/3.jpg,y\nb/5.jpg,y\na/0.jpg,z\n",
            "hidden": "a/0.jpg,x\n", "none named": "x.jpg,a\ny.jpg,b\n",
            "one bucket": "a/0.jpg,x\n" + "".join(f"gone{k}.jpg,x\nb/{k}.jpg,y\n" for k in range(30))}[case]
    if case == "hidden":
        _write(src, "a/.h.jpg", 9)
    csv = tmp_path / "a.csv"
    csv.write_text("filename,label\n" + rows)
    with pytest.raises(packio.SourceError) as one:
        packio.convert(src, tmp_path / "one.lmdb", csv=csv, strict=True, progress=False)
    with pytest.raises(packio.SourceError) as dist:
        packio.convert(src, tmp_path / "dist.lmdb", csv=csv, strict=True, progress=False, scheduler=client)
    assert str(dist.value) == str(one.value)
    assert case == "hidden" or f"{csv}:" in str(one.value)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".dist", "dist"))]


def test_driver_never_lists(client, tmp_path, monkeypatch):
    """The whole-root walk, the one-process scan and CSV row parsing fail in this (the driver's)
    process only: the Dask conversion still packs every sample."""
    import sys

    import packio.sources.csvrows
    import packio.sources.listing
    import packio.sources.walk

    csv = _battery(tmp_path)
    src = tmp_path / "data" / "train"
    one = packio.convert(src, tmp_path / "one.lmdb", csv=csv, progress=False)

    def refuse(*a, **k):
        raise AssertionError("the driver listed the source")

    for module, name in ((packio.sources.walk, "walk"), (packio.sources.listing, "walk"),
                         (packio.sources.listing, "scan_source"), (sys.modules["packio.pack.plan"], "scan_source"),
                         (packio.sources.csvrows._Parser, "add"), (packio.sources.csvrows, "read_csv")):
        monkeypatch.setattr(module, name, refuse)
    dist = packio.convert(src, tmp_path / "dist.lmdb", csv=csv, progress=False, scheduler=client, parts=2)
    assert dist.packed == one.packed and dist.skipped == one.skipped
    monkeypatch.undo()
    assert _dump(tmp_path / "dist.lmdb") == _dump(tmp_path / "one.lmdb")


DRIVER = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
import packio, packio.pack
from dask import distributed

class Listed(Exception):
    pass

def stop(*a, **k):  # the listing is made: what the driver holds for it is measured here
    raise Listed

def peak_kib():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1])

if __name__ == "__main__":
    root, address = sys.argv[1:3]
    packio.pack.plan = stop
    peaks = []
    with distributed.Client(address) as client:  # the scheduler runs elsewhere, as on a cluster
        for name in ("small", "small", "big"):
            try:
                packio.convert(f"{root}/{name}", f"{root}/{name}.lmdb", csv=f"{root}/{name}.csv", scheduler=client,
                               progress=False)
            except Listed:
                peaks.append(peak_kib())
    print(json.dumps(peaks))
"""


def _many(root: Path, n: int) -> None:
    rows = ["filename,label,class,xmin,ymin,xmax,ymax\n"]
    for k in range(10):
        (root / f"c{k}").mkdir(parents=True)
    for i in range(n):
        name = f"c{i % 10}/img{i:08d}.jpg"
        open(root / name, "wb").close()  # the listing reads no file
        rows.append(f"{name},l{i % 10},b{i % 5},{i % 3},{i % 4},{8 + i % 5},{9 + i % 6}\n")
    Path(f"{root}.csv").write_text("".join(rows))


def test_driver_memory_does_not_grow_with_the_listing(client, tmp_path):
    """The driver's peak RSS (a child, under RLIMIT_AS and a timeout) over a listing of 3,000
    samples, the same again, then 30,000: the growth per sample of the last step, less the
    growth of a repeat (Dask's client keeps a little of every run), is near nothing. With the
    whole listing held there (the previous main) it is ~185 B a sample."""
    import json
    import subprocess
    import sys

    small, big = 3_000, 30_000
    _many(tmp_path / "small", small)
    _many(tmp_path / "big", big)
    (tmp_path / "child.py").write_text(DRIVER)
    r = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tmp_path), client.scheduler.address],
                       cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    first, again, after = json.loads(r.stdout.strip().splitlines()[-1])
    growth = ((after - again) - (again - first)) * 1024 / (big - small)
    assert growth < 20, f"driver peak grew {growth:.1f} B per sample ({first}, {again} -> {after} KiB)"


def _join_all(root: Path, keys: list[str], names: list[str]) -> list[str]:
    """Per row, what the join made of it: the file's key, or the skip's reason."""
    from packio.sources.csvrows import Rows
    from packio.sources.join import join
    from packio.sources.strings import Strings

    n = len(names)
    rows = Rows("a.csv", Strings.of(names), np.arange(2, n + 2, dtype=np.int32), np.full(n, -1, np.int32),
                np.zeros(n, bool), np.zeros((n, 4), np.float32), np.full(n, -1, np.int32), None, [], [])
    why: dict[int, str] = {}
    found = join(root, Strings.of(keys), rows, lambda r, w, d: why.__setitem__(int(w.rsplit(":", 1)[1]) - 2, r),
                 False)
    return [keys[f] if f >= 0 else why[i] for i, f in enumerate(found.tolist())]


@pytest.mark.parametrize("seed", range(60))
def test_join_by_stem_bucket_is_the_whole_join(tmp_path, seed):
    """join_stems' argument checked: rows and files split by the hash of the stem, each
    bucket joined alone, give every row the file (or skip) the one join gives it."""
    from packio.sources.join import join_stems, stem_hashes
    from packio.sources.strings import Strings

    rng = random.Random(seed)
    root = tmp_path / "data" / "train"
    parts = ["a", "b", "x.jpg", "é", "e\u0301", "1", "10"]
    keys = sorted({"/".join(rng.choice(parts) for _ in range(rng.randint(0, 2))) + ("/" if rng.random() < .7 else "")
                   + rng.choice(["x", "y", "1", "x.y", "é"]) + rng.choice([".jpg", ".png", "", "."])
                   for _ in range(rng.randint(1, 14))} - {""})
    keys = [k.lstrip("/") for k in keys if not k.startswith(".") and "/." not in k]

    def name() -> str:
        k = rng.choice(keys + ["gone.jpg", "a/x.jpg"])
        return rng.choice([k, k.rsplit("/", 1)[-1], k.rsplit("/", 1)[-1].rsplit(".", 1)[0], "train/" + k,
                           "data/train/" + k, str(root / k), str(root / ".." / k), k + "/", "./" + k, k + "/.",
                           k + "/..", "", ".", "..", "/", "a//" + k, "/elsewhere/" + k])
    names = [name() for _ in range(rng.randint(1, 25))]
    whole = _join_all(root, keys, names)
    key_h, row_h = stem_hashes(Strings.of(keys)).tolist(), join_stems(root, Strings.of(names)).tolist()
    for nb in (2, 5, 64):
        got: dict[int, str] = {}
        for b in range(nb):
            kb = [k for k, h in zip(keys, key_h) if (h * nb) >> 64 == b]
            rb = [i for i, h in enumerate(row_h) if (h * nb) >> 64 == b]
            got.update(zip(rb, _join_all(root, kb, [names[i] for i in rb]) if rb else []))
        assert [got[i] for i in range(len(names))] == whole, (keys, names)


@pytest.mark.parametrize("seed", range(80))
def test_csv_ranges_hold_the_rows_of_the_whole(tmp_path, seed):
    """split_csv's ranges, each read alone, give the whole CSV's rows (names, lines, labels,
    boxes) and skips in order; a CSV with a quote is not split."""
    from packio.sources.csvrows import read_csv_range, split_csv

    rng = random.Random(seed)
    cells = ["a.jpg", "b/c.jpg", "é.png", "", " x ", "1", "2.5", "-1", "nan", "q"]
    lines = [",".join(rng.choice(cells) for _ in range(rng.choice([6, 6, 6, 5]))) for _ in range(rng.randint(0, 40))]
    if rng.random() < 0.2:
        lines.insert(rng.randint(0, len(lines)), 'x.jpg,"two\nlines",1,1,2,2')
    ends = ["\n", "\r\n", "\r", "\n\n"]
    body = "".join(x + rng.choice(ends) for x in lines)
    text = ("\ufeff" if rng.random() < 0.3 else "") + "filename,label,xmin,ymin,xmax,ymax" + rng.choice(ends[:3]) + body
    csv = tmp_path / "a.csv"
    csv.write_bytes(text.encode())

    def read(span):
        got: list = []
        rows, _, _ = read_csv_range(csv, {}, lambda r, w, d: got.append((r, w)), span)
        return got + [(n, int(ln), rows.image_names[lb] if lb >= 0 else None, b.tolist())
                      for n, ln, lb, b in zip(rows.names, rows.line, rows.image_label, rows.boxes)]

    spans = split_csv(csv, rng.choice([1, 7, 30, 1000]))
    whole = read(None)
    if '"' in text:
        assert spans is None
        return
    if spans is None:  # the header's end not seen with a line after it: one range, the whole
        assert len(text.encode()) < 60, text
        spans = [None]
    parts = [x for span in spans for x in read(span)]
    key = lambda x: (int(x[1].rsplit(":", 1)[1]), 0) if isinstance(x[1], str) else (x[1], 1)  # noqa: E731
    assert sorted(parts, key=key) == sorted(whole, key=key)
    assert [x for x in parts if not isinstance(x[1], str)] == [x for x in whole if not isinstance(x[1], str)]


KILLED = r"""
import sys, time
from pathlib import Path
import packio, packio.pack
from dask import distributed

def hold(*a, **k):  # the listing is spilled: say so, and wait for the kill
    Path(sys.argv[3]).write_text("listed")
    time.sleep(120)

if __name__ == "__main__":
    src, dst, marker, address = sys.argv[1:5]
    packio.pack.plan = hold
    with distributed.Client(address) as client:
        packio.convert(src, dst, csv=src + ".csv", scheduler=client, progress=False)
"""


def test_driver_killed_after_the_listing_leaves_nothing(client, tmp_path):
    """kill -9 of the driver with the listing spilled: nothing under the final name; the next
    conversion removes the dead run's temporary (spills included) and packs."""
    import signal
    import subprocess
    import sys
    import time

    src = tmp_path / "src"
    for k in range(6):
        _write(src, f"{'ab'[k % 2]}/{k}.jpg", k)
    Path(f"{src}.csv").write_text("filename,label\na/0.jpg,x\n")
    (tmp_path / "child.py").write_text(KILLED)
    dst, marker = tmp_path / "out.lmdb", tmp_path / "listed"
    p = subprocess.Popen([sys.executable, str(tmp_path / "child.py"), str(src), str(dst), str(marker),
                          client.scheduler.address], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not marker.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert marker.exists(), p.stderr.read()[-2000:] if p.poll() is not None else "no listing in 60 s"
        tmp = [d for d in tmp_path.glob(".out.lmdb.packio-tmp-*")]
        assert len(tmp) == 1 and any((tmp[0] / sl.SPILL).iterdir())  # the spills are under the temporary
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    assert not dst.exists()
    s = packio.convert(src, dst, csv=f"{src}.csv", scheduler=client, progress=False)
    assert s.packed == 6 and not list(tmp_path.glob(".out.lmdb.packio-tmp-*"))
    assert {p.name for p in dst.iterdir()} == {"packio.json"} | {x["path"] for x in
                                                                  packio.open_reader(dst).manifest.extra["parts"]}


def test_failed_conversion_leaves_no_spill(tmp_path, monkeypatch):
    """A listing task still running when the conversion fails (Dask cannot stop it) does not
    make the removed temporary output again for its spill."""
    import threading

    from packio.sources import split

    for c in "abcd":
        _write(tmp_path / "src", f"{c}/0.jpg", 0)
    real_walk, real_save = split.walk_part, split._save
    failed, saved = threading.Event(), threading.Event()

    def walk_part(root, skip, exclude, follow, starts, recursive):
        if "b/" in [s[0] for s in starts]:
            raise packio.SourceError("b: gone")  # one chunk fails while another still runs
        if "a/" in [s[0] for s in starts]:
            assert failed.wait(30)  # goes on once the conversion has failed and removed its output
        return real_walk(root, skip, exclude, follow, starts, recursive)

    def save(path, arrays):
        try:
            real_save(path, arrays)
        finally:
            if failed.is_set():
                saved.set()

    monkeypatch.setattr(split, "walk_part", walk_part)  # threads: the tasks see it
    monkeypatch.setattr(split, "_save", save)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=2, processes=False, dashboard_address=":0",
                                  silence_logs=50) as c, distributed.Client(c) as client:
        with pytest.raises(packio.SourceError, match="b: gone"):
            packio.convert(tmp_path / "src", tmp_path / "out.lmdb", scheduler=client, progress=False)
        failed.set()
        assert saved.wait(30)  # the slow task tried to spill
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_csv_replaced_during_the_listing_fails(client, tmp_path, monkeypatch):
    """A CSV replaced after it was split into byte ranges: its ranges would start inside rows
    of the new one (a cut row labels a file that neither CSV labels), so the range tasks fail."""
    import packio.pack.split_listing as sl

    src = tmp_path / "src"
    for k in range(6):
        _write(src, f"a/{k}.jpg", k)
        _write(src, f"b/x{k}.jpg", k)
    csv = tmp_path / "a.csv"
    csv.write_text("filename,label\n" + "".join(f"a/{k}.jpg,cat\n" for k in range(12)))
    real = sl.split_csv

    def split_then_replace(path, size):
        spans = real(path, size)
        (tmp_path / "new.csv").write_text("filename,label\n" + "".join(f"dog,b/x{k}.jpg,dog\n" for k in range(6)))
        os.replace(tmp_path / "new.csv", path)
        return spans

    monkeypatch.setattr(sl, "split_csv", split_then_replace)
    with pytest.raises(packio.SourceError, match="the CSV changed during the conversion"):
        packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False, scheduler=client)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv", "src"]
