"""Strangers' shards where labels and names meet (issue 38): every label read has a class name
(``.cls`` first, then the ``.json``'s, box labels included; text in a ``.cls`` is a class name),
a label outside the class list is a counted skip, and member or folder names that are not
UTF-8 survive read, convert, show, info and verify, written as ``\\xNN``."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import packio
from conftest import jpeg
from test_append_hostile import resign

FORMATS = {".lmdb": {}, ".wds": {}, ".h5": {}, ".bmpdir": {}, ".arrays": {"resize": packio.ResizeSpec(size=(20, 24))}}


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packio", *args], capture_output=True, text=True, timeout=120,
                          env=env, errors="backslashreplace")


def shard(path: Path, members: list[tuple[str | bytes, bytes]]) -> Path:
    """One tar of ``members`` (a bytes name is written as those bytes: GNU format, no PAX)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT,
                                             encoding="utf-8", errors="surrogateescape") as tf:
        for name, data in members:
            info = tarfile.TarInfo(os.fsdecode(name) if isinstance(name, bytes) else name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path.parent


def labelled(root: Path, n: int, cls: list[bytes | None], js: list[dict | None]) -> Path:
    members: list[tuple[str | bytes, bytes]] = []
    for i in range(n):
        members.append((f"s{i:03d}.jpg", jpeg(20, 24, i)))
        if cls[i % len(cls)] is not None:
            members.append((f"s{i:03d}.cls", cls[i % len(cls)]))
        if js[i % len(js)] is not None:
            members.append((f"s{i:03d}.json", json.dumps(js[i % len(js)]).encode()))
    return shard(root / "a.tar", members)


def _named(ds: Path) -> list[str]:
    """Every sample's label as its class name (a label with no name fails here)."""
    r = packio.open_reader(ds)
    names = r.manifest.classes
    out = []
    for s in map(r.read, range(len(r))):
        assert -1 <= s.label < len(names) and all(-1 <= b < len(names) for b in s.box_labels.tolist())
        out.append(names[s.label] if s.label >= 0 else "-")
    return out


def test_cls_wins_over_a_json_label_and_the_summary_says_what_was_stored(tmp_path: Path) -> None:
    src = labelled(tmp_path / "sh", 12, [b"0", b"1", b"2"], [{"label": 9}])
    assert packio.open_reader(src).manifest.classes == ["0", "1", "2"]
    assert _named(src) == ["0", "1", "2"] * 4
    r = run("convert", str(src), str(tmp_path / "out.lmdb"), "--workers", "0")
    assert r.returncode == 0, r.stderr
    assert "labels:   0 4, 1 4, 2 4" in r.stdout and "no class" not in r.stdout, r.stdout
    assert _named(tmp_path / "out.lmdb") == ["0", "1", "2"] * 4


def test_json_labels_and_box_labels_are_in_the_class_list(tmp_path: Path) -> None:
    box = {"boxes": [[1, 2, 5, 6]], "box_labels": [6]}
    src = labelled(tmp_path / "sh", 4, [None], [{"label": 4}, {"label": 1, **box}, None, {"caption": "a label"}])
    assert packio.open_reader(src).manifest.classes == [str(c) for c in range(7)]
    assert _named(src) == ["4", "1", "-", "-"]
    assert packio.open_reader(src).read(1).box_labels.tolist() == [6]
    packio.convert(src, tmp_path / "out.wds", progress=False, workers=0)
    assert _named(tmp_path / "out.wds") == ["4", "1", "-", "-"]


def test_text_in_a_cls_is_a_class_name(tmp_path: Path) -> None:
    src = labelled(tmp_path / "sh", 6, [b"dog\n", b"1", b"cat", b"\xff\xfe", b""], [None])
    assert packio.open_reader(src).manifest.classes == ["0", "1", "cat", "dog"]
    assert _named(src) == ["dog", "1", "cat", "-", "-", "dog"]


def test_a_label_outside_the_class_list_is_skipped_and_counted(tmp_path: Path) -> None:
    """A source whose manifest names fewer classes than its labels use (an edit, re-signed)."""
    src = labelled(tmp_path / "sh", 6, [b"0", b"1", b"2"], [None])
    packio.convert(src, tmp_path / "a.lmdb", progress=False, workers=0)
    raw = json.loads((tmp_path / "a.lmdb" / "packio.json").read_text())
    raw["classes"] = ["0", "1"]
    resign(tmp_path / "a.lmdb" / "packio.json", raw)
    s = packio.convert(tmp_path / "a.lmdb", tmp_path / "b.wds", progress=False, workers=0)
    assert s.packed == 4 and s.skipped == {"label outside the class list (it names no class)": 2}
    assert _named(tmp_path / "b.wds") == ["0", "1"] * 2


def latin1(root: Path) -> Path:
    """Shards whose member names (and folder, and shard file) hold a Latin-1 é: not UTF-8."""
    folder = Path(os.fsdecode(bytes(root) + b"/caf\xe9"))
    return shard(folder / os.fsdecode(b"sh\xe9.tar"), [(b"caf\xe9%d.%s" % (i, ext), data) for i in range(3)
                                                      for ext, data in ((b"jpg", jpeg(20, 24, i)), (b"cls", b"1"))])


def test_names_that_are_not_utf8_survive_every_command(tmp_path: Path) -> None:
    src = latin1(tmp_path)
    keys = [f"caf\\xe9{i}" for i in range(3)]
    assert [packio.open_reader(src).read(i).key for i in range(3)] == keys
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}  # a strict UTF-8 terminal, as en_US.UTF-8 has
    for args in (["show", str(src), "-o", str(tmp_path / "grid.png")], ["info", str(src)], ["verify", str(src)],
                 ["convert", str(src), str(tmp_path / "out.lmdb"), "--workers", "0"]):
        r = run(*args, env=env)
        assert r.returncode == 0, f"{args[0]}: rc {r.returncode}; {r.stderr[-1500:]}"
        assert "Traceback" not in r.stderr and "\udce9" not in r.stdout
    assert "caf\\udce9" in run("info", str(src), env=env).stdout  # the folder's name, escaped
    assert (tmp_path / "grid.png").stat().st_size
    assert [s.key for s in map(packio.open_reader(tmp_path / "out.lmdb").read, range(3))] == keys


