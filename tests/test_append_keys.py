"""What ``convert --append`` leaves for other tools and readers: keys checked from records
alone, member keys unique across parts (webdataset's ``__key__``), class names merged by
their text, ``info`` describing every part."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import packio
from packio.errors import PackioError
from packio.formats import get_format

from conftest import jpeg
from test_append import make
from test_append_hostile import resign


@pytest.mark.parametrize("fmt, opts", [("lmdb", {}), ("arrays", {"resize": packio.ResizeSpec(size=(8, 8))})])
def test_append_key_check_reads_no_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str,
                                          opts: dict[str, Any]) -> None:
    """The check that no new key is stored already reads keys only: with every way to a
    stored sample (its payload) refusing, appends still run and still catch a repeated key."""
    a, b, c = (make(tmp_path / t, ["x", "y"], 3, t) for t in "abc")
    ds = tmp_path / f"ds.{fmt}"
    packio.convert(a, ds, progress=False, workers=0, **opts)
    calls: Counter[str] = Counter()

    def refusing(name: str) -> Any:
        def read(self: Any, *args: Any, **kw: Any) -> Any:
            calls[name] += 1
            raise AssertionError(f"{name} read a stored sample")
        return read

    reader = get_format(fmt).reader
    for name in ("_load", "_load_batch"):  # the hooks every read of a stored sample goes through
        monkeypatch.setattr(reader, name, refusing(name))
    packio.convert(b, ds, append=True, progress=False, workers=0)  # a single-part dataset grown
    packio.convert(c, ds, append=True, progress=False, workers=0)  # a multi-part one
    with pytest.raises(PackioError, match=r"already holds a sample with key 'x/b0.png' \(#6\)"):
        packio.convert(b, ds, append=True, progress=False, workers=0)
    assert calls == Counter()
    monkeypatch.undo()
    r = packio.open_reader(ds)
    assert sorted(r.read(i).key for i in range(len(r))) == sorted(f"{c}/{t}{i}.png" for t in "abc" for c in "xy"
                                                                  for i in range(3))


NFC, NFD = "caf\u00e9", "cafe\u0301"  # the same text: é as one code point, and e + a combining accent


def test_class_names_one_per_text_case_kept_with_a_note(tmp_path: Path) -> None:
    """Folders named in NFC and NFD (Linux and macOS spellings of one name) are one class,
    stored in NFC; ``Dog`` and ``dog`` stay two classes (two folders, as ImageFolder has
    them), with a note in the summary. The same on append, where old ids stay."""
    src = make(tmp_path / "a", [NFC, NFD, "dog"], 2, "a")
    assert len({p.name for p in src.iterdir()}) == 3  # the filesystem keeps both spellings apart
    ds = tmp_path / "ds.lmdb"
    s = packio.convert(src, ds, progress=False, workers=0)
    r = packio.open_reader(ds)
    assert r.manifest.classes == [NFC, "dog"]
    got = Counter(r.manifest.classes[r.read(i).label] for i in range(len(r)))
    assert got == {NFC: 4, "dog": 2}
    assert not any("case" in n for n in s.info["notes"])
    more = make(tmp_path / "b", [NFD, "Dog"], 2, "b")
    s = packio.convert(more, ds, append=True, progress=False, workers=0)
    r = packio.open_reader(ds)
    assert r.manifest.classes == [NFC, "dog", "Dog"]  # NFD joins the stored class; Dog is a new one
    labels = {r.read(i).key: r.manifest.classes[r.read(i).label] for i in range(len(r))}
    assert {k.split("/")[0]: v for k, v in labels.items()} == {NFC: NFC, NFD: NFC, "dog": "dog", "Dog": "Dog"}
    assert [n for n in s.info["notes"] if "only in case" in n and "dog, Dog" in n], s.info["notes"]
    fresh = packio.convert(make(tmp_path / "c", ["Dog", "dog"], 1, "c"), tmp_path / "c.lmdb", progress=False,
                           workers=0)
    assert fresh.manifest.classes == ["Dog", "dog"]
    assert {n: c for n, c in fresh.info["notes"].items() if "only in case" in n} == {
        "class names that differ only in case, kept as different classes (rename the folders or labels to merge "
        "them): Dog, dog": 2}


def test_append_to_names_stored_before_nfc_keeps_their_ids() -> None:
    from packio.pack.append import merge_names

    merged, ids = merge_names([NFD, "dog"], [NFC, "Dog", NFD, "emu"])
    assert merged == [NFD, "dog", "Dog", "emu"] and ids.tolist() == [0, 2, 0, 3]


def _webdataset_samples(ds: Path) -> list[dict[str, Any]]:
    """Every sample webdataset reads from the grown dataset's shards (the first part's in the
    top folder, then each appended part's)."""
    import webdataset as wds

    shards = [str(s) for s in sorted(ds.glob("*.tar")) + sorted(ds.glob("*/*.tar"))]
    return list(wds.WebDataset(shards, shardshuffle=False, empty_check=False))


