"""Beyond one machine: Dask conversion into parts, multi-part reading (real DDP: test_ddp.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import packio
from conftest import shared

distributed = pytest.importorskip("dask.distributed")

FORMATS = {".lmdb": {}, ".h5": {}, ".wds": {"shard_samples": 50},
           ".bmpdir": {"resize": packio.ResizeSpec(short_side=48)},
           ".arrays": {"resize": packio.ResizeSpec(size=(40, 40))}}


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                                  silence_logs=40) as c:
        with distributed.Client(c) as client:
            yield c, client


def _same(a: Path, b: Path) -> None:
    ra, rb = packio.open_dataset(a, decode=False), packio.open_dataset(b, decode=False)
    assert len(ra) == len(rb) and ra.classes == rb.classes
    for i in range(len(ra)):
        x, y = ra.sample(i), rb.sample(i)
        assert x.key == y.key and x.label == y.label
        if isinstance(x.payload, np.ndarray):
            np.testing.assert_array_equal(x.payload, y.payload)
        else:
            assert x.payload == y.payload
        np.testing.assert_array_equal(x.boxes, y.boxes)


@pytest.mark.parametrize("suffix", sorted(FORMATS))
def test_local_cluster_matches_single_process(cluster, tmp_path, suffix):
    _, client = cluster
    src = shared("hymenoptera") / "hymenoptera_data"
    single = packio.convert(src, tmp_path / f"single{suffix}", progress=False, **FORMATS[suffix])
    dist = packio.convert(src, tmp_path / f"dist{suffix}", scheduler=client, parts=5, progress=False,
                          **FORMATS[suffix])
    assert dist.packed == single.packed == 397 and dist.skipped == single.skipped
    m = packio.open_reader(tmp_path / f"dist{suffix}").manifest
    assert len(m.extra["parts"]) == 5 and sum(p["count"] for p in m.extra["parts"]) == 397
    part = tmp_path / f"dist{suffix}" / m.extra["parts"][1]["path"]
    assert [p["id"] for p in m.extra["parts"]] == [
        packio.open_reader(tmp_path / f"dist{suffix}" / p["path"]).manifest.id for p in m.extra["parts"]]
    with pytest.raises(packio.PackioError, match=f"is part 2 of the dataset {tmp_path / f'dist{suffix}'}"):
        packio.convert(tmp_path / f"single{suffix}", part, overwrite=True, progress=False)  # h5: a file part
    _same(tmp_path / f"single{suffix}", tmp_path / f"dist{suffix}")
    assert packio.verify(tmp_path / f"dist{suffix}").ok
    it = packio.open_dataset(tmp_path / f"dist{suffix}", iterable=True, decode=False, shuffle=True,
                             rank=1, world_size=2, even=None)
    other = packio.open_dataset(tmp_path / f"dist{suffix}", iterable=True, decode=False, shuffle=True,
                                rank=0, world_size=2, even=None)
    assert sorted([x["index"] for x in it] + [x["index"] for x in other]) == list(range(397))


def test_failed_part_commits_nothing(cluster, tmp_path, gen_folder):
    _, client = cluster
    src, _ = gen_folder
    (src / "cats" / "broken.jpg").write_bytes(b"\xff\xd8\xff" + b"\x00" * 50)  # truncated: fails --strict
    with pytest.raises(packio.SourceError, match="broken.jpg"):
        packio.convert(src, tmp_path / "out.lmdb", scheduler=client, parts=3, strict=True, progress=False)
    assert not (tmp_path / "out.lmdb").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.lmdb")]


def test_worker_killed_mid_conversion(tmp_path):
    """Kill every worker process while parts are being packed: the nannies restart
    them, Dask retries the lost tasks, and the commit holds all samples — or, if the
    run fails, nothing is committed."""
    from conftest import jpeg

    src = tmp_path / "imgs"
    for c in range(2):
        (src / f"c{c}").mkdir(parents=True)
        for k in range(150):
            (src / f"c{c}" / f"{k:04d}.jpg").write_bytes(jpeg(64, 64, c * 1000 + k))
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                                  silence_logs=50) as c, distributed.Client(c) as client:
        result: dict = {}

        def run() -> None:
            try:
                result["summary"] = packio.convert(src, tmp_path / "out.lmdb", scheduler=client, parts=30,
                                                   progress=False)
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                result["error"] = exc

        t = threading.Thread(target=run)
        t.start()
        deadline = time.time() + 60
        while time.time() < deadline and not any(  # a part being written (committed only from its final name)
                p.name.startswith(".part-") for d in tmp_path.glob(".out.lmdb.packio-tmp-*") for p in d.iterdir()):
            time.sleep(0.01)
        killed = client.run(lambda: os.getpid())
        for pid in killed.values():
            os.kill(pid, 9)
        t.join(180)
    assert not t.is_alive()
    if "error" in result:
        assert not (tmp_path / "out.lmdb").exists()
    else:
        assert result["summary"].packed == 300
        assert packio.verify(tmp_path / "out.lmdb").ok and len(packio.open_dataset(tmp_path / "out.lmdb")) == 300
        names = {p["path"] for p in packio.open_reader(tmp_path / "out.lmdb").manifest.extra["parts"]}
        assert {p.name for p in (tmp_path / "out.lmdb").iterdir()} == names | {"packio.json"}  # no leftovers
        files = packio.open_reader(tmp_path / "out.lmdb").manifest.files
        assert {f.split("/")[0] for f in files} == names


def test_cli_scheduler_address(cluster, gen_folder, tmp_path):
    c, _ = cluster
    src, csv = gen_folder
    r = subprocess.run([sys.executable, "-m", "packio", "convert", str(src), str(tmp_path / "o.wds"), "--csv",
                        str(csv), "--scheduler", c.scheduler_address, "--parts", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "packed 14 samples" in r.stdout and len(list((tmp_path / "o.wds").glob("part-*.wds"))) == 3
    from braceexpand import braceexpand

    pattern = next(line for line in r.stdout.splitlines() if line.startswith("shards:")).split()[-1]
    shards = list(braceexpand(pattern))  # one pattern naming the shards of every part, for webdataset
    assert len(shards) == 3 and all(Path(s).is_file() for s in shards), pattern
    import json

    import webdataset as wds

    got = [(s["__key__"], json.loads(s["json"])["key"]) for s in wds.WebDataset(shards, shardshuffle=False)]
    assert len({k for k, _ in got}) == len(got) == 14  # member keys never repeat across parts
    r = packio.open_reader(tmp_path / "o.wds")
    assert sorted(key for _, key in got) == sorted(r.read(i).key for i in range(len(r)))



def test_info_lmdb_lines_of_dask_parts_open_every_part(cluster, gen_folder, tmp_path, capsys):
    """A Dask conversion keeps its data in part-0000N.lmdb/ only: the lines ``packio info``
    prints open each part, holding every sample (the one line printed before failed: no
    data.mdb in the top folder)."""
    from conftest import run_printed_lmdb_lines

    from packio.cli import main

    _, client = cluster
    src, _ = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", scheduler=client, parts=3, progress=False)
    assert main(["info", str(tmp_path / "d.lmdb")]) == 0
    envs = run_printed_lmdb_lines(capsys.readouterr().out)
    assert len(envs) == 3 and sum(n for _, n in envs) == 14
