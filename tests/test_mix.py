"""packio.mix: several datasets streamed by weight, resumable exactly on any world size.

Samples are counted as (source, key): the sources' keys are distinct (a…, b…, c…), so
a sample handed out under the wrong source, or twice, shows."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import packio
from conftest import jpeg
from mix_worker import build
from packio.read.mix import Plan, shares

SOURCES = (("a", 30, "wds", (12, 16)), ("b", 20, "lmdb", (20, 10)), ("c", 12, "wds", (9, 9)))
WEIGHTS = [0.5, 0.3, 0.2]


def pack(root: Path, name: str, n: int, fmt: str, hw: tuple[int, int], out: Path | None = None) -> str:
    src = root / f"src-{name}" / "x"
    if not src.exists():
        src.mkdir(parents=True)
        for k in range(n):
            (src / f"{name}{k:03d}.jpg").write_bytes(jpeg(*hw, 100 * ord(name) + k))
    target = out or root / f"{name}.{fmt}"
    return str(packio.convert(src.parent, target, shard_samples=8, progress=False).output)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("mix")
    return [pack(root, *spec) for spec in SOURCES]


def keys_of(paths: list[str], lengths=tuple(n for _, n, _, _ in SOURCES)) -> list[set[str]]:
    """Each source's keys (its first ``lengths[s]`` samples)."""
    opened = [packio.open_dataset(p, decode=False) for p in paths]
    return [{ds.sample(i).key for i in range(n)} for ds, n in zip(opened, lengths)]


def _once_per_source_epoch(epochs: list[list[tuple[int, str]]], keys: list[set[str]]) -> list[list[list[str]]]:
    """Asserts that each source's draws, read on across the mix epochs, are its own keys,
    none twice within one of its source epochs; returns each source's source epochs."""
    out = []
    for s, want in enumerate(keys):
        drawn = [k for seq in epochs for src, k in seq if src == s]
        chunks = [drawn[a:a + len(want)] for a in range(0, len(drawn), len(want))]
        for chunk in chunks:
            assert len(set(chunk)) == len(chunk) and set(chunk) <= want, f"source {s}: repeat or foreign key"
        out.append(chunks)
    return out


def run_epochs(ds, epochs: int) -> list[list[tuple[int, str]]]:
    out = []
    for e in range(epochs):
        ds.set_epoch(e)
        out.append([(x["source"], x["key"]) for x in ds])
    return out


def test_shares_are_the_weights_largest_remainder_rounded():
    for weights, total in (([1, 1, 1], 100), ([0.5, 0.3, 0.2], 101), ([0.7, 0.2, 0.1], 7), ([5, 0, 1], 13)):
        counts = shares(weights, [10, 10, 10], total)
        assert sum(counts) == total
        exact = np.asarray(weights, float) / sum(weights) * total
        assert np.all(np.abs(np.asarray(counts) - exact) < 1), (weights, counts)
    assert shares(None, [3, 5, 0], None) == [3, 5, 0]  # default: each source's length
    for bad in ([1, -1, 1], [0, 0, 0], [1, float("nan"), 1], [1, 1]):
        with pytest.raises(ValueError):
            shares(bad, [10, 10, 10], 30)
    with pytest.raises(ValueError, match="hold no samples"):
        shares([1, 1, 1], [10, 0, 10], 30)


def test_per_epoch_counts_match_weights_and_each_source_sample_once_per_source_epoch(paths):
    """Every mix epoch draws exactly its share from each source; a source's draws, read on
    across mix epochs, cover all its samples once per source epoch, reshuffled each time."""
    keys = keys_of(paths)
    epochs = run_epochs(packio.mix(paths, WEIGHTS, epoch_samples=100, seed=3, decode=False), 3)
    for seq in epochs:
        assert Counter(s for s, _ in seq) == {0: 50, 1: 30, 2: 20}
    for s, (want, chunks) in enumerate(zip(keys, _once_per_source_epoch(epochs, keys))):
        full = [c for c in chunks if len(c) == len(want)]
        assert len(full) >= 3 and len({tuple(c) for c in full}) == len(full), f"source {s} was not reshuffled"
    assert epochs[0] != epochs[1]
    again = run_epochs(packio.mix(paths, WEIGHTS, epoch_samples=100, seed=3, decode=False), 3)
    assert again == epochs  # a pure function of (seed, epoch)
    other = run_epochs(packio.mix(paths, WEIGHTS, epoch_samples=100, seed=4, decode=False), 1)
    assert other[0] != epochs[0]


