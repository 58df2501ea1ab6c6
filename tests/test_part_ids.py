"""A grown dataset names each part by its manifest id: a part replaced or grown on its own is
refused when the dataset opens, and a part is never a conversion target (issue 38)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import packio
from packio.errors import DatasetReplacedError, FormatError
from packio.manifest import Manifest

from test_append import contents, make
from test_append_hostile import resign
from test_cli import run

SIZED = {".arrays": ["--size", "12x16"]}  # the formats that store one shape


def grown(tmp_path: Path, suffix: str) -> tuple[Path, list[tuple[str, str]]]:
    """A dataset of two parts (cat/dog, then bird/cat), and what it holds."""
    ds = tmp_path / f"grown{suffix}"
    size = {"resize": packio.ResizeSpec(size=(12, 16))} if suffix in SIZED else {}
    packio.convert(make(tmp_path / "a", ["cat", "dog"], 2, "a"), ds, progress=False, workers=0, **size)
    packio.convert(make(tmp_path / "b", ["bird", "cat"], 2, "b"), ds, append=True, progress=False, workers=0)
    return ds, contents(ds)


def test_a_part_is_no_conversion_target_as_a_user_types_it(tmp_path: Path) -> None:
    ds, before = grown(tmp_path, ".lmdb")
    other = make(tmp_path / "other", ["x", "y"], 2, "o")
    for flag in ("--overwrite", "--append"):
        r = run("convert", str(other), str(ds / "part-00001.lmdb"), flag, "--workers", "0")
        assert r.returncode == 2, r.stdout
        assert f"is part 2 of the dataset {ds}" in r.stderr and "--append" in r.stderr, r.stderr
    assert contents(ds) == before
    r = run("verify", str(ds))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("suffix", [".wds", ".bmpdir", ".arrays"])
def test_a_part_is_no_conversion_target(tmp_path: Path, suffix: str) -> None:
    ds, before = grown(tmp_path, suffix)
    other = make(tmp_path / "other", ["x", "y"], 2, "o")
    size = {"resize": packio.ResizeSpec(size=(12, 16))} if suffix in SIZED else {}
    for how in ({"overwrite": True}, {"append": True}):
        with pytest.raises(packio.PackioError, match=f"is part 2 of the dataset {ds}"):
            packio.convert(other, ds / f"part-00001{suffix}", progress=False, workers=0, **how, **size)
    with pytest.raises(packio.PackioError, match=f"inside the packio dataset {ds}"):
        packio.convert(other, ds / "new.lmdb", progress=False, workers=0)
    assert contents(ds) == before and packio.verify(ds).ok


def _replace_part(tmp_path: Path, ds: Path, suffix: str) -> None:
    """What an older packio (or a hand) did: another dataset's files where part 2 was."""
    other = tmp_path / f"other{suffix}"
    size = {"resize": packio.ResizeSpec(size=(12, 16))} if suffix in SIZED else {}
    packio.convert(make(tmp_path / "o", ["x", "y"], 2, "o"), other, progress=False, workers=0, **size)
    shutil.rmtree(ds / f"part-00001{suffix}")
    shutil.copytree(other, ds / f"part-00001{suffix}")


def _grow_part(tmp_path: Path, ds: Path, suffix: str) -> None:
    """Part 2's manifest as an append into the part itself left it ('convert MORE grown/part --append'):
    a new id, and parts of its own."""
    part = ds / f"part-00001{suffix}"
    raw = json.loads((part / "packio.json").read_text())
    raw["id"], raw["extra"] = "0" * 32, {**raw["extra"], "parts": [{"path": ".", "count": 4}]}
    resign(part / "packio.json", raw)


@pytest.mark.parametrize("suffix", [".lmdb", ".wds"])
@pytest.mark.parametrize("change", [_replace_part, _grow_part])
def test_a_part_changed_on_its_own_is_refused(tmp_path: Path, suffix: str, change,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from packio.cli import main

    ds, _ = grown(tmp_path, suffix)
    change(tmp_path, ds, suffix)
    for fn in (packio.open_reader, packio.verify, packio.open_dataset):
        with pytest.raises(DatasetReplacedError, match=f"its part 'part-00001{suffix}' is not the one"):
            fn(ds)
    assert main(["info", str(ds)]) == 2
    err = capsys.readouterr().err
    assert "part-00001" in err and "re-pack" in err, err


def test_the_first_part_is_checked_by_id_too(tmp_path: Path) -> None:
    ds, _ = grown(tmp_path, ".wds")
    raw = json.loads((ds / "part-00000.json").read_text())
    raw["id"] = "1" * 32
    resign(ds / "part-00000.json", raw)
    with pytest.raises(DatasetReplacedError, match=r"its part '\.' \(manifest part-00000.json\)"):
        packio.open_reader(ds)


def test_parts_listed_without_ids_still_open_and_get_ids_on_append(tmp_path: Path) -> None:
    """A dataset grown by a packio from before part ids: opened, checked by count as before."""
    ds, before = grown(tmp_path, ".lmdb")
    raw = json.loads((ds / "packio.json").read_text())
    for p in raw["extra"]["parts"]:
        del p["id"]
    resign(ds / "packio.json", raw)
    assert contents(ds) == before and packio.verify(ds).ok
    packio.convert(make(tmp_path / "c", ["emu"], 1, "c"), ds, append=True, progress=False, workers=0)
    parts = packio.open_reader(ds).manifest.extra["parts"]
    ids = [Manifest.from_json((ds / "part-00000.json").read_text(), "").id]
    ids += [Manifest.from_json((ds / p["path"] / "packio.json").read_text(), "").id for p in parts[1:]]
    assert [p["id"] for p in parts] == ids
    assert contents(ds)[:len(before)] == before


def test_malformed_part_id_refused(tmp_path: Path) -> None:
    ds, _ = grown(tmp_path, ".wds")
    raw = json.loads((ds / "packio.json").read_text())
    raw["extra"]["parts"][1]["id"] = 7
    resign(ds / "packio.json", raw)
    with pytest.raises(FormatError, match="malformed"):
        packio.open_reader(ds)
