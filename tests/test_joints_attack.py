"""Attack on the joints: formats x append x mix x URLs x workers x resume, as a careless user
and a stranger would use them. Samples are counted as (source, key), labels checked by class
NAME against the folder each image was packed from, kept batches compared with fresh reads."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import packio
from conftest import jpeg
from servers import RangeHTTPServer

HW = 16


def folder(base: Path, spec: dict[str, int], tag: str) -> Path:
    """Class folders of tiny JPEGs, keys ``cls/{tag}{cls}{k}.jpg`` (the class is the key's folder)."""
    for cls, n in spec.items():
        (base / cls).mkdir(parents=True, exist_ok=True)
        for k in range(n):
            seed = sum(map(ord, tag + cls)) * 100 + k
            (base / cls / f"{tag}{cls}{k:02d}.jpg").write_bytes(jpeg(HW, HW, seed))
    return base


@pytest.fixture(scope="module", autouse=True)
def _short_worker_join() -> Any:
    """After a DataLoader worker raised, torch joins each worker of the dropped iterator for
    MP_STATUS_CHECK_INTERVAL (5 s) before terminating it, plain torch too: half a second here
    (read when joining only; the workers' own polling keeps its 5 s)."""
    from torch.utils.data import _utils

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 0.5)
        yield


def pack(src: Path, dst: Path, **kw: Any) -> str:
    return str(packio.convert(src, dst, progress=False, workers=0, **kw).output)


def cls_of(key: str) -> str:
    return key.split("/")[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Any]:
    """a.lmdb: 2 parts (cats, dogs; + birds, cats); srv/b.wds: 2 parts over HTTP (fish, dogs; + eels);
    srv/c.wds and srv/d.wds: one part each (owls, hens; ants, bees), streamed shard by shard."""
    root = tmp_path_factory.mktemp("joints")
    (root / "srv").mkdir()
    pack(folder(root / "a", {"cats": 5, "dogs": 5}, "a"), root / "a.lmdb")
    pack(folder(root / "a-more", {"birds": 4, "cats": 3}, "m"), root / "a.lmdb", append=True)
    pack(folder(root / "b", {"fish": 6, "dogs": 5}, "b"), root / "srv" / "b.wds", shard_samples=3)
    pack(folder(root / "b-more", {"eels": 4}, "e"), root / "srv" / "b.wds", append=True, shard_samples=2)
    pack(folder(root / "c", {"owls": 5, "hens": 4}, "c"), root / "srv" / "c.wds", shard_samples=2)
    pack(folder(root / "d", {"ants": 4, "bees": 4}, "d"), root / "srv" / "d.wds", shard_samples=2)
    server = RangeHTTPServer(root / "srv").start()
    try:
        yield {"root": root, "url": server.url, "server": server, "a": str(root / "a.lmdb"),
               "b": f"{server.url}/b.wds", "c": f"{server.url}/c.wds", "d": f"{server.url}/d.wds", "b_local": str(root / "srv" / "b.wds")}
    finally:
        server.stop()


def opened(world: dict, name: str, cache: Path, **kw: Any) -> Any:
    """Source ``name`` as a streaming packio dataset (URLs through ``cache``)."""
    kw.setdefault("resize", HW)
    if name == "a":
        return packio.open_dataset(world["a"], iterable=True, **kw)
    return packio.open_dataset(world[name], iterable=True, cache_dir=str(cache), **kw)


def a_mix(world: dict, cache: Path, names=("a", "b"), **kw: Any) -> Any:
    kw.setdefault("even", None)
    return packio.mix([opened(world, n, cache) for n in names], **kw)


def take(ds: Any, stop: int | None = None, state: dict | None = None, **loader: Any) -> tuple[list, dict, Any]:
    """(source, key, class name) of each sample of one pass (``stop`` batches at most), the
    state after it, and the loader."""
    loader.setdefault("batch_size", 3)
    dl = packio.DataLoader(ds, **loader)
    if state is not None:
        dl.load_state_dict(state)
    got = []
    for k, b in enumerate(dl):
        src = b["source"].tolist() if "source" in b else [0] * len(b["key"])
        got += [(s, key, name(ds, lab)) for s, key, lab in zip(src, b["key"], b["label"].tolist())]
        if stop is not None and k + 1 == stop:
            break
    return got, dl.state_dict(), dl


def name(ds: Any, label: int) -> str | None:
    """The class name of ``label`` (-1: none; not ``classes[-1]``)."""
    return ds.classes[label] if label >= 0 else None


def check_once(got: list, want: set) -> None:
    counts = Counter((s, k) for s, k, _ in got)
    dup = [x for x, n in counts.items() if n > 1]
    assert not dup, f"taken twice: {dup[:5]}"
    assert set(counts) == want, f"missing {sorted(want - set(counts))[:5]}, foreign {sorted(set(counts) - want)[:5]}"
    wrong = [(s, k, c) for s, k, c in got if c != cls_of(k)]
    assert not wrong, f"labelled by another class name: {wrong[:5]}"


def all_keys(world: dict, names=("a", "b")) -> set:
    """(source, key) of every sample of the sources ``names``, read from their local copies."""
    out = set()
    for s, n in enumerate(names):
        path = world["a"] if n == "a" else str(world["root"] / "srv" / f"{n}.wds")
        ds = packio.open_dataset(path, decode=False)
        out |= {(s, ds.sample(i).key) for i in range(len(ds))}
    return out


# -- 1. resume a mix of an appended LMDB and an appended HTTP .wds on another world size -------------------

