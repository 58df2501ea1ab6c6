"""The remote cache's limit with many entries: what a download costs does not grow with
the cache (an index, not a walk per download), the limit holds, a pinned shard is never
evicted, and a process killed mid-eviction leaves a cache the next reader uses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import packio
from packio.remote.cache import Cache

pytest.importorskip("fsspec", reason="remote tests need packio[remote]")
FAST = dict(retries=2, timeout=2.0, retry_seconds=4.0, decode=False)


def _junk(cache: Path, n: int, size: int = 100) -> int:
    """``n`` small cached files of other datasets, last used long ago; their bytes."""
    for k in range(0, n, 10):
        vdir = cache / "https" / "elsewhere" / f"ds{k}.wds" / "0123456789abcdef"
        vdir.mkdir(parents=True)
        (vdir / ".packio-cache").touch()
        for j in range(min(10, n - k)):
            f = vdir / f"shard-{j:06d}.tar"
            f.write_bytes(b"x" * size)
            os.utime(f, (1e9, 1e9))
    return n * size


@pytest.fixture
def two_sets(gen_folder, http_server):
    """The generated folder packed twice (5 shards each) and served over HTTP."""
    src, csv = gen_folder
    for name in ("a.wds", "b.wds"):
        packio.convert(src, http_server.root / name, csv=csv, shard_samples=3, progress=False)
    return http_server.root, f"{http_server.url}/a.wds", f"{http_server.url}/b.wds"


def _keys(url: str, cache: Path, limit: int) -> list[str]:
    stream = packio.open_dataset(url, iterable=True, cache_dir=cache, cache_limit=limit, **FAST)
    return sorted(x["key"] for x in stream)


def test_a_download_does_not_walk_the_cache(two_sets, tmp_path, monkeypatch):
    """Issue 29: with cache_limit every download walked and stat'ed the whole cache. Next
    to 3,000 cached files, streaming a 5-shard dataset now makes a few dozen file-system
    calls in the cache per download, not thousands (one walk builds the index, once)."""
    root, a, b = two_sets
    cache = tmp_path / "cache"
    _junk(cache, 3000)
    want = _keys(a, tmp_path / "plain", 10**9)
    assert _keys(a, cache, 10**9) == want  # the first read with a limit: the index is built
    calls = {"n": 0}
    prefix = str(cache)

    def counting(real):
        def call(path, *args, **kwargs):
            if str(path).startswith(prefix):
                calls["n"] += 1
            return real(path, *args, **kwargs)
        return call

    for name in ("stat", "lstat", "scandir"):
        monkeypatch.setattr(os, name, counting(getattr(os, name)))
    assert _keys(b, cache, 10**9) == want  # 6 downloads: index.npy and 5 shards
    monkeypatch.undo()
    assert calls["n"] < 600, calls  # a walk per download: > 6 x 3,000


def test_limit_holds_with_many_entries_and_spares_a_pinned_shard(two_sets, tmp_path):
    root, a, _ = two_sets
    cache = tmp_path / "cache"
    junk = _junk(cache, 2000)
    shards = sorted((root / "a.wds").glob("shard-*.tar"))
    limit = junk + int(max(p.stat().st_size for p in shards) * 3.5)  # the junk and 3 shards, not 5
    holder = packio.open_dataset(a, iterable=True, cache_dir=cache, **FAST)  # in the middle of shard 0
    holder.reader.source.prefetch = 0
    held = iter(packio.DataLoader(holder, batch_size=2))
    keys_held = list(next(held)["key"])
    stream = packio.open_dataset(a, iterable=True, cache_dir=cache, cache_limit=limit, **FAST)
    stream.reader.source.prefetch = 1
    usage, keys = [], []
    for batch in packio.DataLoader(stream, batch_size=3):
        keys += batch["key"]
        usage.append(Cache(cache).usage())
        assert (list(cache.rglob("a.wds/*/shard-000000.tar"))), "the pinned shard was evicted"
    assert len(keys) == 14 and max(usage) <= limit, (usage, limit)
    assert len(list(cache.rglob("ds*.wds/*/shard-*.tar"))) < 2000  # the least recently used went first
    keys_held += [k for b in held for k in b["key"]]
    assert sorted(keys_held) == sorted(keys)
    index = Cache(cache, limit).index
    index.refresh()
    assert index.total == Cache(cache).usage()  # the index agrees with a walk


_DIE_MID_EVICTION = r"""
import os, sys
import packio
real = os.unlink
def dying(path, *args, **kwargs):
    real(path, *args, **kwargs)
    if str(path).endswith(".tar") and ".part-" not in str(path):  # the first file an eviction deletes
        os._exit(9)
