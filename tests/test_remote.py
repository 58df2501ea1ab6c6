"""Remote datasets against real servers: SeaweedFS (S3) and an HTTP range server on
127.0.0.1, started by the fixtures in conftest.py. No mocked storage."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import relabelled, sealed

import packio
from packio import decode as dec
from packio.errors import DatasetReplacedError, FormatError, OutputExistsError, RemoteError, SourceError
from packio.formats import formats

pytest.importorskip("fsspec", reason="remote tests need packio[remote]")

ROOT = Path(__file__).resolve().parents[1]
SUFFIX = {name: spec.suffixes[0] for name, spec in formats().items()}  # .wds .lmdb .h5 .arrays .bmpdir
RESIZE = {"arrays": dec.ResizeSpec(size=(48, 64)), "bmp": dec.ResizeSpec(short_side=40)}


def same_samples(a, b) -> None:
    """Every stored sample of reader ``a`` equals ``b``'s: payload byte for byte (or pixel
    for pixel), label, boxes, box labels, key, size, checksum."""
    assert len(a) == len(b)
    for i in range(len(b)):
        x, y = a.read(i), b.read(i)
        if isinstance(y.payload, np.ndarray):
            np.testing.assert_array_equal(x.payload, y.payload)
        else:
            assert bytes(x.payload) == bytes(y.payload), i
        assert (x.key, x.label, x.width, x.height, x.checksum) == (y.key, y.label, y.width, y.height, y.checksum)
        assert x.boxes.tobytes() == y.boxes.tobytes() and x.box_labels.tobytes() == y.box_labels.tobytes()


def payloads(reader) -> dict[str, bytes]:
    return {s.key: bytes(s.payload) for s in (reader.read(i) for i in range(len(reader)))}


@pytest.fixture
def tar_pair(gen_folder, tmp_path, bucket):
    """The generated folder packed twice: locally and to the bucket (3 samples a shard)."""
    src, csv = gen_folder
    local = packio.convert(src, tmp_path / "ds.wds", csv=csv, shard_samples=3, progress=False)
    url = f"s3://{bucket}/sets/ds.wds"
    summary = packio.convert(src, url, csv=csv, shard_samples=3, progress=False)
    assert summary.output == url and summary.packed == 14
    return url, Path(local.output), tmp_path / "cache"


@pytest.mark.parametrize("fmt", sorted(SUFFIX))
def test_round_trip_through_the_bucket(fmt, gen_folder, tmp_path, bucket, s3_server):
    src, csv = gen_folder
    kw = dict(csv=csv, resize=RESIZE.get(fmt), shard_samples=4, progress=False)
    local = packio.convert(src, tmp_path / f"ds{SUFFIX[fmt]}", **kw)
    url = f"s3://{bucket}/ds{SUFFIX[fmt]}"
    packio.convert(src, url, **kw)
    with pytest.raises(OutputExistsError):
        packio.convert(src, url, **kw)
    remote = packio.open_dataset(url, cache_dir=tmp_path / "cache", decode=False)
    here = packio.open_dataset(local.output, decode=False)
    assert remote.reader.manifest.format == fmt and len(remote) == 14
    assert remote.classes == here.classes
    same_samples(remote.reader, here.reader)
    a, b = remote[5], here[5]  # the dataset view too
    assert a["key"] == b["key"] and a["label"] == b["label"] and a["boxes"].tolist() == b["boxes"].tolist()
    if fmt == "tar":
        # map-style reads fetched single members by range: no shard was downloaded
        assert not list((tmp_path / "cache").rglob("shard-*.tar"))
        stream = packio.open_dataset(url, iterable=True, cache_dir=tmp_path / "cache", decode=False)
        want = payloads(here.reader)
        got = [(x["key"], bytes(x["image"])) for x in stream]
        assert sorted(k for k, _ in got) == sorted(want) and all(want[k] == v for k, v in got)
        assert len(list((tmp_path / "cache").rglob("shard-*.tar"))) == 4  # streaming cached whole shards
    # decoded through the same path as local data
    np.testing.assert_array_equal(packio.open_dataset(url, cache_dir=tmp_path / "cache")[3]["image"].numpy(),
                                  packio.open_dataset(local.output)[3]["image"].numpy())


def test_tar_over_http_range_reads(gen_folder, tmp_path, http_server):
    src, csv = gen_folder
    packio.convert(src, http_server.root / "ds.wds", csv=csv, shard_samples=4, progress=False)
    local = packio.open_dataset(http_server.root / "ds.wds", decode=False)
    url = f"{http_server.url}/ds.wds"
    remote = packio.open_dataset(url, cache_dir=tmp_path / "cache", decode=False)
    same_samples(remote.reader, local.reader)
    shard_gets = {p: n for p, n in http_server.counts.items() if p.endswith(".tar")}
    assert sum(shard_gets.values()) == 14  # one range request per sample, image and JSON together
    stream = packio.open_dataset(url, iterable=True, shuffle=True, seed=3, cache_dir=tmp_path / "cache",
                                 decode=False)
    keys = [x["key"] for x in stream]
    assert sorted(keys) == sorted(s.key for s in local.reader.read_batch(range(14)).samples)
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("shard-*.tar"))
    assert cached == [f"shard-00000{i}.tar" for i in range(4)]


def test_map_style_reads_after_an_in_place_reupload_raise(tmp_path, http_server):
    """Issue 38: a .wds served as a folder over HTTP, re-uploaded in place with identical
    sizes (the same images under other labels: each new record's checksum matches its new
    image). The reader opened before checks each record read by range against the digest
    its index holds: DatasetReplacedError, and no sample of the new upload under the old
    class names."""
    src, dst, n = tmp_path / "images", http_server.root / "f.wds", 15
    packio.convert(src, dst, csv=relabelled(src, n, 0), shard_samples=4, progress=False, workers=0)
    sizes = {p.name: p.stat().st_size for p in dst.iterdir()}
    truth = [(s.key, s.label, s.checksum) for s in map(packio.open_reader(dst).read, range(n))]
    reader = packio.open_reader(f"{http_server.url}/f.wds", cache_dir=tmp_path / "cache")
    assert reader.read(0).key == truth[0][0]
    packio.convert(src, dst, csv=relabelled(src, n, 1), shard_samples=4, overwrite=True, progress=False, workers=0)
    assert {p.name: p.stat().st_size for p in dst.iterdir()} == sizes  # the same bytes but the records'
    got = []
    with pytest.raises(DatasetReplacedError, match="replaced"):
        for s in map(reader.read, range(n)):
            got.append((s.key, s.label, s.checksum))
    assert got == truth[:len(got)]
    with pytest.raises(DatasetReplacedError):  # and every later read: nothing is read sample by sample
        reader.read_batch(range(n))


def test_info_prints_shard_addresses_webdataset_opens(gen_folder, tmp_path, http_server, bucket, s3_server, capsys):
    """Issue 41: `packio info URL` printed shard addresses that answer 404 (over HTTP the
    dataset's folder dropped, on S3 the upload's v-VERSION folder missing). The addresses
    printed for a local, an HTTP and an S3 dataset are fetched and open with webdataset."""
    import fsspec
    import webdataset as wds
    from braceexpand import braceexpand

    from packio.cli import main

    src, csv = gen_folder
    kw = dict(csv=csv, shard_samples=4, progress=False, workers=0)
    local = packio.convert(src, tmp_path / "f17.wds", **kw).output
    packio.convert(src, http_server.root / "f17.wds", **kw)
    packio.convert(src, f"s3://{bucket}/f17.wds", **kw)
    want = sorted(packio.open_reader(local).key(i) for i in range(14))
    for k, path in enumerate([local, f"{http_server.url}/f17.wds", f"s3://{bucket}/f17.wds"]):
        assert main(["info", path]) == 0
        pattern = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("shards:"))
        shards = []
        for j, address in enumerate(braceexpand(pattern.rsplit(": ", 1)[1])):
            with fsspec.open(address, "rb") as f:  # a 404 fails here
                shards.append(tmp_path / f"got{k}-{j}.tar")
                shards[-1].write_bytes(f.read())
        got = [json.loads(s["json"])["key"] for s in wds.WebDataset([str(p) for p in shards], shardshuffle=False)]
        assert sorted(got) == want, path


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_dataloader_two_workers_exactly_once_one_download_per_shard(ctx, tar_pair, bucket, s3_server):
    url, local, cache = tar_pair
    want = payloads(packio.open_dataset(local, decode=False).reader)
    before = s3_server.gets(bucket)
    stream = packio.open_dataset(url, iterable=True, shuffle=True, seed=1, cache_dir=cache, decode=False)
    loader = packio.DataLoader(stream, batch_size=4, num_workers=2, multiprocessing_context=ctx,
                               persistent_workers=True)
    for _ in range(2):  # persistent workers: the second epoch re-plans in the same processes
        got = [(k, bytes(img)) for batch in loader for k, img in zip(batch["key"], batch["image"])]
        assert sorted(k for k, _ in got) == sorted(want)  # every sample exactly once
        assert all(want[k] == v for k, v in got)
    # the server's own count (HEADs count as GETs; s3fs HEADs each object it opens): manifest + the upload's
    # marker (HEAD) + index + record digests + each of the 5 shards, once, for two workers and two epochs
    assert s3_server.gets(bucket) - before == 2 + 1 + 2 * (2 + 5)


def test_resume_mid_epoch(tar_pair):
    url, local, cache = tar_pair
    kw = dict(iterable=True, shuffle=True, seed=7, cache_dir=cache, decode=False)
    full = [k for b in packio.DataLoader(packio.open_dataset(url, **kw), batch_size=4) for k in b["key"]]
    ds = packio.open_dataset(url, **kw)
    loader = packio.DataLoader(ds, batch_size=4, num_workers=2)
    first = []
    for n, batch in enumerate(loader):
        first += batch["key"]
        if n == 1:
            state = json.loads(json.dumps(loader.state_dict()))
            break
    ds2 = packio.open_dataset(url, **kw)
    loader2 = packio.DataLoader(ds2, batch_size=4, num_workers=2)
    loader2.load_state_dict(state)
    rest = [k for b in loader2 for k in b["key"]]
    assert first + rest == full and len(set(full)) == 14


def test_two_ranks_split_the_epoch_like_local_data(tar_pair):
    url, local, cache = tar_pair
    split = {}
    for where, kw in ((url, {"cache_dir": cache}), (str(local), {})):
        split[where] = [[k for b in packio.DataLoader(packio.open_dataset(
            where, iterable=True, shuffle=True, seed=5, rank=r, world_size=2, decode=False, **kw), batch_size=2)
            for k in b["key"]] for r in range(2)]
    assert split[url] == split[str(local)]  # the same order, rank by rank, as the local copy
    assert sorted(split[url][0] + split[url][1]) == sorted(payloads(packio.open_dataset(local, decode=False).reader))


def test_shard_deleted_mid_epoch_names_the_url(tar_pair, bucket, s3_server):
    url, local, cache = tar_pair
    stream = packio.open_dataset(url, iterable=True, cache_dir=cache, decode=False)
    stream.reader.source.prefetch = 1
    it = iter(packio.DataLoader(stream, batch_size=3))
    next(it)  # shard 0 read; at most shard 1 prefetched
    sub = stream.reader.files_at.rsplit("/", 1)[1]  # the upload's folder, v-VERSION
    s3_server.client().delete_object(Bucket=bucket, Key=f"sets/ds.wds/{sub}/shard-000004.tar")
    with pytest.raises(RemoteError, match=rf"s3://{bucket}/sets/ds.wds/{sub}/shard-000004.tar: not found"):
        for _ in it:
            pass


def test_corrupted_object_is_a_checksum_error(tar_pair, bucket, s3_server):
    url, local, cache = tar_pair
    client = s3_server.client()
    sub = packio.open_dataset(url, cache_dir=cache).reader.files_at.rsplit("/", 1)[1]
    key = f"sets/ds.wds/{sub}/shard-000002.tar"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    stream = packio.open_dataset(url, iterable=True, cache_dir=cache, decode=False)
    with pytest.raises(RemoteError, match=rf"s3://{bucket}/{key}: checksum mismatch"):
        list(stream)
    assert not (list(cache.rglob("shard-000002.tar"))), "a corrupt download must not enter the cache"


def test_cache_eviction_under_a_small_limit(tar_pair):
    url, local, cache = tar_pair
    from packio.remote.cache import Cache

    want = payloads(packio.open_dataset(local, decode=False).reader)
    sizes = [p.stat().st_size for p in sorted(local.glob("shard-*.tar"))]
    limit = int(max(sizes) * 3.5)  # room for 3 shards and the index, not for all 5 shards
    # a reader in this process is in the middle of shard 0: it must survive every eviction
    holder = packio.open_dataset(url, iterable=True, cache_dir=cache, decode=False)
    holder.reader.source.prefetch = 0
    held = iter(packio.DataLoader(holder, batch_size=2))
    keys_held = list(next(held)["key"])
    stream = packio.open_dataset(url, iterable=True, cache_dir=cache, cache_limit=limit, decode=False)
    stream.reader.source.prefetch = 1
    usage, keys = [], []
    for batch in packio.DataLoader(stream, batch_size=3):
        keys += batch["key"]
        usage.append(Cache(cache).usage())
    assert sorted(keys) == sorted(want)
    assert max(usage) <= limit, (usage, limit, sizes)
    cached = sorted(p.name for p in cache.rglob("shard-*.tar"))
    assert "shard-000000.tar" in cached and len(cached) < 5  # evicted, but never the shard in use
    keys_held += [k for b in held for k in b["key"]]  # the holder goes on, re-fetching what was evicted
    assert sorted(keys_held) == sorted(want)


WORKER = """
import json, sys, time
from pathlib import Path
import numpy as np
from packio.remote import open_url
from packio.sample import checksum
r = open_url(sys.argv[1], cache_dir=sys.argv[2])
go = Path(sys.argv[3])
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
r.plan(np.arange(len(r)))
print(json.dumps({s.key: checksum(s.payload) for s in r.read_batch(range(len(r))).samples}))
"""


def test_two_processes_share_one_cache(tar_pair, bucket, s3_server, tmp_path):
    url, local, cache = tar_pair
    stored = packio.open_dataset(local, decode=False).reader.read_batch(range(14)).samples
    want = {s.key: s.checksum for s in stored}
    before = s3_server.gets(bucket)
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, url, str(cache), str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(2)]
    time.sleep(0.5)
    go.touch()  # both start reading at once
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert json.loads(out) == want
    # the server's own count: each process read the manifest (HEAD + GET) and found the upload's marker (HEAD);
    # the index, the record digests and 5 shards came once
    assert s3_server.gets(bucket) - before == 2 * 3 + 2 * (2 + 5)


def test_failed_conversion_leaves_nothing_readable(gen_folder, tmp_path, bucket, s3_server):
    src, csv = gen_folder
    (src / "cats" / "zz_broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    url = f"s3://{bucket}/bad.wds"
    with pytest.raises(SourceError):
        packio.convert(src, url, csv=csv, shard_samples=2, strict=True, progress=False)
    with pytest.raises(FormatError, match="no packio.json"):
        packio.open_dataset(url, cache_dir=tmp_path / "cache")
    assert s3_server.client().list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


def test_a_strangers_manifest_cannot_name_paths_outside(tmp_path, http_server, gen_folder):
    src, csv = gen_folder
    packio.convert(src, http_server.root / "ds.wds", shard_samples=4, progress=False)
    manifest = json.loads((http_server.root / "ds.wds" / "packio.json").read_text())
    manifest["files"]["../../escape.tar"] = manifest["files"].pop("shard-000000.tar")
    (http_server.root / "ds.wds" / "packio.json").write_text(json.dumps(sealed(manifest)))
    with pytest.raises(FormatError, match="escape.tar"):
        packio.open_dataset(f"{http_server.url}/ds.wds", cache_dir=tmp_path / "cache")
    with pytest.raises(FormatError, match="no packio.json"):
        packio.open_dataset(f"{http_server.url}/nothing.wds", cache_dir=tmp_path / "cache")


def test_without_the_extra_a_url_says_what_to_install(tmp_path):
    code = ("import sys; sys.modules['fsspec'] = None\n"
            "from packio import open_reader\n"
            "try:\n    open_reader('s3://bucket/ds.wds')\nexcept Exception as e:\n    print(type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.startswith("RemoteError") and "pip install 'packio[remote]'" in out.stdout


def test_server_restart_mid_epoch_retries_then_continues(tar_pair, s3_server):
    url, local, cache = tar_pair
    want = payloads(packio.open_dataset(local, decode=False).reader)
    stream = packio.open_dataset(url, iterable=True, cache_dir=cache, decode=False)
    stream.reader.source.prefetch = 0
    it = iter(packio.DataLoader(stream, batch_size=3))
    first = next(it)
    got = [(k, bytes(v)) for k, v in zip(first["key"], first["image"])]
    s3_server.kill()  # crash: SIGKILL, nothing answers on its port now
    errors: list[BaseException] = []

    def rest() -> None:  # shard 1 onwards: connection refused, retried with backoff, then served
        try:
            for batch in it:
                got.extend((k, bytes(v)) for k, v in zip(batch["key"], batch["image"]))
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=rest)
    reader.start()
    time.sleep(1.5)
    s3_server.start()  # from this thread: the server dies with the thread that started it
    reader.join(120)
    assert not reader.is_alive() and not errors, errors
    assert sorted(k for k, _ in got) == sorted(want) and all(want[k] == v for k, v in got)


def test_cli_convert_info_verify_a_url(gen_folder, tmp_path, bucket, s3_server, monkeypatch, capsys):
    from packio.cli import main

    src, csv = gen_folder
    monkeypatch.setenv("PACKIO_CACHE_DIR", str(tmp_path / "cache"))
    url = f"s3://{bucket}/cli.wds"
    assert main(["convert", str(src), url, "--csv", str(csv), "--quiet", "--shard-samples", "5"]) == 0
    assert main(["info", url]) == 0
    assert "samples:  14" in capsys.readouterr().out
    assert main(["verify", url]) == 0
    assert ": OK" in capsys.readouterr().out
    assert main(["convert", str(src), url, "--quiet"]) == 2  # exists: refused without --overwrite
    assert main(["convert", str(src), url, "--quiet", "--overwrite"]) == 0  # one shard now
    assert len(packio.open_dataset(url, cache_dir=tmp_path / "c2").reader.manifest.extra["shards"]) == 1
    names = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]]
    sub = packio.open_dataset(url, cache_dir=tmp_path / "c2").reader.files_at.rsplit("/", 1)[1]
    assert sorted(names) == sorted(["cli.wds/packio.json"] + [f"cli.wds/{sub}/{n}" for n in (
        "index.npy", "packio.json", "record_digests.npy", "shard-000000.tar")])  # the old upload's are gone