@pytest.mark.parametrize("before,after", [((2, 2), (3, 1)), ((1, 2), (2, 0))])
def test_mix_resumed_on_another_world_and_workers_takes_each_sample_once(world, tmp_path, before, after):
    want = all_keys(world)
    (w0, nw0), (w1, nw1) = before, after
    got, state = [], None
    for r in range(w0):  # ranks in step: each takes 2 batches, then the job stops
        part, st, _ = take(a_mix(world, tmp_path, rank=r, world_size=w0), stop=2, num_workers=nw0)
        got += part
        state = state or st
    assert state["consumed"] == 2 * 3 * w0
    for r in range(w1):
        part, _, _ = take(a_mix(world, tmp_path, rank=r, world_size=w1), state=state, num_workers=nw1)
        got += part
    check_once(got, want)


def test_mix_next_epoch_after_resume_is_whole_again(world, tmp_path):
    ds = a_mix(world, tmp_path)
    got, state, _ = take(ds, stop=1, num_workers=2)
    ds2 = a_mix(world, tmp_path)
    dl = packio.DataLoader(ds2, batch_size=3, num_workers=1)
    dl.load_state_dict(state)
    rest = [(s, k, ds2.classes[c]) for b in dl for s, k, c in zip(b["source"].tolist(), b["key"], b["label"].tolist())]
    check_once(got + rest, all_keys(world))
    dl.set_epoch(1)
    e1 = [(s, k, ds2.classes[c]) for b in dl for s, k, c in zip(b["source"].tolist(), b["key"], b["label"].tolist())]
    check_once(e1, all_keys(world))


# -- 2. a re-pack (--overwrite) or an --append while workers stream --------------------------------------

def _old_images(path: str) -> dict[str, np.ndarray]:
    ds = packio.open_dataset(path, resize=HW)
    return {ds.sample(i).key: ds[i]["image"].numpy().copy() for i in range(len(ds))}


def _stream_mix(ds: Any, dl: Any, replace: Callable[[], None]) -> tuple[list[tuple[int, str, str | None]], list[int]]:
    """Two epochs of a mix's loader, ``replace()`` called once two samples are out: every
    ``(source, key, class name)`` handed out, and the epochs that raised DatasetReplacedError."""
    got: list[tuple[int, str, str | None]] = []
    raised: list[int] = []
    for epoch in range(2):
        dl.set_epoch(epoch)
        try:
            for b in dl:
                got += [(s, k, name(ds, c)) for s, k, c in zip(b["source"].tolist(), b["key"], b["label"].tolist())]
                if len(got) == 2:
                    replace()
        except packio.DatasetReplacedError:
            raised.append(epoch)
    return got, raised


def _swapped(src: Path, dst: Path) -> Path:
    """The same keys, other pixels, and every label the other class."""
    for cls, other in (("cats", "dogs"), ("dogs", "cats")):
        (dst / other).mkdir(parents=True)
        for p in sorted((src / cls).iterdir()):
            (dst / other / p.name).write_bytes(jpeg(HW, HW, 999 + len(p.name)))
    return dst


# one worker where a worker raises: torch then waits 5 s per worker to shut them down (plain torch does too)
@pytest.mark.parametrize("suffix,workers", [(".lmdb", 0), (".lmdb", 1), (".wds", 1), (".bmpdir", 1), (".arrays", 0)])
def test_overwrite_while_streaming_is_replaced_never_wrong_data(tmp_path, suffix, workers):
    """Batches read after a re-pack are the old version's or a DatasetReplacedError, and the
    replacement is noticed by the next epoch at the latest ('--overwrite still makes old
    readers raise DatasetReplacedError', docs/formats.md), whatever num_workers is."""
    src = folder(tmp_path / "old", {"cats": 6, "dogs": 6}, "x")
    kw = {"options": packio.PackOptions(resize=packio.ResizeSpec(size=(HW, HW)))} if suffix == ".arrays" else {}
    dst = pack(src, tmp_path / f"d{suffix}", **kw)
    old = _old_images(dst)
    swapped = _swapped(src, tmp_path / "new")
    ds = packio.open_dataset(dst, iterable=True, resize=HW)
    dl = packio.DataLoader(ds, batch_size=2, num_workers=workers, **({"prefetch_factor": 1} if workers else {}))
    kept, raised = [], []
    for epoch in range(2):
        dl.set_epoch(epoch)
        try:
            for b in dl:
                kept.append(b)
                if len(kept) == 1:
                    pack(swapped, dst, overwrite=True, **kw)
        except packio.DatasetReplacedError:
            raised.append(epoch)
    for b in kept:
        for key, lab, img in zip(b["key"], b["label"].tolist(), b["image"]):
            assert ds.classes[lab] == cls_of(key) and np.array_equal(img.numpy(), old[key]), key
    assert raised and raised[-1] == 1, f"epochs that raised DatasetReplacedError: {raised} ({len(kept)} batches read)"


def test_overwrite_of_a_mixed_source_under_workers_is_replaced(world, tmp_path):
    src = folder(tmp_path / "old", {"cats": 5, "dogs": 5}, "y")
    dst = pack(src, tmp_path / "d.lmdb")
    swapped = _swapped(src, tmp_path / "new")
    ds = packio.mix([packio.open_dataset(dst, iterable=True, resize=HW), opened(world, "c", tmp_path)], even=None)
    dl = packio.DataLoader(ds, batch_size=2, num_workers=1, prefetch_factor=1)
    got, raised = _stream_mix(ds, dl, lambda: pack(swapped, dst, overwrite=True))
    wrong = [x for x in got if x[2] != cls_of(x[1])]
    assert not wrong, f"the re-pack's labels handed out: {wrong}"
    assert raised and raised[-1] == 1, raised