os.unlink = dying
ds = packio.open_dataset(sys.argv[1], iterable=True, cache_dir=sys.argv[2], cache_limit=int(sys.argv[3]),
                         retries=2, timeout=2.0, retry_seconds=4.0, decode=False)
ds.reader.source.prefetch = 0
for _ in ds:
    pass
print("never evicted")
"""


def test_killed_mid_eviction_leaves_a_usable_cache(two_sets, tmp_path):
    root, a, _ = two_sets
    cache = tmp_path / "cache"
    shards = sorted((root / "a.wds").glob("shard-*.tar"))
    limit = int(max(p.stat().st_size for p in shards) * 2.5)
    proc = subprocess.run([sys.executable, "-c", _DIE_MID_EVICTION, a, str(cache), str(limit)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stdout + proc.stderr[-2000:]
    with open(cache / ".packio-index", "ab") as f:
        f.write(b'["+", "https/torn')  # and a torn record, as a crash mid-append leaves one
    want = _keys(a, tmp_path / "plain", 10**9)
    assert _keys(a, cache, limit) == want
    ds = packio.open_dataset(a, cache_dir=cache, cache_limit=limit, **FAST)
    assert sorted(ds.reader.read(i).key for i in range(len(ds))) == want
    assert Cache(cache).usage() <= limit
    assert not list(cache.rglob("*.part-*"))


def test_the_index_is_rewritten_from_the_files_when_it_outgrows_them(tmp_path):
    """The journal grows by a line per download and eviction; past four lines per entry
    it is rewritten from a walk, which also drops what it lists but the disk lacks."""
    root = tmp_path / "c"
    held = _junk(root, 20)
    cache = Cache(root, limit=10**9)
    cache.evict()  # the first eviction check builds the index from a walk
    index = cache.index
    assert index.total == held and len(index.entries) == 20
    for k in range(3000):  # one entry noted again and again (never written: a killed download)
        index.add("https/x/ds.wds/0123/shard-000000.tar", k, False)
    journal = (root / ".packio-index").read_bytes()
    assert journal.count(b"\n[") < 1200  # rewritten along the way, not 3,020 lines
    assert len(index.entries) == 21 and index.total == held + 2999  # the entry once, at its last size
    fresh = Cache(root, limit=10**9)
    fresh.evict()
    assert fresh.index.total == index.total  # another process reads the same


def test_an_edited_index_never_reaches_outside_the_cache(two_sets, tmp_path):
    """Attack review: journal lines naming files outside the cache (``..`` below a real
    version folder, a whole-dataset entry, an absolute path, a link inside the cache
    to an outside folder) with huge sizes must not get anything outside deleted, nor
    make the cache evict everything it holds."""
    import json

    root, a, b = two_sets
    cache = tmp_path / "cache"
    want = _keys(a, cache, 10**9)  # the index is built and holds a's shards
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    for name in ("data.txt", ".complete", ".whole", "sub/b.txt"):
        (victim / name).write_text("precious")
        os.utime(victim / name, (1e9, 1e9))
    vdir = next(p.parent for p in cache.rglob(".packio-cache"))
    (vdir.parent / "planted").symlink_to(victim)  # a link inside the cache, to the outside folder
    big = 10**12
    lines = [["+", f"{vdir.relative_to(cache).as_posix()}/../../../../../../victim/data.txt", big, False],
             ["+", "../victim", big, True], ["+", str(victim / "data.txt"), big, False],
             ["+", f"{(vdir.parent / 'planted').relative_to(cache).as_posix()}", big, True],
             ["+", f"{(vdir.parent / 'planted').relative_to(cache).as_posix()}/data.txt", big, False]]
    with open(cache / ".packio-index", "a") as f:
        f.write("".join("\n" + json.dumps(line) for line in lines) + "\n")
    cached = {p for p in cache.rglob("shard-*.tar")}
    assert _keys(b, cache, 10**9) == want  # a download with a limit: an eviction check reads the journal
    assert sorted(p.relative_to(victim).as_posix() for p in victim.rglob("*") if p.is_file()) == \
        [".complete", ".whole", "data.txt", "sub/b.txt"]
    assert cached <= {p for p in cache.rglob("shard-*.tar")}  # nothing of a's evicted for the planted sizes