def test_default_weights_read_every_sample_once_and_replacement_repeats(paths):
    keys = keys_of(paths)
    for seq in run_epochs(packio.mix(paths, decode=False), 2):
        assert sorted(seq) == sorted((s, k) for s, ks in enumerate(keys) for k in ks)
    seq = run_epochs(packio.mix(paths, WEIGHTS, epoch_samples=100, replacement=True, decode=False), 1)[0]
    assert Counter(s for s, _ in seq) == {0: 50, 1: 30, 2: 20}
    assert all(k in keys[s] for s, k in seq)
    assert len(set(seq)) < len(seq)  # 50 picks from 30 samples: repeats, as said


def test_mixed_batches_one_shape_with_resize_and_right_pixels(paths):
    """A batch draws from several sources of different image sizes: with resize it is one
    [B, C, H, W] tensor; every row is its own source's sample (pixels, label, index, key)."""
    ds = packio.mix(paths, WEIGHTS, epoch_samples=40, resize=(8, 8))
    own = [packio.open_dataset(p, resize=(8, 8)) for p in paths]
    sources_seen = set()
    for b in packio.DataLoader(ds, batch_size=10, num_workers=2, multiprocessing_context="fork"):
        assert isinstance(b["image"], torch.Tensor) and b["image"].shape == (10, 3, 8, 8)
        assert b["source"].dtype == torch.int64 and len(b["boxes"]) == 10
        sources_seen |= set(b["source"].tolist())
        for j, (s, i) in enumerate(zip(b["source"].tolist(), b["index"].tolist())):
            item = own[s][i]
            assert item["key"] == b["key"][j] and item["label"] == b["label"][j]
            assert torch.equal(item["image"], b["image"][j])
    assert sources_seen == {0, 1, 2}
    # without resize the shapes differ: the batch's images are a list, each its own size
    b = next(iter(packio.DataLoader(packio.mix(paths, WEIGHTS, epoch_samples=40), batch_size=10)))
    assert isinstance(b["image"], list) and len({tuple(im.shape) for im in b["image"]}) > 1
    for s, im in zip(b["source"].tolist(), b["image"]):
        assert tuple(im.shape[1:]) == SOURCES[s][3]
    items = list(packio.mix(paths, WEIGHTS, epoch_samples=4, decode=False))
    assert all(x["source"] in (0, 1, 2) for x in items)


def _leg(paths, state, world: int, workers: int, stop: tuple[int, int] | None, epochs: int, make=None):
    """One job on ``world`` simulated ranks (each a packio.DataLoader with real worker processes),
    stepping together; stops before batch ``stop[1]`` of epoch ``stop[0]``. Returns the global
    sequence per epoch (the ranks' samples interleaved) and the state saved last. ``make(rank,
    world)``: the mix of a rank (default: ``paths`` by WEIGHTS, 70 a epoch)."""
    loaders = []
    for r in range(world):
        ds = make(r, world) if make else packio.mix(paths, WEIGHTS, epoch_samples=70, seed=1, decode=False, rank=r,
                                                    world_size=world)
        args = {"num_workers": workers, "multiprocessing_context": "fork"} if workers else {}
        loaders.append(packio.DataLoader(ds, batch_size=4, **args))
        if state is not None:
            loaders[-1].load_state_dict(state)
    got: dict[int, list] = {}
    for epoch in range(loaders[0].epoch, epochs):
        for ld in loaders:
            ld.set_epoch(epoch)
        for k, batches in enumerate(zip(*loaders)):
            if stop == (epoch, k):
                return got, state
            ranks = [list(zip(b["source"].tolist(), b["key"])) for b in batches]
            got.setdefault(epoch, []).extend(x for step in zip(*ranks) for x in step)
            states = [ld.state_dict() for ld in loaders]
            assert all(s == states[0] for s in states), "ranks disagree on the state"
            state = states[0]
    return got, state