def test_append_while_workers_stream_keeps_the_opened_version_then_the_old_state_is_refused(tmp_path):
    dst = pack(folder(tmp_path / "old", {"cats": 8, "dogs": 8}, "z"), tmp_path / "d.wds", shard_samples=4)
    ds = packio.open_dataset(dst, iterable=True, resize=HW, even=None)
    want = {(0, packio.open_dataset(dst, decode=False).sample(i).key) for i in range(16)}
    dl = packio.DataLoader(ds, batch_size=2, num_workers=2, prefetch_factor=1)
    got, state = [], None
    for k, b in enumerate(dl):
        got += [(0, key, ds.classes[c]) for key, c in zip(b["key"], b["label"].tolist())]
        if k == 1:
            state = dl.state_dict()
            pack(folder(tmp_path / "more", {"birds": 3, "cats": 2}, "q"), dst, append=True)
    check_once(got, want)
    dl.set_epoch(1)  # the opened version still, for the next epoch too
    e1 = [(0, key, ds.classes[c]) for b in dl for key, c in zip(b["key"], b["label"].tolist())]
    check_once(e1, want)
    grown = packio.DataLoader(packio.open_dataset(dst, iterable=True, resize=HW, even=None), batch_size=2)
    with pytest.raises(packio.StateError):
        grown.load_state_dict(state)


# -- 3. two URL sources share one small cache under two workers ------------------------------------------

def _cache_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and not p.name.startswith(".packio"))


def test_two_url_sources_share_a_small_cache_under_two_workers(world, tmp_path):
    cache = tmp_path / "cache"
    shard = max(p.stat().st_size for p in (world["root"] / "srv").rglob("*.tar"))
    limit = 4 * shard
    srcs = [packio.open_dataset(world[n], iterable=True, resize=HW, cache_dir=str(cache), cache_limit=limit)
            for n in ("c", "d")]
    ds = packio.mix(srcs, even=None)
    local = {s: _old_images(str(world["root"] / "srv" / f"{n}.wds")) for s, n in enumerate(("c", "d"))}
    dl = packio.DataLoader(ds, batch_size=2, num_workers=2)
    got, kept, peak = [], [], 0
    for b in dl:
        kept.append(b)
        peak = max(peak, _cache_bytes(cache))
        got += [(s, key, ds.classes[c]) for s, key, c in zip(b["source"].tolist(), b["key"], b["label"].tolist())]
    want = {(s, k) for s in local for k in local[s]}
    check_once(got, want)
    for b in kept:
        for s, key, img in zip(b["source"].tolist(), b["key"], b["image"]):
            assert np.array_equal(img.numpy(), local[s][key]), key
    # at most the limit plus one file in flight per downloader (2 workers x 2 sources x (1 + prefetch 2))
    assert peak <= limit + 12 * shard, (peak, limit)
    assert _cache_bytes(cache) <= limit, "the cache was not trimmed back to its limit"


def test_mix_of_urls_takes_the_cache_options(world, tmp_path):
    """A stranger mixes two URLs and says where their cache goes (packio.mix opens URLs itself)."""
    cache = tmp_path / "mine"
    ds = packio.mix([world["b"], world["c"]], resize=HW, even=None, cache_dir=str(cache), cache_limit="10MB")
    got, _, _ = take(ds, num_workers=0)
    assert len(got) == len(ds) and any(cache.rglob("*.tar"))


# -- 4. foreign shards in a mix: labels outside the classes, names that are not UTF-8 ------------------

def _foreign(dirpath: Path) -> dict[str, str]:
    """Two stranger's shards; returns escaped key -> expected class name (or None: no image)."""
    dirpath.mkdir(parents=True)
    want: dict[str, str] = {}
    members = []
    for k in range(6):
        key = f"f{k:02d}".encode()
        if k == 1:
            key = b"caf\xe9-" + key  # Latin-1, not UTF-8
        members.append((key, k))
    for s in range(2):
        with tarfile.open(dirpath / f"shard-{s:06d}.tar", "w", format=tarfile.GNU_FORMAT,
                          encoding="utf-8", errors="surrogateescape") as tar:
            for key, k in members[s::2]:
                parts = {b".jpg": jpeg(HW, HW, 500 + k)}
                if k == 2:
                    parts[b".cls"] = b"zebra"  # a class name
                elif k == 3:
                    parts[b".json"] = json.dumps({"label": 7}).encode()  # past every other label
                elif k != 4:
                    parts[b".cls"] = str(k % 2).encode()
                for ext, data in parts.items():
                    info = tarfile.TarInfo((key + ext).decode("utf-8", "surrogateescape"))
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                shown = key.decode("utf-8", "backslashreplace")
                want[shown] = {2: "zebra", 3: "7", 4: None}.get(k, str(k % 2))
    return want


def test_foreign_shards_with_odd_labels_and_names_inside_a_mix(world, tmp_path):
    want = _foreign(tmp_path / "theirs")
    foreign = packio.open_dataset(str(tmp_path / "theirs"), iterable=True, resize=HW)
    ds = packio.mix([foreign, opened(world, "a", tmp_path)], even=None)
    dl = packio.DataLoader(ds, batch_size=3, num_workers=2)
    got = Counter()
    for b in dl:
        for s, key, lab in zip(b["source"].tolist(), b["key"], b["label"].tolist()):
            got[(s, key)] += 1
            name = None if lab < 0 else ds.classes[lab]
            expect = want[key] if s == 0 else cls_of(key)
            assert name == expect, (s, key, name, expect)
    assert max(got.values()) == 1
    assert {k for s, k in got if s == 0} == set(want)
    assert "caf\\xe9-f01" in want


def test_foreign_shards_over_http_in_a_mix_resumed(world, tmp_path):
    want = _foreign(world["root"] / "srv" / "theirs-x")
    pattern = f"{world['url']}/theirs-x/shard-{{000000..000001}}.tar"
    make = lambda: packio.mix([packio.open_dataset(pattern, iterable=True, resize=HW, cache_dir=str(tmp_path)),
                               opened(world, "c", tmp_path)], even=None)
    ds = make()
    first, state, _ = take(ds, stop=2, num_workers=2)
    rest, _, _ = take(make(), state=state, num_workers=1)
    keys = Counter((s, k) for s, k, _ in first + rest)
    assert max(keys.values()) == 1 and len(keys) == len(ds)
    assert {k for s, k in keys if s == 0} == set(want)
    for s, k, c in first + rest:
        assert (want[k] if s == 0 else cls_of(k)) == c


