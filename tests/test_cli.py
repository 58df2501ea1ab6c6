"""The command line, end to end in subprocesses."""

from __future__ import annotations

import json
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


def _grown_with_boxes(tmp_path):
    """A .wds of two parts (a conversion and an append), with boxes from a CSV."""
    from conftest import jpeg

    from packio import convert

    for part, classes in (("a", ("x", "y")), ("b", ("y", "z"))):
        rows = ["filename,class,xmin,ymin,xmax,ymax\n"]
        for c in classes:
            (tmp_path / part / c).mkdir(parents=True)
            for i in range(2):
                (tmp_path / part / c / f"{part}{i}.jpg").write_bytes(jpeg(16, 20, seed=i))
                rows.append(f"{c}/{part}{i}.jpg,ear,1,2,8,9\n")
        (tmp_path / f"{part}.csv").write_text("".join(rows))
        convert(tmp_path / part, tmp_path / "d.wds", csv=tmp_path / f"{part}.csv", append=part == "b", progress=False)
    return tmp_path / "d.wds"


def test_info_says_no_boxes_and_marks_appends(tmp_path, capsys):
    """``info`` of a dataset without boxes says so (it printed ``boxes: 0 classes:``), and each
    history line of an appended part says which part and how many samples it added."""
    from conftest import jpeg

    from packio import convert
    from packio.cli import main

    (tmp_path / "src" / "x").mkdir(parents=True)
    (tmp_path / "src" / "x" / "a.jpg").write_bytes(jpeg(8, 8, seed=1))
    convert(tmp_path / "src", tmp_path / "plain.lmdb", progress=False)
    assert main(["info", str(tmp_path / "plain.lmdb")]) == 0
    boxes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("boxes:")]
    assert boxes == ["boxes:    none"]
    ds = _grown_with_boxes(tmp_path)
    assert main(["info", str(ds)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [x for x in out if x.startswith("boxes:")][0] == "boxes:    1 classes: ear"
    history = [x for x in out if x.startswith("history:") or x.startswith("          2.")]
    assert history[0].endswith("→ tar: 4 jpeg kept as found (not re-encoded)") and "appended" not in history[0]
    assert history[1].endswith("appended: part-00001.wds (+4 samples)"), history


HOSTILE = (-5, "12", 10 ** 40, 1.5, None, True, [3], {"a": 1}, "\x1b[2J")
COUNTS = (("extra", "parts", 1, "count"), ("image", "encodings", "jpeg"), ("image", "history", 1, "result", "jpeg kept"),
          ("summary", "annotations", "labels", "y"), ("summary", "annotations", "images_without_label"),
          ("summary", "annotations", "boxes"), ("summary", "annotations", "images_with_boxes"),
          ("summary", "annotations", "box_classes", "ear"))
OTHERS = (("count",), ("image", "history", 0, "quality"), ("image", "history", 0, "resize"),
          ("image", "history", 0, "resize", "size"), ("image", "history", 1, "appended"), ("extra", "parts", 1, "path"),
          ("summary", "skipped"), ("image", "history", 1), ("summary", "annotations", "labels"), ("extra", "parts"))


def test_info_of_hostile_numbers_says_invalid_and_never_crashes(tmp_path, capsys):
    """Every number ``info`` prints from the manifest, set to a hostile value (with a fresh
    digest, as a hostile packer would write it): a count that is not an int from 0 to 2**63-1
    shows as ``invalid`` (or the reader refuses the dataset: exit 2); nothing raises but a
    packio error, nothing reaches the terminal raw."""
    from packio.cli import main
    from packio.manifest import Manifest

    ds = _grown_with_boxes(tmp_path)
    good = json.loads((ds / "packio.json").read_text())
    assert good["image"]["history"][0]["resize"] is None
    good["image"]["history"][0]["resize"] = {"size": [8, 8]}
    for where in COUNTS + OTHERS:
        for value in HOSTILE:
            m = json.loads(json.dumps(good))
            node = m
            for k in where[:-1]:
                node = node[k]
            node[where[-1]] = value
            m["digest"] = Manifest(**{k: v for k, v in m.items() if k != "digest"}).content_digest()
            (ds / "packio.json").write_text(json.dumps(m))
            rc = main(["info", str(ds)])
            out = capsys.readouterr().out
            assert rc in (0, 2) and "\x1b" not in out, (where, value)
            valid = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63
            if where in COUNTS and not valid and value is not None:  # None: a line may be left out, as for 0
                # shown as invalid, or the dataset refused as damaged
                assert "invalid" in out if rc == 0 else not out, (where, value, out)


def _dump(path: Path) -> list[tuple]:
    r = __import__("packio").open_reader(path)
    return [(s.key, s.label, s.boxes.tolist(), s.box_labels.tolist()) for s in map(r.read, range(len(r)))]


def test_a_csv_from_a_pipe_or_fifo_is_read_once(gen_folder, tmp_path):
    """``--csv <(zcat boxes.csv.gz)`` as a user types it (issue 38: refused as 'not a regular
    file'), and a FIFO given to an append: packed as from the file, the copy removed."""
    import gzip
    import os
    import threading

    import packio

    src, csv = gen_folder
    (tmp_path / "boxes.csv.gz").write_bytes(gzip.compress(csv.read_bytes()))
    r = subprocess.run(["bash", "-c", 'exec "$0" -m packio convert "$1" "$2" --csv <(zcat "$3") --quiet',
                        sys.executable, src, tmp_path / "piped.lmdb", tmp_path / "boxes.csv.gz"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    packio.convert(src, tmp_path / "file.lmdb", csv=csv, progress=False, workers=0)
    assert _dump(tmp_path / "piped.lmdb") == _dump(tmp_path / "file.lmdb")
    assert packio.open_reader(tmp_path / "piped.lmdb").manifest.source["csv"].startswith("/dev/fd/")
    (tmp_path / "more" / "cats").mkdir(parents=True)
    (tmp_path / "more" / "cats" / "new.jpg").write_bytes((src / "cats" / "cats_01.jpg").read_bytes())
    os.mkfifo(tmp_path / "more.csv")

    def feed() -> None:
        with open(tmp_path / "more.csv", "w") as f:
            f.write("filename,class,xmin,ymin,xmax,ymax\nnew.jpg,box_cats,1,2,8,9\n")

    threading.Thread(target=feed, daemon=True).start()
    s = packio.convert(tmp_path / "more", tmp_path / "piped.lmdb", csv=tmp_path / "more.csv", append=True,
                       progress=False, workers=0)
    assert s.packed == 1 and _dump(tmp_path / "piped.lmdb")[-1][1:] == (0, [[1.0, 2.0, 8.0, 9.0]], [0])
    assert sorted(p.name for p in tmp_path.iterdir() if "packio-tmp" in p.name) == []


def test_printed_lmdb_lines_open_every_part(gen_folder, tmp_path, capsys):
    """The ``lmdb.open(...)`` lines of ``packio info``, pasted as printed, open the data: one
    environment for a single part; one per part, holding every sample, once a conversion has
    grown by ``--append`` (the line printed before opened the first part only)."""
    from conftest import run_printed_lmdb_lines

    import packio
    from packio.cli import main
    from packio.formats.base import payload_bytes

    import shutil

    src, _ = gen_folder
    more = tmp_path / "more"
    shutil.copytree(src, more)
    for f in [f for f in more.rglob("*") if f.is_file()]:
        f.rename(f.with_name("more-" + f.name))  # keys of their own
    ds = tmp_path / "d.lmdb"
    packio.convert(src, ds, progress=False)
    for n_parts in (1, 2):
        assert main(["info", str(ds)]) == 0
        envs = run_printed_lmdb_lines(capsys.readouterr().out)
        data = packio.open_dataset(ds, decode=False)
        assert len(envs) == n_parts and sum(n for _, n in envs) == len(data) == 14 * n_parts
        starts = [0, 14][:n_parts]  # key 0 of each part: that part's first sample, its image bytes last
        assert [v.endswith(payload_bytes(data.sample(i))) for (v, _), i in zip(envs, starts)] == [True] * n_parts
        if n_parts == 1:
            packio.convert(more, ds, append=True, progress=False)


def test_info_into_a_closed_pipe_exits_quietly(gen_folder, tmp_path):
    """``packio info x | head -1``: the reader leaves early; packio stops without a traceback,
    with the status of a tool ended by SIGPIPE (it was a BrokenPipeError traceback)."""
    import packio

    src, _ = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", progress=False)
    p = subprocess.Popen([sys.executable, "-m", "packio", "info", str(tmp_path / "d.lmdb")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()  # no reader left before packio writes a line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err


def test_info_of_box_only_data_and_hdf5_says_what_is_there(gen_folder, tmp_path, capsys):
    """No image labels: ``classes:  none`` (it printed ``classes:  0: ``); nothing skipped:
    ``skipped:  none`` (raw JSON before); an HDF5 file: where its checksums are (it printed
    ``files:    0 listed with checksums``)."""
    from conftest import jpeg

    import packio
    from packio.cli import main

    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(3):
        (flat / f"r{i}.jpg").write_bytes(jpeg(20, 24, seed=i))
    (flat / "x.gif").write_bytes(b"GIF89a" + b"\x00" * 40)
    (tmp_path / "b.csv").write_text("filename,class,xmin,ymin,xmax,ymax\n" + "".join(
        f"r{i}.jpg,raccoon,1,2,10,12\n" for i in range(3)))
    for name in ("b.h5", "b.lmdb"):
        packio.convert(flat, tmp_path / name, csv=tmp_path / "b.csv", progress=False)
        assert main(["info", str(tmp_path / name)]) == 0
        out = capsys.readouterr().out.splitlines()
        lines = {x.split(":", 1)[0]: x for x in out if x and not x.startswith(" ")}
        assert lines["classes"] == "classes:  none (no image labels)" and "raccoon" in lines["boxes"]
        assert lines["skipped"] == "skipped:  1 (unsupported image type (gif) 1)"
        assert lines["files"] == ("files:    1 listed with checksums" if name.endswith("lmdb") else
                                  "files:    one, holding every checksum (a file cannot list its own): each "
                                  "sample's, and the digests of its 7 arrays (offsets, labels, boxes, box_labels, "
                                  "box_offsets, records, record_offsets); 'packio verify' checks them")
