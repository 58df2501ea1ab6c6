"""In one process: the stock torch DataLoader and torchdata's StatefulDataLoader over
packio datasets, resume states, and argument validation. (Real ranks: test_ddp.py.)"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader, default_collate

import packio
from packio import decode as dec
from packio.formats import formats
from conftest import jpeg

SUFFIX = {name: spec.suffixes[0] for name, spec in formats().items()}
FIXED = {"arrays": dec.ResizeSpec(size=(12, 14)), "bmp": dec.ResizeSpec(size=(12, 14))}


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> dict[str, Path]:
    """Every format, 30 samples in 3 classes, no boxes (so default_collate applies)."""
    root = tmp_path_factory.mktemp("resume")
    src = root / "src"
    for c in range(3):
        (src / f"c{c}").mkdir(parents=True)
        for k in range(10):
            (src / f"c{c}" / f"{k}.jpg").write_bytes(jpeg(10 + k, 16, 100 * c + k))
    return {fmt: Path(packio.convert(src, root / f"d{SUFFIX[fmt]}", resize=FIXED.get(fmt), shard_samples=7,
                                     progress=False).output) for fmt in sorted(formats())}


def _keys(loader) -> list[str]:
    return [k for b in loader for k in b["key"]]


@pytest.mark.parametrize("fmt", sorted(formats()))
def test_stock_torch_dataloader_map_style(packed, fmt):
    """torch's own DataLoader: __getitems__ gives a list of samples, so default_collate and
    packio.collate both work, with and without resize, in the main process and in workers."""
    path = packed[fmt]
    ds = packio.open_dataset(path, resize=(9, 11))
    got = ds.__getitems__([3, 0, 7])
    assert len(got) == 3 and [x["index"] for x in got] == [3, 0, 7]  # list-like: a packio Batch
    for a, i in zip(got, [3, 0, 7]):
        assert torch.equal(a["image"], ds[i]["image"]) and a["key"] == ds[i]["key"]
    want = {ds.sample(i).key: ds[i]["image"] for i in range(len(ds))}
    for collate_fn in (default_collate, packio.collate):
        for workers in (0, 2):
            kw = {"multiprocessing_context": "fork"} if workers else {}
            seen = []
            for b in TorchLoader(ds, batch_size=4, shuffle=True, num_workers=workers, collate_fn=collate_fn, **kw):
                assert b["image"].shape[1:] == (3, 9, 11)
                for k, img in zip(b["key"], b["image"]):
                    assert torch.equal(img, want[k])
                seen += b["key"]
            assert sorted(seen) == sorted(want)
    plain = packio.open_dataset(path)  # no resize: stored sizes (one shape only for the fixed formats)
    batches = list(TorchLoader(plain, batch_size=5, collate_fn=packio.collate))
    assert sum(len(b["key"]) for b in batches) == len(plain)
    if fmt in FIXED:
        assert all(b["image"].shape[1:] == (3, 12, 14) for b in batches)
        assert default_collate(plain.__getitems__([0, 1]))["image"].shape == (2, 3, 12, 14)


def test_decode_false_on_raw_pixels_is_chw(packed):
    ds = packio.open_dataset(packed["arrays"], decode=False)
    b = next(iter(packio.DataLoader(ds, batch_size=4)))
    assert b["image"].shape == (4, 3, 12, 14)
    assert torch.equal(b["image"][1], packio.open_dataset(packed["arrays"])[1]["image"])


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_unbatched_with_stock_loader(packed, workers):
    ds = packio.open_dataset(packed["tar"], iterable=True, batch_size=None, shuffle=True, resize=8)
    kw = {"multiprocessing_context": "fork"} if workers else {}
    got = list(TorchLoader(ds, batch_size=None, num_workers=workers, **kw))
    assert all(x["image"].shape == (3, 8, 8) for x in got)
    assert sorted(x["index"] for x in got) == list(range(30))
    assert [x["index"] for x in got] == ds.rank_sequence().tolist()  # the rank's order, whatever the workers


def test_skipped_sample_counts_as_consumed(packed, tmp_path):
    """on_error="skip": the corrupt sample is a None in its place, so a resume neither repeats nor loses."""
    import shutil

    from test_ddp import _corrupt_lmdb_record

    path = tmp_path / "bad.lmdb"
    shutil.copytree(packed["lmdb"], path)
    bad = _corrupt_lmdb_record(path, 4)
    mk = lambda: packio.open_dataset(path, iterable=True, decode=False, on_error="skip")  # noqa: E731
    loader = packio.DataLoader(mk(), batch_size=3, num_workers=2, multiprocessing_context="fork")
    first = []
    for k, b in enumerate(loader):
        first += b["key"]
        if k == 2:
            break
    state = loader.state_dict()
    assert state["consumed"] == 9 and len(first) == 8  # nine read, the corrupt one skipped
    again = packio.DataLoader(mk(), batch_size=3)
    again.load_state_dict(json.loads(json.dumps(state)))
    rest = _keys(again)
    assert len(first + rest) == len(set(first + rest)) == 29 and bad not in first + rest


def _stateful(kind: str, path: Path, workers: int):
    from torchdata.stateful_dataloader import StatefulDataLoader

    if kind == "iterable":
        target = packio.open_dataset(path, iterable=True, decode=False, shuffle=True, seed=2, batch_size=4)
        ds = target
    else:
        ds = packio.open_dataset(path, decode=False)
        target = packio.ResumableSampler(len(ds), seed=2)
    kw = {"multiprocessing_context": "fork", "persistent_workers": True} if workers else {}
    sampler = {"sampler": target} if kind == "map" else {}
    return StatefulDataLoader(ds, batch_size=4, num_workers=workers, collate_fn=packio.collate, **sampler, **kw), target


@pytest.mark.parametrize("kind", ["iterable", "map"])
@pytest.mark.parametrize("workers", [0, 2])
def test_torchdata_stateful_dataloader_resumes_exactly(packed, kind, workers):
    """StatefulDataLoader over packio (what torchtitan / Lightning resume with): stop mid-epoch,
    save (JSON), resume in a fresh loader: the same sequence, then the next epoch (persistent workers)."""
    pytest.importorskip("torchdata.stateful_dataloader")
    warnings.filterwarnings("ignore", category=UserWarning, module="torchdata")
    path = packed["lmdb"]
    loader, target = _stateful(kind, path, workers)
    full = []
    for epoch in range(2):
        target.set_epoch(epoch)
        full.append(_keys(loader))
    assert full[0] != full[1] and sorted(full[0]) == sorted(full[1])
    loader, target = _stateful(kind, path, workers)
    taken = []
    for k, b in enumerate(loader):
        taken += b["key"]
        if k == 3:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    loader, target = _stateful(kind, path, workers)
    loader.load_state_dict(state)
    target.set_epoch(0)
    assert taken + _keys(loader) == full[0]
    target.set_epoch(1)
    assert _keys(loader) == full[1]


def test_state_errors(packed):
    path = packed["lmdb"]
    it = packio.open_dataset(path, iterable=True, decode=False, shuffle=True, seed=1)
    state = it.state_dict()
    assert state["consumed"] == 0 and state["world_size"] == 1
    for change in ({"seed": 2}, {"shuffle": False}, {"window": 3}, {"length": 31}, {"kind": "sampler"},
                   {"consumed": 31}, {"consumed": -1}, {"epoch": "1"}, {"packio_state": None}):
        with pytest.raises(packio.StateError):
            it.load_state_dict({**state, **change})
    with pytest.raises(packio.StateError, match="older packio"):
        it.load_state_dict({"epoch": 0, "consumed": 3, "seed": 1, "shuffle": True, "length": 30})
    with pytest.raises(packio.StateError, match="worker"):
        it.load_state_dict({**state, "packio_worker_state": 1, "worker": 0, "num_workers": 2, "done": 3})
    s = packio.ResumableSampler(30, seed=1, even="drop")
    s.load_state_dict({**packio.ResumableSampler(30, seed=1, world_size=4, rank=3).state_dict(), "consumed": 5})
    assert (s.epoch, len(s)) == (0, 25)  # another world size and `even`: the same global position
    loader = packio.DataLoader(packio.open_dataset(path), batch_size=2, shuffle=True)
    with pytest.raises(packio.StateError, match="ResumableSampler"):
        loader.state_dict()


@pytest.mark.parametrize("kwargs, error", [
    ({"window": 0}, ValueError), ({"window": 2.5}, TypeError), ({"batch_size": 0}, ValueError),
    ({"batch_size": "8"}, TypeError), ({"even": "yes"}, ValueError), ({"seed": -1}, ValueError),
    ({"seed": 1.5}, TypeError), ({"seed": True}, TypeError), ({"shuffle": "yes"}, TypeError),
    ({"rank": 2, "world_size": 2}, ValueError), ({"world_size": 0}, ValueError), ({"resize": 0}, ValueError),
    ({"resize": (3, "4")}, ValueError), ({"threads": -1}, ValueError), ({"on_error": "ignore"}, ValueError),
])
def test_bad_arguments_are_refused(packed, kwargs, error):
    with pytest.raises(error):
        packio.open_dataset(packed["lmdb"], iterable=True, **kwargs)


def test_bad_sampler_and_loader_arguments(packed):
    for kwargs, error in (({"even": 1}, ValueError), ({"seed": "0"}, TypeError), ({"rank": -1, "world_size": 2},
                                                                                 ValueError)):
        with pytest.raises(error):
            packio.ResumableSampler(10, **kwargs)
    with pytest.raises(TypeError):
        packio.ResumableSampler(2.0)
    s = packio.ResumableSampler(10)
    with pytest.raises(ValueError):
        s.set_epoch(-1)
    with pytest.raises(ValueError):
        packio.DataLoader(packio.open_dataset(packed["lmdb"]), batch_size=0)