# -- 5. a state loaded on the wrong mix -------------------------------------------------------------------

def _state(world, tmp_path) -> dict:
    return take(a_mix(world, tmp_path), stop=2, num_workers=0)[1]


@pytest.mark.parametrize("wrong", ["swapped", "weights", "epoch_samples", "seed", "other_source", "plain",
                                   "replacement", "repacked"])
def test_a_state_on_the_wrong_mix_is_a_state_error_saying_why(world, tmp_path, wrong):
    state = _state(world, tmp_path)
    if wrong == "swapped":
        ds = a_mix(world, tmp_path, names=("b", "a"))
    elif wrong == "weights":
        ds = a_mix(world, tmp_path, weights=[1, 1])
    elif wrong == "epoch_samples":
        ds = a_mix(world, tmp_path, epoch_samples=20)
    elif wrong == "seed":
        ds = a_mix(world, tmp_path, seed=1)
    elif wrong == "replacement":
        ds = a_mix(world, tmp_path, replacement=True)
    elif wrong == "other_source":  # c has other samples
        ds = a_mix(world, tmp_path, names=("a", "c"))
    elif wrong == "repacked":  # the same images packed again: the same length, another dataset
        again = tmp_path / "again.lmdb"
        pack(world["root"] / "a", again)
        pack(world["root"] / "a-more", again, append=True)
        ds = packio.mix([packio.open_dataset(str(again), iterable=True, resize=HW), opened(world, "b", tmp_path)],
                        even=None)
    else:
        ds = packio.open_dataset(world["a"], iterable=True, shuffle=True)
    dl = packio.DataLoader(ds, batch_size=3)
    with pytest.raises(packio.StateError) as exc:
        dl.load_state_dict(state)
    word = {"swapped": "sources", "weights": "weights", "epoch_samples": "", "seed": "seed",
            "other_source": "length", "plain": "mix", "replacement": "replacement", "repacked": "sources"}[wrong]
    assert word in str(exc.value)


def test_a_mix_state_after_an_append_to_a_source_is_refused(world, tmp_path):
    a2 = tmp_path / "a2.lmdb"
    shutil.copytree(world["a"], a2)
    make = lambda: packio.mix([packio.open_dataset(str(a2), iterable=True, resize=HW), opened(world, "c", tmp_path)],
                              even=None)
    _, state, _ = take(make(), stop=1)
    pack(folder(tmp_path / "m3", {"bats": 2}, "n"), a2, append=True)
    with pytest.raises(packio.StateError):
        packio.DataLoader(make(), batch_size=3).load_state_dict(state)


def test_a_mix_state_resumes_on_a_moved_copy_of_a_url_source(world, tmp_path):
    """Names aside: the same dataset at another URL (a copy moved) keeps its place."""
    shutil.copytree(world["root"] / "srv" / "c.wds", world["root"] / "srv" / "c-moved.wds")
    first, state, _ = take(a_mix(world, tmp_path, names=("a", "c")), stop=2)
    ds = packio.mix([opened(world, "a", tmp_path), packio.open_dataset(f"{world['url']}/c-moved.wds", iterable=True,
                                                                         resize=HW, cache_dir=str(tmp_path))],
                    even=None)
    rest, _, _ = take(ds, state=state, num_workers=2)
    keys = Counter((s, k) for s, k, _ in first + rest)
    assert max(keys.values()) == 1 and len(keys) == len(ds)


# -- 6. kept batches, persistent workers, start methods ---------------------------------------------------

def test_kept_batches_of_a_mix_equal_fresh_reads_at_the_end(world, tmp_path):
    ds = packio.mix([opened(world, "a", tmp_path, threads=2), opened(world, "b", tmp_path)], even=None)
    dl = packio.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    kept = []
    for e in range(2):
        dl.set_epoch(e)
        for b in dl:
            img = b["image"]
            kept.append((b["source"].tolist(), list(b["key"]), img, img.numpy(), img[1:],
                         img.numpy().copy()))
    fresh = {0: _old_images(world["a"]), 1: _old_images(world["b_local"])}
    for srcs, keys, img, arr, tail, copy in kept:
        assert np.array_equal(arr, copy) and np.array_equal(img.numpy(), copy) and np.array_equal(tail.numpy(), copy[1:])
        for s, k, x in zip(srcs, keys, copy):
            assert np.array_equal(x, fresh[s][k]), (s, k)


def test_persistent_workers_set_epoch_and_resume_on_a_mix(world, tmp_path):
    """Spawned persistent workers (the spawn case of the start methods: one start for both)."""
    want = all_keys(world)
    ds = a_mix(world, tmp_path)
    dl = packio.DataLoader(ds, batch_size=3, num_workers=2, persistent_workers=True, multiprocessing_context="spawn")
    orders = []
    for e in range(2):
        dl.set_epoch(e)
        got = [(s, k, ds.classes[c]) for b in dl for s, k, c in zip(b["source"].tolist(), b["key"], b["label"].tolist())]
        check_once(got, want)
        orders.append([x[:2] for x in got])
    assert orders[0] != orders[1]
    dl.set_epoch(2)
    first = []
    for k, b in enumerate(dl):
        first += [(s, key, ds.classes[c]) for s, key, c in zip(b["source"].tolist(), b["key"], b["label"].tolist())]
        if k == 1:
            break
    state = dl.state_dict()
    assert state["epoch"] == 2
    ds2 = a_mix(world, tmp_path)
    dl2 = packio.DataLoader(ds2, batch_size=3, num_workers=1, persistent_workers=True)
    dl2.load_state_dict(state)
    dl2.set_epoch(2)  # the loop of docs/training.md calls it again: the resumed position is kept
    rest = [(s, k, ds2.classes[c]) for b in dl2 for s, k, c in zip(b["source"].tolist(), b["key"], b["label"].tolist())]
    check_once(first + rest, want)


