"""The command line, end to end in subprocesses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packio", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_convert_info_verify(gen_folder, tmp_path):
    src, csv = gen_folder
    r = run("convert", str(src), str(tmp_path / "o.lmdb"), "--csv", str(csv), "--workers", "2", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "packed 14 samples" in r.stdout and "skipped 0" in r.stdout
    r = run("info", str(tmp_path / "o.lmdb"))
    assert r.returncode == 0 and "samples:  14" in r.stdout and "box_cats" in r.stdout and "format:   lmdb" in r.stdout
    r = run("info", "--json", str(tmp_path / "o.lmdb"))
    assert '"count": 14' in r.stdout
    r = run("verify", str(tmp_path / "o.lmdb"))
    assert r.returncode == 0 and "OK" in r.stdout
    r = run("convert", str(tmp_path / "o.lmdb"), str(tmp_path / "o.wds"), "--quiet")  # format → format
    assert r.returncode == 0 and "packed 14 samples" in r.stdout


def test_column_mapping_option(tmp_path):
    from conftest import jpeg

    (tmp_path / "im").mkdir()
    (tmp_path / "im" / "x.jpg").write_bytes(jpeg(30, 30, 0))
    (tmp_path / "a.csv").write_text("path,cell_type,xmin,xmax,ymin,ymax\nx.jpg,rbc,1,9,2,8\n")
    r = run("convert", str(tmp_path / "im"), str(tmp_path / "o.lmdb"), "--csv", str(tmp_path / "a.csv"),
            "--csv-columns", "filename=path,class=cell_type", "--quiet")
    assert r.returncode == 0, r.stderr
    import packio

    s = packio.open_dataset(tmp_path / "o.lmdb").sample(0)
    assert s.boxes.tolist() == [[1, 2, 9, 8]]  # xmin,ymin,xmax,ymax whatever the column order


@pytest.mark.parametrize("args,needle", [
    (["convert", "/nonexistent/folder", "OUT.lmdb"], "no such file or folder"),
    (["convert", "SRC", "OUT.zip"], "cannot tell the format"),
    (["convert", "SRC", "OUT.arrays"], "--size HxW"),
    (["convert", "SRC", "OUT.tar"], "name the output OUT.wds"),
    (["convert", "SRC", "OUT.npy", "--size", "8x8"], "name the output OUT.arrays"),
    (["convert", "SRC", "OUT.lmdb", "--csv", "/nope.csv"], "cannot open the CSV"),
    (["convert", "SRC", "OUT.lmdb", "--csv-columns", "bogus=x"], "FIELD=COLUMN"),
    (["convert", "SRC", "EXISTING.lmdb"], "--overwrite"),
    (["convert", "BAD", "OUT.lmdb", "--strict"], "not an image (--strict)"),
    (["info", "/nonexistent.lmdb"], "no such file or folder"),
    (["info", "SRC"], "not a packed dataset"),
    (["verify", "GARBAGE.h5"], "cannot open as HDF5"),
])
def test_bad_input_gives_one_clear_line(gen_folder, tmp_path, args, needle):
    src, _ = gen_folder
    (tmp_path / "EXISTING.lmdb").mkdir()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.jpg").write_text("not a jpeg")
    (tmp_path / "GARBAGE.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\x00garbage" * 20)
    subst = {"SRC": str(src), "BAD": str(bad), "OUT.lmdb": str(tmp_path / "OUT.lmdb"),
             "OUT.zip": str(tmp_path / "OUT.zip"), "OUT.arrays": str(tmp_path / "OUT.arrays"),
             "OUT.tar": "OUT.tar", "OUT.npy": "OUT.npy",
             "EXISTING.lmdb": str(tmp_path / "EXISTING.lmdb"), "GARBAGE.h5": str(tmp_path / "GARBAGE.h5")}
    r = run(*[subst.get(a, a) for a in args])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    err = [line for line in r.stderr.splitlines() if line.startswith("packio: error:")]
    assert len(err) == 1 and needle in err[0], r.stderr
    assert not (tmp_path / "OUT.lmdb").exists()


def test_help_everywhere():
    for cmd in ([], ["convert"], ["info"], ["verify"], ["bench"]):
        r = run(*cmd, "--help")
        assert r.returncode == 0 and "usage:" in r.stdout


def test_info_shows_terminal_escapes_in_names_escaped(tmp_path, capsys):
    """A class folder may be named with a terminal escape (a stranger's dataset, or a hostile
    manifest's names): ``packio info`` prints names, so it must write such characters as
    escapes, never send them to the terminal (which would act on them: colours, a title,
    a cleared screen)."""
    from conftest import jpeg

    from packio import convert
    from packio.cli import main

    name = "cat\x1b[2J\x1b]0;owned\x07"
    for k, folder in enumerate((name, "dog")):
        (tmp_path / "src" / folder).mkdir(parents=True)
        (tmp_path / "src" / folder / "a.jpg").write_bytes(jpeg(8, 8, seed=k))
    convert(tmp_path / "src", tmp_path / "d.lmdb", progress=False)
    assert main(["info", str(tmp_path / "d.lmdb")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "cat\\x1b[2J\\x1b]0;owned\\x07" in out
