"""The remote cache's limit with many entries: what a download costs does not grow with
the cache (an index, not a walk per download), the limit holds, a pinned shard is never
evicted, and a process killed mid-eviction leaves a cache the next reader uses. Under
concurrency (issue 38): processes, workers and threads over two sources keep the limit,
measured from outside; a download in flight keeps its reservation, a killed one gives it
back."""

from __future__ import annotations

import fcntl
import io
import os
import random
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import simplejpeg

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


# -- the bound under concurrency (issue 38) ---------------------------------------------------


class _Peak:
    """The largest sum of the sizes of every file under ``root`` (partial downloads, the
    journal and all), sampled from a thread of the test: measured from outside, not
    from packio's counters."""

    def __init__(self, root: Path) -> None:
        self.root, self.peak, self._stop = root, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, name="cache-sampler", daemon=True)

    def now(self) -> int:
        total = 0
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except OSError:
                    pass  # removed while walked
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> "_Peak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


@pytest.fixture
def noise_sets(http_server, tmp_path):
    """Two datasets of 96 noise JPEGs (keys a000.. and b000..) in 24 shards of 4 samples,
    every shard of about one size, served over HTTP; their URLs and the largest shard's bytes."""
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        folder = tmp_path / f"noise-{name}" / "c"
        folder.mkdir(parents=True)
        for i in range(96):
            (folder / f"{name}{i:03d}.jpg").write_bytes(simplejpeg.encode_jpeg(
                rng.integers(0, 256, (112, 112, 3), np.uint8), 90))
        packio.convert(folder.parent, http_server.root / f"{name}.wds", shard_samples=4, progress=False)
    shard = max(p.stat().st_size for p in http_server.root.glob("*.wds/shard-*.tar"))
    return f"{http_server.url}/a.wds", f"{http_server.url}/b.wds", shard


_MIXER = r"""
import sys
import packio
a, b, cache, limit = sys.argv[1:5]
fast = dict(retries=2, timeout=5.0, retry_seconds=10.0, decode=False)
sources = [packio.open_dataset(u, iterable=True, cache_dir=cache, cache_limit=int(limit), **fast) for u in (a, b)]
for source in sources:
    source.reader.source.prefetch = 1
mixed = packio.mix(sources, window=1)
keys = [k for batch in packio.DataLoader(mixed, batch_size=4, num_workers=2) for k in batch["key"]]
print(len(keys), len(set(keys)))
"""

def test_two_processes_mixing_two_sources_keep_the_cache_limit(noise_sets, tmp_path):
    """Issue 38: a mix of two URL .wds sources in one cache_dir peaked at 2.2-2.8x its limit
    (downloaders took the same free bytes; an eviction pass dropped a download in flight
    from the journal, and the finished file was never counted nor evicted). A process
    mixes them with two DataLoader workers (each reader with its prefetch and batch-fetch
    threads) while this one reads both map-style (range reads, and the shards it finds
    cached, pinned): what is in use at once fits the limit, so the cache, summed from
    outside, never holds more than the limit (a shard of slack covers the journal), and
    the journal agrees with the files after."""
    a, b, shard = noise_sets
    cache, limit = tmp_path / "cache", 16 * shard  # 48 shards in all; about 13 in use at once
    readers = [packio.open_dataset(u, cache_dir=cache, cache_limit=limit, **FAST).reader for u in (a, b)]
    rng = random.Random(0)
    with _Peak(cache) as peak:
        mixer = subprocess.Popen([sys.executable, "-c", _MIXER, a, b, str(cache), str(limit)], stdout=subprocess.PIPE,
                                 text=True)
        got = []
        while mixer.poll() is None and len(got) < 400:  # map-style reads while the mix runs
            k = rng.randrange(2)
            got += [(k, s.key) for s in readers[k].read_batch([rng.randrange(96) for _ in range(4)]).rows()]
        out = mixer.communicate(timeout=180)[0].split()
    assert mixer.returncode == 0 and out == ["192", "192"], out  # every key of both sources once
    assert got and all(key.rsplit("/", 1)[-1].startswith("ab"[k]) for k, key in got)
    assert peak.peak <= limit + shard, (peak.peak / limit, f"{(peak.peak - limit) / shard:.1f} shards over")
    index = Cache(cache, limit).index
    index.refresh()
    assert index.total == Cache(cache).usage() <= limit  # the journal counts every file, and only those