@pytest.mark.parametrize("method", ["forkserver"])  # spawn: test_persistent_workers_set_epoch_and_resume_on_a_mix
def test_a_mix_of_an_appended_lmdb_and_an_http_wds_under_start_methods(world, tmp_path, method):
    ds = a_mix(world, tmp_path)
    got, _, _ = take(ds, num_workers=2, multiprocessing_context=method)
    check_once(got, all_keys(world))


# -- 7. URL x append x map-style x resume; convert from a URL -------------------------------------------

def test_map_style_appended_lmdb_over_http_resumed_with_other_workers(world, tmp_path):
    shutil.copytree(world["a"], world["root"] / "srv" / "a.lmdb", dirs_exist_ok=True)
    url = f"{world['url']}/a.lmdb"
    ds = packio.open_dataset(url, cache_dir=str(tmp_path), resize=HW)
    sampler = packio.ResumableSampler(len(ds), seed=0)
    dl = packio.DataLoader(ds, batch_size=3, sampler=sampler, num_workers=2)
    got = []
    for k, b in enumerate(dl):
        got += [(0, key, ds.classes[c]) for key, c in zip(b["key"], b["label"].tolist())]
        if k == 1:
            break
    state = dl.state_dict()
    ds2 = packio.open_dataset(url, cache_dir=str(tmp_path), resize=HW)
    dl2 = packio.DataLoader(ds2, batch_size=3, sampler=packio.ResumableSampler(len(ds2), seed=0), num_workers=1)
    dl2.load_state_dict(state)
    got += [(0, key, ds2.classes[c]) for b in dl2 for key, c in zip(b["key"], b["label"].tolist())]
    check_once(got, {(0, k) for _, k in all_keys(world, names=("a",))})


@pytest.mark.parametrize("suffix", [".h5", ".lmdb"])
def test_convert_an_appended_http_wds_keeps_labels_by_name(world, tmp_path, suffix):
    out = packio.convert(world["b"], tmp_path / f"b{suffix}", progress=False).output
    ds = packio.open_dataset(str(out), decode=False)
    keys = [ds.sample(i).key for i in range(len(ds))]
    assert sorted(keys) == sorted(k for _, k in all_keys(world, names=("b",)))
    for i in range(len(ds)):
        assert ds.classes[ds[i]["label"]] == cls_of(keys[i]), keys[i]


# -- 8. packio output opened by the neighbours' tools, after an append ------------------------------------

def test_an_appended_wds_through_webdataset_and_tar(world, tmp_path):
    import webdataset as wds

    root = Path(world["b_local"])
    shards = sorted(str(p) for p in root.rglob("shard-*.tar"))
    m = packio.open_reader(str(root)).manifest
    seen = Counter()
    for x in wds.WebDataset(shards, shardshuffle=False):
        seen[x["__key__"]] += 1
        rec = json.loads(x["json"])
        assert m.classes[int(x["cls"])] == cls_of(rec["key"]), rec
    assert max(seen.values()) == 1 and len(seen) == 15
    assert sorted(int(k) for k in seen) == list(range(15))
    listed = subprocess.run(["tar", "tf", shards[-1]], capture_output=True, text=True, check=True).stdout.split()
    assert listed and all(n.split(".")[0].isdigit() for n in listed)


def test_an_appended_arrays_through_numpy_and_an_h5_through_h5py(world, tmp_path):
    import h5py

    opts = packio.PackOptions(resize=packio.ResizeSpec(size=(HW, HW)))
    arr = tmp_path / "x.arrays"
    pack(folder(tmp_path / "p", {"cats": 3, "dogs": 2}, "p"), arr, options=opts)
    pack(folder(tmp_path / "q", {"emus": 2, "dogs": 2}, "q"), arr, append=True)
    ds = packio.open_dataset(str(arr))
    classes = ds.classes
    images = [np.load(p, mmap_mode="r") for p in sorted(arr.rglob("images.npy"))]
    labels = [np.load(p) for p in sorted(arr.rglob("labels.npy"))]
    keys = [np.load(p, allow_pickle=False) for p in sorted(arr.rglob("keys.npy"))]
    flat = [(img, lab, str(k)) for I, L, K in zip(images, labels, keys) for img, lab, k in zip(I, L, K)]
    assert len(flat) == len(ds) == 9
    for i, (img, lab, key) in enumerate(flat):
        assert classes[int(lab)] == cls_of(key), (key, lab)
        assert np.array_equal(img, ds[i]["image"].permute(1, 2, 0).numpy())
    h5 = pack(arr, tmp_path / "x.h5")
    with h5py.File(h5) as f:
        labs = f["labels"][:]
    h = packio.open_dataset(h5, decode=False)
    for i in range(len(h)):
        assert h.classes[int(labs[i])] == cls_of(h.sample(i).key)


# -- 9. class names across sources: NFC / NFD, not UTF-8 ---------------------------------------------------

def test_one_class_name_typed_two_ways_is_one_class_of_a_mix(tmp_path):
    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    a = pack(folder(tmp_path / "x", {nfc: 3, "tea": 2}, "x"), tmp_path / "x.lmdb")
    b = pack(folder(tmp_path / "y", {nfd: 3, "tea": 2}, "y"), tmp_path / "y.wds")
    ds = packio.mix([a, b], resize=HW)
    assert sorted(ds.classes) == sorted([nfc, "tea"]), ds.classes


# -- 10. more joints: append x URL x workers, foreign x append, torchdata, even="pad" ---------------------