@pytest.mark.parametrize("suffix", sorted(FORMATS))
def test_names_that_are_not_utf8_convert_to_every_format(tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"out{suffix}"
    packio.convert(latin1(tmp_path), out, progress=False, workers=0, **FORMATS[suffix])
    assert packio.verify(out).ok
    r = packio.open_reader(out)
    assert [r.key(i) for i in range(3)] == [f"caf\\xe9{i}" for i in range(3)] == [r.read(i).key for i in range(3)]


def test_a_records_lone_surrogate_key_is_stored_escaped(tmp_path: Path) -> None:
    """A packio tar dataset whose .json record was edited to hold "\\udce9" (valid JSON)."""
    src = shard(tmp_path / "sh" / "a.tar", [(f"{k}.jpg", jpeg(20, 24, 0)) for k in ("abcdef", "s001")])
    packio.convert(src, tmp_path / "a.wds", progress=False, workers=0)
    tar = next((tmp_path / "a.wds").glob("*.tar"))
    data = tar.read_bytes()
    tar.write_bytes(data.replace(b'"key":"abcdef"', b'"key":"\\udce9"'))  # same length: the index still fits
    raw = json.loads((tmp_path / "a.wds" / "packio.json").read_text())
    raw["files"] = {}
    resign(tmp_path / "a.wds" / "packio.json", raw)
    s = packio.convert(tmp_path / "a.wds", tmp_path / "b.lmdb", progress=False, workers=0)
    assert s.packed == 2 and [packio.open_reader(tmp_path / "b.lmdb").key(i) for i in range(2)] == ["\\xe9", "s001"]
    r = run("show", str(tmp_path / "a.wds"), "-o", str(tmp_path / "g.png"))
    assert r.returncode == 0, r.stderr


def test_an_image_folder_with_names_that_are_not_utf8(tmp_path: Path) -> None:
    """Class folders and files named in Latin-1: packed (before: skipped as 'not valid UTF-8'),
    the class name and key escaped, the same class found again by an append."""
    def folder(root: Path, names: list[bytes]) -> Path:
        for i, rel in enumerate(names):
            path = os.fsencode(root) + b"/" + rel
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(jpeg(20, 24, i))
        return root

    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    src = folder(tmp_path / "a", [b"caf\xe9/x\xe90.jpg", b"dog/d0.jpg"])
    ds = tmp_path / "ds.wds"
    for args in (["convert", str(src), str(ds), "--workers", "0"], ["info", str(ds)], ["verify", str(ds)],
                 ["convert", str(folder(tmp_path / "b", [b"caf\xe9/x\xe91.jpg"])), str(ds), "--append"]):
        r = run(*args, env=env)
        assert r.returncode == 0 and "Traceback" not in r.stderr, f"{args[0]}: {r.stderr[-1500:]}"
    r = packio.open_reader(ds)
    assert r.manifest.classes == ["caf\\xe9", "dog"]
    assert [(s.key, s.label) for s in map(r.read, range(3))] == [
        ("caf\\xe9/x\\xe90.jpg", 0), ("dog/d0.jpg", 1), ("caf\\xe9/x\\xe91.jpg", 0)]


@pytest.mark.parametrize("suffix", [".lmdb", ".h5", ".wds"])
def test_a_dataset_path_that_is_not_utf8(tmp_path: Path, suffix: str) -> None:
    """Every format writes, reads, verifies and grows at a path that is not UTF-8 (before: LMDB
    ended in UnicodeEncodeError)."""
    out = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9" + suffix.encode()))
    packio.convert(latin1(tmp_path), out, progress=False, workers=0, **FORMATS[suffix])
    assert packio.verify(out).ok and len(packio.open_dataset(out)) == 3
    if suffix != ".h5":
        packio.convert(labelled(tmp_path / "more", 2, [b"0"], [None]), out, append=True, progress=False, workers=0)
        assert packio.verify(out).ok and len(packio.open_reader(out)) == 5


def test_names_that_escape_alike_are_never_one_key_or_one_class(tmp_path: Path) -> None:
    """b'caf\\xe9' is stored as the text caf\\xe9, which a UTF-8 name holding a backslash spells
    already: two files so named in one folder are not two samples under one key (the escaped
    one is skipped and counted), two class folders not one class (refused, naming both), two
    members of a stranger's shard not one sample (refused). Ordinary names keep their keys."""
    def write(path: bytes, seed: int) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(jpeg(20, 24, seed))

    src = os.fsencode(tmp_path / "files")
    for k, rel in enumerate([b"cats/caf\xe9.jpg", b"cats/caf\\xe9.jpg", b"dogs/d0.jpg"]):
        write(src + b"/" + rel, k)
    s = packio.convert(os.fsdecode(src), tmp_path / "f.lmdb", progress=False, workers=0)
    r = packio.open_reader(tmp_path / "f.lmdb")
    assert sorted(r.key(i) for i in range(len(r))) == ["cats/caf\\xe9.jpg", "dogs/d0.jpg"]
    assert r.read([r.key(i) for i in range(len(r))].index("cats/caf\\xe9.jpg")).payload == jpeg(20, 24, 1)
    assert sum(n for why, n in s.skipped.items() if "stored as another file's" in why) == 1, s.skipped

    apart = os.fsencode(tmp_path / "classes")  # not siblings: one class name from two folders
    for k, rel in enumerate([b"x/caf\xe9/a.jpg", b"y/caf\\xe9/b.jpg", b"y/tea/c.jpg"]):
        write(apart + b"/" + rel, k)
    with pytest.raises(packio.SourceError, match="would be one class") as exc:
        packio.convert(os.fsdecode(apart), tmp_path / "c.lmdb", progress=False, workers=0)
    assert {"'caf\\udce9'", "'caf\\\\xe9'"} <= set(str(exc.value).split()), str(exc.value)

    theirs = shard(tmp_path / "sh" / "a.tar", [(b"caf\xe9.jpg", jpeg(20, 24, 0)), (b"caf\\xe9.cls", b"1"),
                                               (b"other.jpg", jpeg(20, 24, 1))])
    with pytest.raises(packio.FormatError, match="one key"):
        packio.open_reader(theirs)