def test_opening_foreign_shards_leaves_the_cache_within_its_limit(http_server, tmp_path):
    """Issue 38: opening 12 foreign shards at a URL left 2.4-4.8x the cache limit: its 8
    threads each downloaded, scanned and let go of a shard, all counting the same free
    room. Each download now reserves its room; one that finds none (the others are in
    flight) goes over by its own shard, and the cache is trimmed back as each is let go:
    summed from outside, the peak stays under the limit plus one shard per download
    thread, and the open and a full read leave at most the limit."""
    rng = np.random.default_rng(1)
    folder = http_server.root / "theirs"
    folder.mkdir()
    for s in range(12):
        with tarfile.open(folder / f"shard-{s:06d}.tar", "w") as tf:
            for j in range(4):
                for ext, data in (("jpg", simplejpeg.encode_jpeg(rng.integers(0, 256, (96, 96, 3), np.uint8), 90)),
                                  ("cls", str(j).encode())):
                    info = tarfile.TarInfo(f"s{s:02d}-{j}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    shard = max(p.stat().st_size for p in folder.iterdir())
    cache, limit = tmp_path / "cache", 3 * shard
    pattern = f"{http_server.url}/theirs/shard-{{000000..000011}}.tar"
    with _Peak(cache) as peak:
        ds = packio.open_dataset(pattern, cache_dir=cache, cache_limit=limit, **FAST)
        opened = peak.now() - (cache / ".packio-index").stat().st_size
        keys = sorted(ds[i]["key"] for i in range(len(ds)))
    assert keys == sorted(f"s{s:02d}-{j}" for s in range(12) for j in range(4))
    assert peak.peak <= limit + 8 * shard, f"{(peak.peak - limit) / shard:.1f} shards over"
    assert opened <= limit, f"{opened / limit:.2f} x the limit after the open"
    assert peak.now() - (cache / ".packio-index").stat().st_size <= limit


_FIRST_SAMPLE = r"""
import sys
import packio
ds = packio.open_dataset(sys.argv[1], iterable=True, cache_dir=sys.argv[2], cache_limit=10**9, retries=1,
                         timeout=60.0, retry_seconds=60.0, decode=False)
ds.reader.source.prefetch = 0
print(next(iter(ds))["key"], flush=True)
"""


def _parts(cache: Path) -> list[Path]:
    return list(cache.rglob(".*.part-*"))


def test_a_download_in_flight_keeps_its_reservation_and_a_killed_one_gives_it_back(two_sets, http_server, tmp_path):
    """Issue 38: an eviction pass dropped the journal entry of a download in progress as
    "gone", so the finished file was never counted (nor evicted). A thread here and
    another process each stall halfway through the download of a shard (the test server
    holds the replies) while an eviction pass runs: both reservations stay. The process
    is then SIGKILLed and the thread finishes: its file is counted; the next pass gives
    the dead one's reservation back (its download lock died with it) and removes its
    partial file."""
    root, a, b = two_sets
    cache = tmp_path / "cache"
    held = {url: http_server.stall(f"/{url.rsplit('/', 1)[1]}/shard-000000.tar") for url in (a, b)}
    kid = subprocess.Popen([sys.executable, "-c", _FIRST_SAMPLE, b, str(cache)], stdout=subprocess.PIPE, text=True)
    stream = packio.open_dataset(a, iterable=True, cache_dir=cache, cache_limit=10**9, retries=1, timeout=60.0,
                                 retry_seconds=60.0, decode=False)
    stream.reader.source.prefetch = 0
    first: list[str] = []
    here = threading.Thread(target=lambda: first.append(next(iter(stream))["key"]))
    here.start()
    try:
        for url, (reached, _) in held.items():
            assert reached.wait(60), kid.poll()
        deadline = time.monotonic() + 30  # the replies are half sent: the partial files appear at once
        while len(_parts(cache)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        index = Cache(cache, 10**9).index
        Cache(cache, 10**9).evict(reserve=10**9)  # a pass that evicts everything it may
        index.refresh()
        flying = sorted(rel for rel in index.entries if rel.endswith("shard-000000.tar"))
        assert len(flying) == 2, index.entries  # both downloads in flight keep their reservation
        kid.send_signal(signal.SIGKILL)
        kid.wait(30)
    finally:
        for _, release in held.values():
            release.set()
        here.join(60)
    assert first
    index.refresh()
    done = next(rel for rel in flying if "/a.wds/" in rel)
    assert (cache / done).is_file() and index.entries[done][0] == (cache / done).stat().st_size  # counted
    assert len(_parts(cache)) == 1  # the killed download's
    Cache(cache, 10**9).evict(reserve=10**9)
    index.refresh()
    assert not _parts(cache) and index.total == Cache(cache).usage(), index.entries
    assert not any(rel.endswith("shard-000000.tar") and "/b.wds/" in rel for rel in index.entries)


def test_a_rewrite_of_the_index_keeps_the_downloads_in_flight(tmp_path):
    """The journal's rewrite from a walk sees no file for a download in flight: its
    reservation is kept while its download lock is held (here by this test, as another
    process holds it), and dropped, with its partial file, once it is not."""

    root = tmp_path / "c"
    held = _junk(root, 10)
    cache = Cache(root, limit=10**9)
    cache.evict()  # builds the index from a walk
    vdir = root / "https" / "elsewhere" / "ds0.wds" / "0123456789abcdef"
    rel = (vdir / "shard-000100.tar").relative_to(root).as_posix()
    (vdir / ".locks").mkdir(exist_ok=True)
    lock = os.open(vdir / ".locks" / "shard-000100.tar.dl", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    (vdir / ".shard-000100.tar.part-1-abc").write_bytes(b"half")
    index = cache.index
    index.add(rel, 5000, False)
    for _ in range(1100):  # the journal outgrows its entries: the next look rewrites it
        index.drop("https/elsewhere/gone.tar")
    assert index.total == held + 5000 and index.entries[rel] == (5000, False)
    fcntl.flock(lock, fcntl.LOCK_UN)
    os.close(lock)
    for _ in range(1100):
        index.drop("https/elsewhere/gone.tar")
    assert index.total == held and rel not in index.entries
    assert not list(vdir.glob(".*.part-*"))


def test_map_style_reads_do_not_hold_the_cache_over_its_limit(noise_sets, tmp_path):
    """A map-style reader kept up to 64 cached shards pinned (and open) between batches:
    with a cache limit, nothing it had touched could be evicted while it lived, and a
    stream in the same cache went over the limit by all of them. Under a limit it now
    unpins them after each batch."""
    a, b, shard = noise_sets
    cache, limit = tmp_path / "cache", 8 * shard
    assert len(list(packio.open_dataset(a, iterable=True, cache_dir=cache, cache_limit=limit, **FAST))) == 96
    mapped = packio.open_dataset(a, cache_dir=cache, cache_limit=limit, **FAST)
    assert len(mapped.reader.read_batch(list(range(0, 96, 4))).rows()) == 24  # one sample of each shard: 7 are cached
    stream = packio.open_dataset(b, iterable=True, cache_dir=cache, cache_limit=limit, **FAST)
    stream.reader.source.prefetch = 4  # 5 shards in use at once: they fit the limit, not with the 7 mapped ones
    with _Peak(cache) as peak:
        assert len(list(stream)) == 96
    assert peak.peak <= limit + shard, f"{(peak.peak - limit) / shard:.1f} shards over"
    assert len(mapped.reader.read_batch(list(range(96))).rows()) == 96