def test_resume_2_3_1_ranks_other_workers_is_the_uninterrupted_sequence(paths):
    whole, _ = _leg(paths, None, 1, 0, None, 2)
    assert [len(whole[e]) for e in (0, 1)] == [70, 70]
    legs = ((2, 2, (0, 5)), (3, 1, (1, 3)), (1, 2, None))
    state, seqs = None, {0: [], 1: []}
    for world, workers, stop in legs:
        got, state = _leg(paths, state, world, workers, stop, 2)
        for e, seq in got.items():
            seqs[e].extend(seq)
        assert state["world_size"] == world
    for e in (0, 1):
        assert seqs[e] == whole[e], f"epoch {e}: the resumed legs differ from the uninterrupted run"
    pos = state["sources"]  # after the last epoch: each source's draws are its counts times the epochs
    assert [p["draws"] for p in pos] == [2 * c for c in shares(WEIGHTS, [30, 20, 12], 70)]


def test_weights_of_any_finite_scale_share_exactly(paths):
    """Shares are computed in integers: weights near the float limit, subnormal ones and huge
    integers give the same exact shares (before: 1e308 overflowed and an epoch held 3 samples)."""
    for weights in ([1e308, 1e308, 1e308], [5e-324] * 3, [2**80, 2**80, 2**80], [1.7e308, 1.7e308, 1.7e308]):
        assert shares(weights, [30, 20, 12], 50) == [17, 17, 16], weights
    assert shares([1e308, 5e-324, 0], [30, 20, 12], 50) == [50, 0, 0]
    assert shares([1, 1e-300, 0], [30, 20, 12], 7) == [7, 0, 0]
    seq = run_epochs(packio.mix(paths, [1e308, 1e308, 1e308], epoch_samples=50, decode=False), 1)[0]
    assert Counter(s for s, _ in seq) == {0: 17, 1: 17, 2: 16}


