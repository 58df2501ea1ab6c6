"""Exactly once under real DDP: torchrun (gloo, CPU) runs the training loop of docs/training.md
(examples/resumable_training.py via tests/ddp_worker.py) and the keys each rank
trained on are counted here.

The session launches torchrun twice in all (tests/launches.py, shared with test_mix.py):
two ranks (the start-method / worker matrix, and the first leg of each resume), then three
ranks (the resumed legs), whose rank 0 then runs the one-rank legs in a process group of its
own (world size 1).
"""

from __future__ import annotations

import inspect
import json
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

import packio
from conftest import ROOT, jpeg

N = 201  # samples: odd, so two ranks need one sample of padding
BATCH = 8
CONTEXTS = ("fork", "spawn", "forkserver")


def _runs(out: Path, name: str, world: int) -> list[dict[str, list[list[str]]]]:
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(world)]


def _interleave(ranks: list[list[list[str]]]) -> list[str]:
    """The global sequence one uninterrupted leg dealt: position j*world + r is rank r's j-th sample."""
    flat = [[k for b in batches for k in b] for batches in ranks]
    assert len({len(f) for f in flat}) == 1, "ranks took different numbers of samples"
    return [f[j] for j in range(len(flat[0])) for f in flat]


def _check_padding(seq: list[str], real: int, world: int) -> None:
    """The documented padding: the first samples of the leg repeated to fill its last step."""
    assert len(seq) == -(-real // world) * world
    assert seq[real:] == seq[: len(seq) - real]


def _single_process_order(path: Path, iterable: bool, epoch: int) -> list[str]:
    """The epoch's global order as one process with no workers sees it."""
    if iterable:
        ds = packio.open_dataset(path, iterable=True, decode=False, shuffle=True, seed=0, world_size=1, rank=0)
        ds.set_epoch(epoch)
        return [x["key"] for x in ds]
    ds = packio.open_dataset(path, decode=False)
    s = packio.ResumableSampler(len(ds), seed=0, rank=0, world_size=1)
    s.set_epoch(epoch)
    return [ds.sample(i).key for i in s]


def _corrupt_lmdb_record(path: Path, i: int) -> str:
    import lmdb

    ds = packio.open_dataset(path, decode=False)
    key = ds.sample(i).key
    ds.reader.close()
    env = lmdb.open(str(path), subdir=True)
    with env.begin(write=True) as txn:
        value = txn.get(b"%010d" % i)
        n = int.from_bytes(value[:4], "little")
        txn.put(b"%010d" % i, (3).to_bytes(4, "little") + b"\xc1\xc1\xc1" + value[4 + n:])
    env.close()
    return key


def plans(work: Path) -> dict:
    """Packs the data under ``work`` and plans this module's scenarios for the session's
    launches (tests/launches.py): ``plans[world]``, the matrix and the legs of every resume."""
    src = work / "src"
    for c in range(3):
        (src / f"c{c}").mkdir(parents=True)
        for k in range(N // 3):
            (src / f"c{c}" / f"{k:03d}.jpg").write_bytes(jpeg(12, 16, c * 1000 + k))
    tar = Path(packio.convert(src, work / "d.wds", shard_samples=40, progress=False).output)
    bad = Path(packio.convert(src, work / "bad.lmdb", progress=False).output)
    corrupt = _corrupt_lmdb_record(bad, 57)
    keys = sorted(packio.open_dataset(tar, decode=False).sample(i).key for i in range(N))

    # Spawn runs with persistent workers only: without them its epoch 0 is the same packio work
    # (packio never reads persistent_workers: the dataset pickled through __getstate__ to fresh
    # workers, the split per rank and worker), and its epoch 1 (fresh workers again) is what
    # forkserver without persistent workers does; four interpreters importing torch per rank saved.
    matrix = [(kind, 0, None, False) for kind in ("map", "iterable")] + [
        (kind, 2, ctx, persistent) for kind in ("map", "iterable") for ctx in CONTEXTS for persistent in (False, True)
        if (ctx, persistent) != ("spawn", False)]
    scenarios = []
    for kind, workers, ctx, persistent in matrix:
        args = {"num_workers": workers}
        if workers:
            args.update(multiprocessing_context=ctx, persistent_workers=persistent)
        scenarios.append({"name": f"m-{kind}-{workers}-{ctx}-{persistent}", "path": str(tar), "epochs": 2,
                          "iterable": kind == "iterable", "batch_size": BATCH, "loader_args": args,
                          "checkpoint": str(work / f"ck-m-{kind}-{workers}-{ctx}-{persistent}.json"),
                          "dataset_args": {"decode": False}})
    rng = random.Random(10)
    legs: dict[str, list[dict]] = {}
    for kind in ("map", "iterable"):
        for data in ("clean", "skip"):
            for chain, worlds in (("a", (2, 3, 1)), ("b", (2, 1))):
                name = f"r-{kind}-{data}-{chain}"
                common = {"path": str(tar if data == "clean" else bad), "iterable": kind == "iterable",
                          "epochs": 3, "batch_size": 6, "checkpoint": str(work / f"ck-{name}.json"),
                          "dataset_args": {"decode": False, **({"on_error": "skip"} if data == "skip" else {})}}
                # chain a: stop in epoch 0 on 2 ranks, in epoch 1 on 3, finish on 1;
                # chain b: stop in epoch 1 on 2 ranks, finish on 1. Workers change every leg.
                stops = [[0, rng.randrange(1, 15)], [1, rng.randrange(1, 9)], None] if chain == "a" else \
                    [[1, rng.randrange(1, 15)], None]
                workers = [{"num_workers": 2, "multiprocessing_context": "fork"}, {"num_workers": 0},
                           {"num_workers": 1, "multiprocessing_context": "fork", "persistent_workers": True}]
                legs[name] = [{**common, "name": f"{name}-{leg}", "world": world, "stop": stop,
                               "loader_args": workers[leg if chain == "a" else 2 * leg]}
                              for leg, (world, stop) in enumerate(zip(worlds, stops))]
    by_world = {w: [leg for chain in legs.values() for leg in chain if leg["world"] == w] for w in (2, 3, 1)}
    return {"tar": tar, "bad": bad, "corrupt": corrupt, "keys": keys, "matrix": scenarios, "legs": legs,
            "plans": {**by_world, 2: scenarios + by_world[2]}, "state_check": str(tar)}


@pytest.fixture(scope="module")
def ddp(torchrun_launches):
    """This module's data and plans, and the session's launch folders by world size."""
    return {**torchrun_launches["ddp"], "outs": torchrun_launches["outs"], "out": torchrun_launches["outs"][2]}


def test_torchrun_matrix_every_sample_once_per_epoch(ddp):
    """2 ranks × {0, 2 workers} × {fork, spawn, forkserver} × {persistent or not; spawn: persistent}
    × {map-style + ResumableSampler, iterable}, two epochs: per epoch
    the ranks together read the dataset once, plus the one documented padding sample; the global
    order is the same whatever the workers, and set_epoch changes it (persistent workers included)."""
    orders: dict[tuple[str, int], list[str]] = {}
    for sc in ddp["matrix"]:
        ranks = _runs(ddp["out"], sc["name"], 2)
        assert all(sorted(r) == [str(e) for e in range(sc["epochs"])] for r in ranks), sc["name"]
        for epoch in range(sc["epochs"]):
            seq = _interleave([r[str(epoch)] for r in ranks])
            _check_padding(seq, N, 2)
            assert sorted(seq[:N]) == ddp["keys"], sc["name"]
            kind = "iterable" if sc["iterable"] else "map"
            orders.setdefault((kind, epoch), seq)
            assert seq == orders[kind, epoch], f"{sc['name']}: the order depends on the worker settings"
            assert len({len(b) for r in ranks for b in r[str(epoch)][:-1]}) == 1  # whole batches but the last
    for kind in ("map", "iterable"):
        assert orders[kind, 0] != orders[kind, 1], "set_epoch did not change the order"
        for epoch in (0, 1):  # and it is the order one process sees (it does not depend on the world size)
            assert orders[kind, epoch][:N] == _single_process_order(ddp["tar"], kind == "iterable", epoch)


def test_torchrun_state_is_the_same_on_every_rank(ddp):
    for r in range(2):  # and a sampler built before init_process_group() is caught, not silently unsplit
        assert "init_process_group" in (ddp["out"] / f"early.rank{r}.txt").read_text()
    for kind in ("iterable", "map"):
        states = json.loads((ddp["out"] / f"states-{kind}.json").read_text())
        assert states[0] == states[1] and states[0]["consumed"] == 3 * 4 * 2 and states[0]["world_size"] == 2


def test_torchrun_elastic_resume(ddp):
    """Stop at a random batch in epoch 0 and in epoch 1, resume from the JSON checkpoint in a fresh
    process group with another world size (2→3→1, 2→1) and other num_workers: per epoch, the legs
    together train on every sample exactly once (plus the last leg's padding). With a corrupt
    sample and on_error="skip", every other sample exactly once."""
    legs, outs = ddp["legs"], ddp["outs"]
    for name, chain in legs.items():
        skip = "skip" in name
        want = [k for k in ddp["keys"] if not (skip and k == ddp["corrupt"])]
        runs = [_runs(outs[leg["world"]], leg["name"], leg["world"]) for leg in chain]
        for epoch in ("0", "1", "2"):  # 2: a whole epoch after a resumed one, on persistent workers
            per_leg = [[r.get(epoch, []) for r in ranks] for ranks in runs if any(epoch in r for r in ranks)]
            *before, last = per_leg  # the legs that stopped inside this epoch, and the one that ended it
            counts = Counter(k for ranks in per_leg for batches in ranks for b in batches for k in b)
            assert sorted(counts) == want, f"{name} epoch {epoch}: lost or foreign samples"
            extra = [k for k, c in counts.items() for _ in range(c - 1)]
            pad_room = {k for batches in last for k in batches[-1]}  # the final step of the epoch
            assert len(extra) < len(last) and set(extra) <= pad_room, f"{name} epoch {epoch}: {extra} repeated"
            if not skip:  # exact: the legs continue one global sequence, the single-process order
                seq = [k for ranks in before for k in _interleave(ranks)]
                tail = _interleave(last)
                _check_padding(tail, N - len(seq), len(last))
                assert seq + tail[: N - len(seq)] == _single_process_order(ddp["tar"], "iterable" in name,
                                                                           int(epoch)), name
    assert any(leg["stop"] and leg["stop"][0] == 0 for chain in legs.values() for leg in chain)


def test_docs_training_loop_is_the_tested_one():
    sys.path.insert(0, str(ROOT / "examples"))
    from resumable_training import train

    page = (ROOT / "docs" / "training.md").read_text()  # tests/test_docs.py runs its blocks
    assert inspect.getsource(train) in page
