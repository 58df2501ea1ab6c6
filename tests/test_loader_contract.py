"""packio.DataLoader keeps torch's contract where packio changes nothing, and refuses
clearly where it cannot keep it: in_order=False resumes exactly or is refused,
batch_size=None yields what torch's loader yields, num_workers is honoured for every
dataset kind, and an option that would be ignored is an error."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import get_worker_info

import packio
from packio.errors import StateError


@pytest.fixture
def lmdb(gen_folder, tmp_path) -> Path:
    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", csv=csv, progress=False)
    return tmp_path / "d.lmdb"


@pytest.fixture
def arrays(gen_folder, tmp_path) -> Path:
    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.arrays", csv=csv, resize=packio.ResizeSpec(size=(24, 32)), progress=False)
    return tmp_path / "d.arrays"


def slow_in_worker_0(image: torch.Tensor) -> torch.Tensor:
    """Worker 0 lags, so with in_order=False later batches overtake its earlier ones."""
    info = get_worker_info()
    if info is not None and info.id == 0:
        time.sleep(0.03)
    return image


@pytest.mark.parametrize("iterable", [True, False])
def test_out_of_order_loading_resumes_exactly_or_is_refused(lmdb, iterable):
    def make(**kw):
        ds = packio.open_dataset(lmdb, iterable=iterable, shuffle=True, seed=3, resize=(16, 16),
                                 transform=slow_in_worker_0) if iterable else \
            packio.open_dataset(lmdb, resize=(16, 16), transform=slow_in_worker_0)
        sampler = None if iterable else packio.ResumableSampler(len(ds), shuffle=True, seed=3)
        return packio.DataLoader(ds, batch_size=2, sampler=sampler, **kw)

    loader = make(num_workers=2, in_order=False, multiprocessing_context="fork")
    first = []
    state = None
    try:
        for k, b in enumerate(loader):
            first += b["index"].tolist()
            if k == 3:
                state = loader.state_dict()
                break
    except StateError as exc:
        assert "in_order" in str(exc)  # refused, saying why and what to do
        return
    again = make()
    again.load_state_dict(state)
    rest = [i for b in again for i in b["index"].tolist()]
    n = len(packio.open_dataset(lmdb))
    assert sorted(first + rest) == list(range(n)), "samples lost or repeated on resume"


@pytest.mark.parametrize("iterable", [True, False])
def test_batch_size_none_yields_what_torch_yields(lmdb, iterable):
    def open_():
        return packio.open_dataset(lmdb, iterable=iterable, resize=(16, 16))

    ours = list(packio.DataLoader(open_(), batch_size=None))
    theirs = list(torch.utils.data.DataLoader(open_(), batch_size=None))
    assert len(ours) == len(theirs) == len(packio.open_dataset(lmdb))
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys() and a["key"] == b["key"] and a["index"] == b["index"]
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["boxes"], b["boxes"])


def _mark_worker(_: int) -> None:
    Path(os.environ["PACKIO_TEST_MARKS"], str(get_worker_info().id)).touch()


@pytest.mark.parametrize("iterable", [False, True])
def test_num_workers_is_honoured_for_arrays(arrays, tmp_path, monkeypatch, iterable):
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("PACKIO_TEST_MARKS", str(marks))
    ds = packio.open_dataset(arrays, iterable=iterable)
    loader = packio.DataLoader(ds, batch_size=3, num_workers=2, worker_init_fn=_mark_worker,
                               multiprocessing_context="fork")
    seen = [i for b in loader for i in b["index"].tolist()]
    assert sorted(seen) == list(range(len(packio.open_dataset(arrays))))
    assert sorted(p.name for p in marks.iterdir()) == ["0", "1"], "the workers asked for did not run"


def test_resize_without_decode_is_an_error(lmdb, arrays):
    for path in (lmdb, arrays):
        with pytest.raises(ValueError, match="decode"):
            packio.open_dataset(path, decode=False, resize=16)
        with pytest.raises(ValueError, match="decode"):
            packio.DecodeOptions(decode=False, resize=(8, 8))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_skipped_sample_leaves_the_rest_of_its_batch_intact(lmdb, monkeypatch, workers):
    from packio.errors import CorruptSampleError

    ref_ds = packio.open_dataset(lmdb, resize=(16, 16))
    ref = {i: ref_ds[i]["image"] for i in range(len(ref_ds))}
    reader_cls = type(ref_ds.reader)
    real = reader_cls.read

    def read(self, i):
        if i == 5:
            raise CorruptSampleError("#5", "damaged on purpose")
        return real(self, i)

    monkeypatch.setattr(reader_cls, "read", read)  # inherited by the forked workers
    ds = packio.open_dataset(lmdb, resize=(16, 16), on_error="skip")
    got = ds.__getitems__([4, 5, 6])
    assert got[1] is None and [x["index"] for x in got if x] == [4, 6]
    kw = {"multiprocessing_context": "fork"} if workers else {}
    seen = []
    for b in packio.DataLoader(ds, batch_size=3, num_workers=workers, **kw):
        assert b["image"].shape[0] == len(b["key"]) == len(b["boxes"]) == len(b["label"])
        for j, i in enumerate(b["index"].tolist()):
            assert torch.equal(b["image"][j], ref[i])
            assert torch.equal(b["boxes"][j], ref_ds[i]["boxes"])
        seen += b["index"].tolist()
    assert sorted(seen) == [i for i in range(len(ref)) if i != 5]


class _EpochSeen(packio.PackedDataset):
    """Each batch says the epoch its decoder got (module level: workers of any start method find it)."""

    def __getitems__(self, indices):
        batch = super().__getitems__(indices)
        batch.key = [f"epoch {self.epoch}"] * len(batch)
        return batch


def test_map_style_datasets_get_the_epoch_in_workers(lmdb):
    """packio.DataLoader.set_epoch reaches a map-style dataset and its DataLoader workers, persistent
    ones included: the decoder reads each batch knowing its epoch (read-time crops and flips, issue 39)."""
    loader = packio.DataLoader(_EpochSeen(lmdb), batch_size=4, shuffle=True, num_workers=2,
                               multiprocessing_context="fork", persistent_workers=True)
    for epoch in (0, 3, 7):
        loader.set_epoch(epoch)
        assert {k for b in loader for k in b["key"]} == {f"epoch {epoch}"}
    assert loader.dataset.epoch == 7