def test_append_to_a_served_wds_while_a_url_reader_streams_it(world, tmp_path):
    """A reader opened before an append keeps reading the version it opened, at a URL too."""
    served = world["root"] / "srv" / "e.wds"
    pack(folder(tmp_path / "e", {"ants": 6, "bees": 6}, "g"), served, shard_samples=2)
    want = {(0, k) for _, k in ((0, packio.open_dataset(str(served), decode=False).sample(i).key) for i in range(12))}
    ds = packio.open_dataset(f"{world['url']}/e.wds", iterable=True, resize=HW, cache_dir=str(tmp_path / "cache"),
                             even=None)
    dl = packio.DataLoader(ds, batch_size=2, num_workers=2, prefetch_factor=1)
    got = []
    for epoch in range(2):
        dl.set_epoch(epoch)
        part = []
        for b in dl:
            part += [(0, k, name(ds, c)) for k, c in zip(b["key"], b["label"].tolist())]
            if epoch == 0 and len(part) == 2:
                pack(folder(tmp_path / "e2", {"bees": 3, "wasps": 2}, "h"), served, append=True, shard_samples=2)
        check_once(part, want)
        got += part


def test_a_mix_source_appended_to_while_the_mix_streams(world, tmp_path):
    a2 = tmp_path / "a2.wds"
    pack(world["root"] / "a", a2, shard_samples=3)
    make = lambda: packio.mix([packio.open_dataset(str(a2), iterable=True, resize=HW),
                               opened(world, "c", tmp_path)], even=None)
    ds = make()
    want = {(0, packio.open_dataset(str(a2), decode=False).sample(i).key) for i in range(10)} | \
        {(1, packio.open_dataset(str(world["root"] / "srv" / "c.wds"), decode=False).sample(i).key) for i in range(9)}
    dl = packio.DataLoader(ds, batch_size=2, num_workers=2, prefetch_factor=1)
    got, state = [], None
    for b in dl:
        got += [(s, k, name(ds, c)) for s, k, c in zip(b["source"].tolist(), b["key"], b["label"].tolist())]
        if state is None:
            state = dl.state_dict()
            pack(folder(tmp_path / "more", {"cats": 2, "yaks": 2}, "w"), a2, append=True)
    check_once(got, want)
    with pytest.raises(packio.StateError):
        packio.DataLoader(make(), batch_size=2).load_state_dict(state)


def test_append_foreign_shards_with_odd_labels_to_a_labelled_lmdb(world, tmp_path):
    """MORE = a stranger's shards (numeric .cls, a text .cls, a .json label, no label, a name not
    UTF-8) appended to a cats/dogs LMDB: each stored sample's class NAME is the one its shard gave."""
    want = _foreign(tmp_path / "theirs")
    dst = tmp_path / "x.lmdb"
    pack(folder(tmp_path / "x", {"cats": 2, "dogs": 2}, "x"), dst)
    try:
        pack(tmp_path / "theirs", dst, append=True)
    except packio.PackioError as exc:  # refused as a whole is allowed (say why), never mislabelled
        assert "label" in str(exc)
        return
    ds = packio.open_dataset(str(dst), decode=False)
    for i in range(len(ds)):
        key = ds.sample(i).key
        got = name(ds, ds[i]["label"])
        assert got == (want[key] if key in want else cls_of(key)), (key, got)


def test_convert_append_from_an_http_wds_labels_by_name(world, tmp_path):
    dst = tmp_path / "grow.lmdb"
    pack(folder(tmp_path / "g", {"owls": 2, "fish": 2}, "k"), dst)
    packio.convert(world["b"], dst, append=True, progress=False)
    ds = packio.open_dataset(str(dst), decode=False)
    assert len(ds) == 4 + 15
    for i in range(len(ds)):
        assert name(ds, ds[i]["label"]) == cls_of(ds.sample(i).key), ds.sample(i).key