def _agree(ds: Path, samples: list[dict[str, Any]]) -> None:
    """Each webdataset sample is packio's sample with that index: same key, bytes, label."""
    r = packio.open_reader(ds)
    assert len(samples) == len(r)
    for s in samples:
        got = r.read(int(s["__key__"]))
        assert json.loads(s["json"])["key"] == got.key and s["png"] == got.payload and int(s["cls"]) == got.label


def test_grown_wds_member_keys_unique_across_parts(tmp_path: Path) -> None:
    srcs = [make(tmp_path / t, ["x", "y"], 3, t) for t in "abcd"]
    ds = tmp_path / "ds.wds"
    packio.convert(srcs[0], ds, progress=False, workers=0, shards=2)
    for src in srcs[1:3]:
        packio.convert(src, ds, append=True, progress=False, workers=0, shards=2)
    samples = _webdataset_samples(ds)
    keys = [s["__key__"] for s in samples]
    assert len(keys) == len(set(keys)) == 18, Counter(keys).most_common(3)
    _agree(ds, samples)
    raw = json.loads((ds / "packio.json").read_text())  # a hand edit: the first appended part dropped
    raw["count"] -= raw["extra"]["parts"].pop(1)["count"]
    raw["files"] = {k: v for k, v in raw["files"].items() if not k.startswith("part-00001.wds/")}
    resign(ds / "packio.json", raw)
    shutil.rmtree(ds / "part-00001.wds")
    packio.convert(srcs[3], ds, append=True, progress=False, workers=0)  # numbered past every listed part
    keys = [s["__key__"] for s in _webdataset_samples(ds)]
    assert len(keys) == len(set(keys)) == 18, Counter(keys).most_common(3)
    assert packio.verify(ds).ok


def test_info_images_line_describes_every_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from packio.cli import main

    a = make(tmp_path / "a", ["x", "y"], 2, "a")  # PNGs
    b = tmp_path / "b"
    for c in ("y", "z"):
        (b / c).mkdir(parents=True)
        for i in range(3):
            (b / c / f"b{i}.jpg").write_bytes(jpeg(16, 20, seed=i))
    ds = tmp_path / "ds.wds"
    packio.convert(a, ds, progress=False, workers=0)
    packio.convert(b, ds, append=True, progress=False, workers=0)
    packio.convert(make(tmp_path / "c", ["x"], 1, "c"), ds, append=True, progress=False, workers=0)
    assert main(["info", str(ds)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("images:"))
    assert line == "images:   5 png, 6 jpeg: 5 png, 6 jpeg kept as found (not re-encoded)"


def test_verify_of_no_samples_says_nothing_was_verified(tmp_path: Path) -> None:
    """Foreign shards holding no image packio reads, and a packio dataset of no samples:
    both EMPTY, not OK, exit status 1."""
    import tarfile
    from io import BytesIO

    from packio.cli import main
    from packio.formats.base import WriteOptions
    from packio.formats.tar import TarWriter
    from packio.manifest import Manifest

    shards = tmp_path / "foreign"
    shards.mkdir()
    with tarfile.open(shards / "shard-000000.tar", "w") as tf:
        for name, data in (("a.txt", b"a caption"), ("a.cls", b"1"), ("b.json", b"{}")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, BytesIO(data))
    writer = TarWriter(tmp_path / "empty.wds", WriteOptions())
    writer.write_manifest(Manifest(format="tar", count=0, extra=writer.close()))
    for path, why in ((str(shards / "shard-{000000..000000}.tar"), "no member of the shards is an image"),
                      (str(shards), "no member of the shards is an image"),
                      (str(tmp_path / "empty.wds"), "its manifest lists no samples")):
        report = packio.verify(path)
        assert not report.ok and report.text().startswith(f"{path}: EMPTY — 0 samples, nothing was verified: {why}")
        assert main(["verify", path]) == 1


def test_csv_box_class_names_one_per_text(tmp_path: Path) -> None:
    src = make(tmp_path / "a", ["x", "y"], 2, "a")
    csv = tmp_path / "boxes.csv"
    csv.write_text(f"filename,class,xmin,ymin,xmax,ymax\nx/a0.png,{NFD},1,1,5,5\nx/a1.png,{NFC},1,1,5,5\n"
                   "y/a0.png,Dog,1,1,5,5\ny/a1.png,dog,1,1,5,5\n")
    s = packio.convert(src, tmp_path / "ds.lmdb", csv=csv, progress=False, workers=0)
    r = packio.open_reader(tmp_path / "ds.lmdb")
    names = r.manifest.box_class_names()
    assert names == ["Dog", NFC, "dog"]
    assert {r.read(i).key: [names[j] for j in r.read(i).box_labels] for i in range(len(r))} == {
        "x/a0.png": [NFC], "x/a1.png": [NFC], "y/a0.png": ["Dog"], "y/a1.png": ["dog"]}
    assert [n for n in s.info["notes"] if n.startswith("box class names that differ only in case") and "Dog, dog" in n]