@pytest.mark.parametrize("counts", [[500, 300, 200], [1, 2_047, 3], [5, 0, 4_000], [1] * 1_100 + [900]])
def test_the_plan_draws_each_share_once_in_order(counts):
    """Every position of a mix epoch has one source, each source exactly its count, and the draws of
    a source before each position are 0, 1, 2, ... in the epoch's order (more sources than a chunk too)."""
    plan = Plan(counts, seed=7)
    n = sum(counts)
    for epoch in (0, 3):
        src, drawn = plan.locate(epoch, np.arange(n, dtype=np.int64))
        assert np.bincount(src, minlength=len(counts)).tolist() == counts
        for s in np.unique(src).tolist():
            assert drawn[src == s].tolist() == list(range(counts[s]))
        for consumed in (0, 1, n // 3, n - 1, n):
            assert plan.taken(epoch, consumed) == np.bincount(src[:consumed], minlength=len(counts)).tolist()
        part = np.array([n - 1, 0, n // 2, n // 2 + 1], np.int64)  # any positions, any order: the same answers
        assert [a.tolist() for a in plan.locate(epoch, part)] == [src[part].tolist(), drawn[part].tolist()]
    assert plan.locate(0, np.arange(n))[0].tolist() != plan.locate(1, np.arange(n))[0].tolist()


def test_a_huge_mix_epoch_costs_per_batch_not_per_epoch(tmp_path):
    """A 5-sample source mixed with a 200-sample one over 10 million samples an epoch: the first
    batch, and one near the end of the epoch, take little memory (before: arrays of the epoch's
    length, and 240 s before the first batch); every stretch of the epoch holds the shares."""
    import tracemalloc

    small, big = pack(tmp_path, "s", 5, "lmdb", (8, 8)), pack(tmp_path, "t", 200, "wds", (8, 8))
    tracemalloc.start()
    ds = packio.mix([small, big], epoch_samples=10**7, seed=1, decode=False)
    first = next(iter(packio.DataLoader(ds, batch_size=64)))
    ds.load_state_dict({**ds.state_dict(), "consumed": 10**7 - 100, "sources": ds.positions(0, 10**7 - 100)})
    late = [b for b in packio.DataLoader(ds, batch_size=64)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MiB traced for two batches"
    assert len(first["key"]) == 64 and sum(len(b["key"]) for b in late) == 100
    assert [p["draws"] for p in ds.positions(0, 10**7)] == shares(None, [5, 200], 10**7)
    src = ds.mix.planner.locate(0, np.arange(5 * 10**6, 5 * 10**6 + 3_000, dtype=np.int64))[0]
    assert abs(int((src == 0).sum()) - 3_000 * 5 / 205) <= 3  # any 3,000 positions: within a chunk's rounding


def _classes_of(root: Path, name: str, classes: list[str], n: int) -> str:
    """A dataset of ``n`` tiny JPEGs spread over class folders ``classes``."""
    src = root / f"src-{name}"
    for k in range(n):
        (src / classes[k % len(classes)]).mkdir(parents=True, exist_ok=True)
        (src / classes[k % len(classes)] / f"{name}{k:03d}.jpg").write_bytes(jpeg(8, 8, k))
    return str(packio.convert(src, root / f"{name}.lmdb", progress=False).output)


def test_one_class_list_for_the_whole_mix(tmp_path):
    """A mix's labels are ids of one class list, the union of its sources' names (first seen first):
    ids are unique and each names the sample's own class; nested mixes too (before: a list per
    source, and 0 was both c1 and daisy)."""
    a = _classes_of(tmp_path, "a", ["c1", "c2"], 6)
    b = _classes_of(tmp_path, "b", ["c2", "daisy", "rose"], 9)
    truth = {}
    for path in (a, b):
        own = packio.open_dataset(path, decode=False)
        truth.update({own.sample(i).key: own.classes[own.sample(i).label] for i in range(len(own))})
    inner = packio.mix([b, a], decode=False)
    ds = packio.mix([a, inner, b], decode=False, epoch_samples=40)
    assert ds.classes == ["c1", "c2", "daisy", "rose"] and len(set(ds.classes)) == len(ds.classes)
    assert inner.classes == ["c2", "daisy", "rose", "c1"]
    assert ds.class_map == [[0, 1], [1, 2, 3, 0], [1, 2, 3]]
    got = [(x["key"], x["label"]) for x in ds] + [
        (k, int(lab)) for batch in packio.DataLoader(ds, batch_size=8) for k, lab in zip(batch["key"], batch["label"])]
    assert len(got) == 80 and {truth[k] for k, _ in got} == {"c1", "c2", "daisy", "rose"}
    assert all(ds.classes[label] == truth[key] for key, label in got)


def _nested(a: str, d: str) -> list:
    """Two mixes deep: an inner mix of ``a`` and ``d`` in a middle one with ``d``, beside ``a``."""
    inner = {"mix": [a, d], "weights": [2, 1], "epoch_samples": 18, "seed": 4}
    return [{"mix": [inner, d], "weights": [1, 1], "epoch_samples": 30, "seed": 5}, a]


def test_nested_mixes_stream_count_and_resume_on_other_world_sizes(paths):
    """mix([mix([mix([a, d]), d]), a]) is a source like any other: each epoch takes its shares at
    every level, a state nests its sources' positions, and it resumes on 2 then 1 ranks into the
    uninterrupted sequence (before: AttributeError '_Sources' object has no attribute 'reader')."""
    spec = _nested(paths[0], paths[2])

    def make(rank: int, world: int) -> packio.MixedDataset:
        return build(spec, [2, 1], epoch_samples=45, seed=9, rank=rank, world_size=world)

    keys = keys_of(paths)
    whole, _ = _leg(paths, None, 1, 0, None, 2, make)
    for e in (0, 1):
        assert Counter(s for s, _ in whole[e]) == {0: 30, 1: 15}
        assert all(k in (keys[0] | keys[2] if s == 0 else keys[0]) for s, k in whole[e])
    state, seqs = None, {0: [], 1: []}
    for world, workers, stop in ((2, 0, (0, 3)), (3, 2, (1, 1)), (1, 2, None)):
        got, state = _leg(paths, state, world, workers, stop, 2, make)
        for e, seq in got.items():
            seqs[e].extend(seq)
    assert seqs == whole
    middle = state["sources"][0]
    assert middle["draws"] == 60 and [p["draws"] for p in middle["sources"]] == [30, 30]
    inner = middle["sources"][0]  # 30 draws of an 18-sample epoch: at 12 of its epoch 1, its sources drew 30
    assert (inner["epoch"], inner["position"]) == (1, 12) and sum(p["draws"] for p in inner["sources"]) == 30


def _state_after(ds, batches: int) -> dict:
    loader = packio.DataLoader(ds, batch_size=4)
    for k, _ in enumerate(loader):
        if k + 1 == batches:
            return loader.state_dict()
    raise AssertionError("too few batches")


def test_a_state_from_another_mix_is_a_state_error(paths, tmp_path):
    def make(srcs=paths, weights=WEIGHTS, **kw):
        return packio.mix(srcs, weights, **{"epoch_samples": 60, "seed": 2, "decode": False, **kw})

    state = _state_after(make(), 3)
    ok = make()
    ok.load_state_dict(state)  # the same mix: fine, and it continues after the 12 samples
    assert ok.state_dict()["consumed"] == 12
    other_data = pack(tmp_path, "c", 12, "wds", (9, 9), out=tmp_path / "c2.wds")  # same files, another dataset
    others = {"weights": make(weights=[0.4, 0.4, 0.2]), "seed": make(seed=3), "epoch_samples": make(epoch_samples=61),
              "replacement": make(replacement=True), "order": make(srcs=[paths[1], paths[0], paths[2]]),
              "fewer": make(srcs=paths[:2], weights=WEIGHTS[:2]), "dataset": make(srcs=[*paths[:2], other_data]),
              "window": make(window=4)}
    for name, ds in others.items():
        with pytest.raises(packio.StateError):
            ds.load_state_dict(state)
        assert ds.state_dict()["consumed"] == 0, name
    older = {**state, "mix": {k: v for k, v in state["mix"].items() if k != "version"}}  # saved by packio <= 0.1
    with pytest.raises(packio.StateError, match="older packio"):
        make().load_state_dict(older)
    tampered = {**state, "sources": [{**state["sources"][0], "draws": 0}, *state["sources"][1:]]}
    with pytest.raises(packio.StateError, match="source positions"):
        make().load_state_dict(tampered)
    single = packio.open_dataset(paths[0], iterable=True, shuffle=True, decode=False)
    with pytest.raises(packio.StateError, match="mix"):
        single.load_state_dict(state)
    with pytest.raises(packio.StateError):
        make().load_state_dict(_state_after(single, 2))


def _same_sequence(local: list, remote: list, workers: int = 2) -> None:
    def seq(srcs):
        ds = packio.mix(srcs, WEIGHTS, epoch_samples=50, seed=5, decode=False)
        out = []
        for b in packio.DataLoader(ds, batch_size=5, num_workers=workers, multiprocessing_context="fork"):
            out += list(zip(b["source"].tolist(), b["key"]))
        return out

    assert seq(remote) == seq(local)


def test_one_source_over_http(paths, http_server, tmp_path, monkeypatch):
    """A source read from an HTTP server (streamed shards, planned per source in each worker)
    mixes exactly as the same dataset read locally; a state moves between the two (and to a
    mix given the URL itself)."""
    served = pack(Path(paths[2]).parent, "c", 12, "wds", (9, 9), out=http_server.root / "c.wds")
    url = packio.open_dataset(f"{http_server.url}/c.wds", cache_dir=tmp_path / "cache", decode=False)
    _same_sequence([*paths[:2], served], [*paths[:2], url])
    state = _state_after(packio.mix([*paths[:2], served], WEIGHTS, epoch_samples=50, decode=False), 2)
    packio.mix([*paths[:2], url], WEIGHTS, epoch_samples=50, decode=False).load_state_dict(state)
    monkeypatch.setenv("PACKIO_CACHE_DIR", str(tmp_path / "cache2"))
    by_url = packio.mix([*paths[:2], f"{http_server.url}/c.wds"], WEIGHTS, epoch_samples=50, decode=False)
    by_url.load_state_dict(state)
    assert by_url.state_dict() == {**state, "mix": by_url.state_dict()["mix"],
                                   "sources": by_url.state_dict()["sources"]}
    assert [p["draws"] for p in by_url.state_dict()["sources"]] == [p["draws"] for p in state["sources"]]


def test_one_source_on_s3(paths, bucket, s3_server, tmp_path):
    """The same folder packed locally and to a bucket mixes into the same sequence."""
    local = pack(Path(paths[1]).parent, "b", 20, "wds", (20, 10), out=tmp_path / "b.wds")
    packio.convert(Path(paths[1]).parent / "src-b", f"s3://{bucket}/b.wds", shard_samples=8, progress=False)
    remote = packio.open_dataset(f"s3://{bucket}/b.wds", cache_dir=tmp_path / "cache", decode=False)
    _same_sequence([paths[0], local, paths[2]], [paths[0], remote, paths[2]])


def _interleave(ranks: list[list[list]]) -> list[tuple[int, str]]:
    flat = [[tuple(x) for b in batches for x in b] for batches in ranks]
    assert len({len(f) for f in flat}) == 1, "ranks took different numbers of samples"
    return [f[j] for j in range(len(flat[0])) for f in flat]


MIX_LEGS = ((2, 2, [0, 3]), (3, 0, [1, 2]), (1, 1, None))  # (ranks, num_workers, stop) of each leg
MIX_LENGTHS = (16, 14, 13)  # local packed, foreign shards over HTTP, packed on S3: 60 = 30 + 18 + 12 draws each epoch


def _foreign_shards(folder: Path, n: int) -> str:
    """``n`` samples (JPEG + .cls) in three tar shards written by ``webdataset.TarWriter``,
    no packio.json; returns the brace pattern of their names."""
    import webdataset as wds

    folder.mkdir(parents=True)
    for s in range(3):
        with wds.TarWriter(str(folder / f"shard-{s:06d}.tar")) as sink:
            for k in range(s, n, 3):
                sink.write({"__key__": f"b{k:03d}", "jpg": jpeg(8, 8, 9000 + k), "cls": k % 2})
    return "shard-{000000..000002}.tar"


def plans(work: Path, servers: dict) -> dict:
    """This module's legs for the session's torchrun launches (tests/launches.py): a mix of a
    local packed dataset, foreign WebDataset shards on the HTTP server (a brace-pattern URL)
    and a packed dataset on the S3 server, and a mix nested two deep of local datasets:
    ``plans[world]``, the sources, and the nested mix (``nest``)."""
    work.mkdir(parents=True)
    local = pack(work, "a", MIX_LENGTHS[0], "lmdb", (8, 8))
    nest = {"mix": True, "sources": _nested(local, pack(work, "d", 10, "wds", (8, 8))), "weights": [2, 1],
            "epoch_samples": 45, "seed": 9, "batch_size": 4, "epochs": 2, "checkpoint": str(work / "nest.json")}
    nested = {world: [{**nest, "name": f"nest-w{world}", "num_workers": workers, "stop": stop}]
              for world, workers, stop in MIX_LEGS}
    if "skip" in servers:
        return {"skip": servers["skip"], "nest": nest, "plans": nested}
    http, s3 = servers["http"], servers["s3"]
    pattern = _foreign_shards(http.root / "mix-b", MIX_LENGTHS[1])
    s3.make_bucket("torchrun-mix")
    pack(work, "c", MIX_LENGTHS[2], "wds", (16, 16), out="s3://torchrun-mix/c.wds")
    paths = [local, f"{http.url}/mix-b/{pattern}", "s3://torchrun-mix/c.wds"]
    common = {"mix": True, "sources": paths, "weights": WEIGHTS, "epoch_samples": 60, "seed": 7, "batch_size": 4,
              "epochs": 2, "checkpoint": str(work / "ck.json")}
    return {"paths": paths, "nest": nest,
            "plans": {world: [{**common, "name": f"mix-w{world}", "num_workers": workers, "stop": stop}, *nested[world]]
                      for world, workers, stop in MIX_LEGS}}


def _ranks_sequence(outs: dict, name: str) -> dict[str, list]:
    """Each epoch's global sequence of the legs named ``name``-w{world}, the ranks interleaved."""
    import json

    seqs: dict[str, list] = {"0": [], "1": []}
    for world, _, _ in MIX_LEGS:
        ranks = [json.loads((outs[world] / f"{name}-w{world}.rank{k}.json").read_text()) for k in range(world)]
        for e in seqs:
            if any(e in rk for rk in ranks):
                seqs[e] += _interleave([rk.get(e, []) for rk in ranks])
    return seqs


def test_torchrun_nested_mix_resumes_on_other_world_sizes(torchrun_launches):
    """Real processes: a mix nested two deep, stopped on 2 ranks, resumed on 3 (other num_workers),
    finished on 1: each epoch takes the outer shares exactly and is the uninterrupted sequence."""
    mix, outs = torchrun_launches["mix"], torchrun_launches["outs"]
    nest = mix["nest"]
    seqs = _ranks_sequence(outs, "nest")
    whole = run_epochs(build(nest["sources"], nest["weights"], epoch_samples=45, seed=9), 2)
    for e in (0, 1):
        assert Counter(s for s, _ in seqs[str(e)]) == {0: 30, 1: 15}, f"epoch {e}: not the weights' shares"
        assert [tuple(x) for x in seqs[str(e)]] == whole[e], f"epoch {e}"


def test_torchrun_resume_2_3_1_ranks_other_workers(torchrun_launches, tmp_path, monkeypatch):
    """Real processes: torchrun on 2 ranks stops mid epoch 0, on 3 ranks (other num_workers)
    stops mid epoch 1, on 1 rank finishes, over a local source, foreign shards over HTTP and a
    dataset on S3; together they are the uninterrupted sequence (read here from the same
    URLs), each epoch takes each source's share, each source's samples once per source epoch."""
    mix, outs = torchrun_launches["mix"], torchrun_launches["outs"]
    if "skip" in mix:
        pytest.skip(mix["skip"])
    paths = mix["paths"]
    assert paths[1].startswith("http://127.0.0.1:") and "{" in paths[1] and paths[2].startswith("s3://")
    seqs = _ranks_sequence(outs, "mix")
    counts = shares(WEIGHTS, list(MIX_LENGTHS), 60)
    for e in seqs:
        assert Counter(s for s, _ in seqs[e]) == dict(enumerate(counts)), f"epoch {e}: not the weights' shares"
    monkeypatch.setenv("PACKIO_CACHE_DIR", str(tmp_path / "cache"))  # read from the servers again, not the ranks' cache
    keys = keys_of(paths, MIX_LENGTHS)
    assert [len(k) for k in keys] == list(MIX_LENGTHS)
    _once_per_source_epoch([seqs["0"], seqs["1"]], keys)
    whole = run_epochs(packio.mix(paths, WEIGHTS, epoch_samples=60, seed=7, decode=False), 2)
    for e in (0, 1):
        assert seqs[str(e)] == whole[e], f"epoch {e}"


def test_convert_refuses_a_mix_and_packs_an_opened_dataset(paths, tmp_path):
    """packio.convert given the mix one trains on says what to do (before: 'no such file or
    folder' about the object's repr); given an opened dataset, it packs its stored samples."""
    with pytest.raises(packio.SourceError, match="a mix .* no source to convert") as exc:
        packio.convert(packio.mix(paths[:2], resize=8), tmp_path / "m.lmdb", progress=False)
    assert "object at 0x" not in str(exc.value) and not (tmp_path / "m.lmdb").exists()
    for k, ds in enumerate((packio.open_dataset(paths[1], resize=8), packio.open_dataset(paths[1], iterable=True))):
        out = packio.convert(ds, tmp_path / f"b{k}.wds", progress=False, workers=0).output
        got = packio.open_dataset(str(out), decode=False)
        assert [got.sample(i).key for i in range(len(got))] == [ds.sample(i).key for i in range(len(ds))]
    with pytest.raises(packio.SourceError, match="cannot convert a int"):
        packio.convert(3, tmp_path / "n.lmdb", progress=False)