def test_torchdata_stateful_loader_resumes_a_mix_with_a_url_source(world, tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make():
        ds = a_mix(world, tmp_path, batch_size=3)
        return ds, StatefulDataLoader(ds, batch_size=3, num_workers=2, collate_fn=packio.collate)
    ds, dl = make()
    got, state = [], None
    for k, b in enumerate(dl):
        got += [(s, key, name(ds, c)) for s, key, c in zip(b["source"].tolist(), b["key"], b["label"].tolist())]
        if k == 2:
            state = dl.state_dict()
            break
    ds2, dl2 = make()
    dl2.load_state_dict(state)
    got += [(s, key, name(ds2, c)) for b in dl2 for s, key, c in zip(b["source"].tolist(), b["key"],
                                                                      b["label"].tolist())]
    check_once(got, all_keys(world))


def test_even_pad_on_a_mix_gives_every_rank_the_same_batches_and_repeats_under_world(world, tmp_path):
    per_rank = []
    for r in range(3):
        got, _, _ = take(a_mix(world, tmp_path, rank=r, world_size=3, even="pad"), num_workers=2)
        per_rank.append(got)
    assert len({len(g) for g in per_rank}) == 1
    counts = Counter((s, k) for g in per_rank for s, k, _ in g)
    assert set(counts) == all_keys(world) and sum(n - 1 for n in counts.values()) < 3


def test_a_url_source_re_uploaded_under_a_streaming_mix(world, tmp_path):
    """The HTTP .wds is re-packed where it is served while a mix streams it through workers:
    old data or DatasetReplacedError, never the new labels."""
    served = world["root"] / "srv" / "f.wds"
    src = folder(tmp_path / "old", {"cats": 8, "dogs": 8}, "u")
    pack(src, served, shard_samples=2)
    swapped = _swapped(src, tmp_path / "new")
    ds = packio.mix([packio.open_dataset(f"{world['url']}/f.wds", iterable=True, resize=HW,
                                         cache_dir=str(tmp_path / "cache")), opened(world, "a", tmp_path)], even=None)
    dl = packio.DataLoader(ds, batch_size=2, num_workers=1, prefetch_factor=1)
    got, raised = _stream_mix(ds, dl, lambda: pack(swapped, served, overwrite=True, shard_samples=2))
    wrong = [x for x in got if x[2] != cls_of(x[1])]
    assert not wrong, f"the re-pack's labels handed out: {wrong}"
    assert raised and raised[-1] == 1, raised


def test_map_style_url_wds_range_reads_after_a_re_upload_under_workers(world, tmp_path):
    served = world["root"] / "srv" / "g.wds"
    src = folder(tmp_path / "old", {"cats": 8, "dogs": 8}, "v")
    pack(src, served, shard_samples=2)
    swapped = _swapped(src, tmp_path / "new")
    ds = packio.open_dataset(f"{world['url']}/g.wds", resize=HW, cache_dir=str(tmp_path / "cache"))
    dl = packio.DataLoader(ds, batch_size=2, num_workers=1, prefetch_factor=1, shuffle=True)
    got = []
    with pytest.raises(packio.DatasetReplacedError):
        for epoch in range(2):
            for b in dl:
                got += [(0, k, name(ds, c)) for k, c in zip(b["key"], b["label"].tolist())]
                if len(got) == 2:
                    pack(swapped, served, overwrite=True, shard_samples=2)
    wrong = [x for x in got if x[2] != cls_of(x[1])]
    assert not wrong, f"the re-pack's labels handed out: {wrong}"


def test_foreign_shards_rewritten_under_a_streaming_mix(world, tmp_path):
    """Local shards another tool wrote, rewritten under a reader: DatasetReplacedError, never
    the new shard's samples under the old index (docs/remote.md)."""
    want = _foreign(tmp_path / "theirs")
    ds = packio.mix([packio.open_dataset(str(tmp_path / "theirs"), iterable=True, resize=HW),
                     opened(world, "c", tmp_path)], even=None)
    dl = packio.DataLoader(ds, batch_size=2, num_workers=1, prefetch_factor=1)
    def rewrite() -> None:  # a stranger re-writes their shards (each renamed in): other keys, labels
        _foreign_other(tmp_path / "next")
        for p in sorted((tmp_path / "next").iterdir()):
            p.replace(tmp_path / "theirs" / p.name)

    got, raised = _stream_mix(ds, dl, rewrite)
    foreign = [(k, c) for s, k, c in got if s == 0]
    assert all(k in want and want[k] == c for k, c in foreign), foreign
    assert raised and raised[-1] == 1, raised


def _foreign_other(dirpath: Path) -> None:
    dirpath.mkdir(parents=True)
    for s in range(2):
        with tarfile.open(dirpath / f"shard-{s:06d}.tar", "w") as tar:
            for k in range(3):
                for ext, data in ((".jpg", jpeg(HW, HW, 900 + k)), (".cls", b"9")):
                    info = tarfile.TarInfo(f"z{s}{k}{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def test_two_folders_whose_names_escape_alike_stay_two_classes(tmp_path):
    """A Latin-1 folder b'caf\\xe9' and a UTF-8 folder named 'caf\\xe9' (a backslash in it) are
    two folders: two classes (or a refusal naming them), never one class of both."""
    import os

    src = tmp_path / "src"
    latin = os.path.join(os.fsencode(src), b"caf\xe9")
    os.makedirs(latin)
    (src / "caf\\xe9").mkdir()
    for k in range(2):
        with open(os.path.join(latin, b"same%d.jpg" % k), "wb") as f:
            f.write(jpeg(HW, HW, k))
        (src / "caf\\xe9" / f"same{k}.jpg").write_bytes(jpeg(HW, HW, 40 + k))
    try:
        pack(src, tmp_path / "x.lmdb")
    except packio.PackioError:
        return
    ds = packio.open_dataset(str(tmp_path / "x.lmdb"), decode=False)
    keys = [ds.sample(i).key for i in range(len(ds))]
    assert len(set(keys)) == len(keys) == 4, f"two samples under one key: {keys}"
    assert len(ds.classes) == 2, f"two folders became one class: {ds.classes}"


def test_a_dataset_bigger_than_the_cache_limit_says_both_sizes(world, tmp_path):
    """A multi-part .wds at a URL is cached whole: a limit below it is refused, with figures a
    reader can tell apart."""
    total = sum(p.stat().st_size for p in Path(world["b_local"]).rglob("*") if p.is_file())
    with pytest.raises(packio.RemoteError) as exc:
        packio.open_dataset(world["b"], iterable=True, cache_dir=str(tmp_path), cache_limit=int(total * 0.8))
    import re

    msg = str(exc.value).split(world["b"])[-1]
    dataset, _, limit = msg.partition("limit")
    assert set(re.findall(r"\d[\d.,]*", dataset)) != set(re.findall(r"\d[\d.,]*", limit)), msg


def _sequence(ds: Any, **loader: Any) -> list[tuple[int, str]]:
    return [(s, k) for s, k, _ in take(ds, **loader)[0]]


def test_a_mix_with_replacement_resumed_on_another_world_draws_what_it_would_have(world, tmp_path):
    """With replacement a sample may come twice, so count the draws: stopped on 2 ranks and resumed
    on 3, the epoch's draws are the uninterrupted epoch's, as a multiset."""
    ref = Counter(_sequence(a_mix(world, tmp_path, replacement=True, epoch_samples=30)))
    got, state = [], None
    for r in range(2):
        part, st, _ = take(a_mix(world, tmp_path, replacement=True, epoch_samples=30, rank=r, world_size=2), stop=2,
                           num_workers=2)
        got += [(s, k) for s, k, _ in part]
        state = state or st
    for r in range(3):
        part, _, _ = take(a_mix(world, tmp_path, replacement=True, epoch_samples=30, rank=r, world_size=3),
                          state=state, num_workers=0)
        got += [(s, k) for s, k, _ in part]
    assert Counter(got) == ref


def test_a_nested_mix_with_a_url_source_resumed_on_another_world(world, tmp_path):
    def make(**kw: Any) -> Any:
        inner = packio.mix([opened(world, "c", tmp_path), opened(world, "d", tmp_path)], [1, 1], epoch_samples=10)
        return packio.mix([inner, opened(world, "a", tmp_path)], [1, 2], epoch_samples=30, even=None, **kw)
    ref = Counter(_sequence(make()))
    got, state = [], None
    for r in range(2):
        part, st, _ = take(make(rank=r, world_size=2), stop=1, num_workers=2)
        got += [(s, k) for s, k, _ in part]
        state = state or st
    part, _, _ = take(make(), state=state, num_workers=2)
    got += [(s, k) for s, k, _ in part]
    assert Counter(got) == ref
    ds = make()
    for s, k, c in take(ds)[0]:
        assert c == cls_of(k), (s, k, c)


def test_box_labels_by_name_across_an_append_and_a_mix(gen_folder, tmp_path):
    """gen_folder's CSV boxes (box_cats, box_dogs), an appended part whose CSV brings box_owls and
    box_dogs, mixed with a dataset whose box classes come in another order: every box's class NAME
    is the one its CSV row gave."""
    from conftest import TRUTH

    root, csv_path = gen_folder
    truth = {k: v[2] for k, v in TRUTH[str(root)].items()}
    dst = tmp_path / "x.wds"
    pack(root, dst, csv=csv_path)
    more = folder(tmp_path / "more", {"owls": 3}, "o")
    rows = ["filename,width,height,class,xmin,ymin,xmax,ymax"]
    for k in range(3):
        names = ["box_owls", "box_dogs"][: k + 1]
        rows += [f"oowls{k:02d}.jpg,{HW},{HW},{n},1,1,{8 + j},{9 + j}" for j, n in enumerate(names)]
        truth[f"owls/oowls{k:02d}.jpg"] = names
    (tmp_path / "more.csv").write_text("\n".join(rows) + "\n")
    pack(more, dst, append=True, csv=tmp_path / "more.csv")
    other = tmp_path / "y"
    folder(other, {"bats": 2}, "y")
    (tmp_path / "y.csv").write_text("filename,width,height,class,xmin,ymin,xmax,ymax\n"
                                    f"ybats00.jpg,{HW},{HW},box_zebra,1,1,5,5\nybats01.jpg,{HW},{HW},box_dogs,1,1,5,5\n")
    truth["bats/ybats00.jpg"], truth["bats/ybats01.jpg"] = ["box_zebra"], ["box_dogs"]
    y = pack(other, tmp_path / "y.lmdb", csv=tmp_path / "y.csv")
    ds = packio.mix([y, str(dst)], resize=HW, even=None)
    seen = 0
    for b in packio.DataLoader(ds, batch_size=4, num_workers=2):
        for key, bl in zip(b["key"], b["box_labels"]):  # packio.collate: one tensor per sample
            got = sorted(ds.box_classes[int(i)] for i in bl)
            assert got == sorted(truth[key]), (key, got, truth[key])
            seen += 1
    assert seen == len(ds)



def test_the_shard_pattern_packio_info_prints_for_an_appended_url_wds_opens_in_webdataset(world):
    """A stranger pastes the pattern `packio info URL` prints into webdataset.WebDataset: every
    sample of every part, once (docs/remote.md: 'ready for webdataset.WebDataset')."""
    import webdataset as wds

    info = subprocess.run([str(Path(packio.__file__).parents[1] / ".venv" / "bin" / "packio"), "info", world["b"]],
                          capture_output=True, text=True, timeout=60)
    line = next(x for x in info.stdout.splitlines() if x.startswith("shards:"))
    pattern = line.split("samples: ", 1)[1].strip()
    seen = Counter()
    try:
        for x in wds.WebDataset(pattern, shardshuffle=False, empty_check=False):
            seen[x["__key__"]] += 1
    except Exception as exc:  # noqa: BLE001 (what webdataset raises for a pattern it cannot read)
        pytest.fail(f"webdataset cannot read {pattern!r}: {type(exc).__name__}: {exc}")
    assert sorted(int(k) for k in seen) == list(range(15)), pattern


def test_converting_a_mix_packs_it_or_says_a_mix_is_no_source(world, tmp_path):
    """A careless user hands packio.convert the mix they train on: its samples packed, or an error
    about the mix, not 'no such file or folder' about an object's repr."""
    ds = a_mix(world, tmp_path)
    try:
        out = packio.convert(ds, tmp_path / "m.lmdb", progress=False).output
    except (packio.PackioError, TypeError) as exc:
        assert "no such file" not in str(exc) and "object at 0x" not in str(exc), str(exc)
        return
    assert len(packio.open_dataset(str(out))) == len(ds)


def test_an_appended_lmdb_uploaded_to_s3_mixed_with_http_one_cache_resumed(world, bucket, s3_server, tmp_path):
    """append -> 'packio convert LOCAL s3://... ' (the docs' way to grow a URL dataset) -> a mix of it and
    an HTTP .wds in one small cache, stopped on 2 ranks x 2 workers, resumed on 3 x 0: each sample once,
    labelled by name, the cache within its limit at the end."""
    url = f"s3://{bucket}/a.wds"
    packio.convert(world["a"], url, shard_samples=6, progress=False)
    cache = tmp_path / "cache"
    limit = 400_000

    def make(**kw: Any) -> Any:
        return packio.mix([packio.open_dataset(url, iterable=True, resize=HW, cache_dir=str(cache), cache_limit=limit),
                           packio.open_dataset(world["c"], iterable=True, resize=HW, cache_dir=str(cache),
                                               cache_limit=limit)], even=None, **kw)
    got, state = [], None
    for r in range(2):
        part, st, _ = take(make(rank=r, world_size=2), stop=2, num_workers=2)
        got, state = got + part, state or st
    for r in range(3):
        got += take(make(rank=r, world_size=3), state=state, num_workers=0)[0]
    check_once(got, all_keys(world, names=("a", "c")))
    assert _cache_bytes(cache) <= limit
