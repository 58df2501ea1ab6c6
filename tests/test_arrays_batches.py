"""Whole-batch paths at the memcpy / decode limit: arrays batches gathered in one copy into
a fresh buffer each, and the tar stream's batches decoded into one buffer.
Every batch is checked pixel for pixel against per-sample reads, every key counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import packio
from packio.formats.columns import Columns
from packio.read.decoder import Decoder


@pytest.fixture
def arrays(gen_folder, tmp_path) -> packio.PackedDataset:
    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.arrays", csv=csv, resize=packio.ResizeSpec(size=(24, 32)), progress=False)
    return packio.open_dataset(tmp_path / "d.arrays")


def _check(ds: packio.PackedDataset, batches: list[dict]) -> list[int]:
    """Each batch against the stored samples; returns the indices seen."""
    seen = []
    for b in batches:
        assert b["image"].shape[1:] == (3, 24, 32) and b["image"].dtype == torch.uint8
        for j, i in enumerate(b["index"].tolist()):
            s = ds.sample(i)
            np.testing.assert_array_equal(b["image"][j].permute(1, 2, 0).numpy(), s.payload)
            np.testing.assert_array_equal(b["boxes"][j].numpy(), np.asarray(s.boxes, np.float32).reshape(-1, 4))
            assert b["box_labels"][j].tolist() == list(s.box_labels)
            assert int(b["label"][j]) == s.label and b["key"][j] == s.key
            seen.append(i)
    return seen


@pytest.mark.parametrize("shuffle", [False, True])
def test_arrays_batches_are_whole_gathers_into_fresh_buffers(arrays, monkeypatch, shuffle):
    def per_sample(*_: object) -> None:
        raise AssertionError("the per-sample route was used")

    monkeypatch.setattr(Decoder, "samples", per_sample)
    arrays.threads = 2  # 2 threads share each copy
    loader = packio.DataLoader(arrays, batch_size=5, shuffle=shuffle)
    kept = list(loader)  # every batch kept alive: none may be overwritten by a later one
    assert len({b["image"].data_ptr() for b in kept}) == len(kept)
    assert sorted(_check(arrays, kept)) == list(range(len(arrays)))
    assert any(len(x) for b in kept for x in b["boxes"])
    it = iter(loader)
    held = next(it)["image"][0]  # a view alone: its pixels stay as they were
    copy = held.clone()
    for b in it:
        assert b["image"].untyped_storage().data_ptr() != held.untyped_storage().data_ptr()
    assert torch.equal(held, copy)


def test_arrays_batches_resume_exactly_and_fall_back_on_bad_reads(arrays, monkeypatch):
    n = len(arrays)
    loader = packio.DataLoader(arrays, batch_size=3, drop_last=False,
                               sampler=packio.ResumableSampler(n, shuffle=True, seed=4))
    first = []
    for k, b in enumerate(loader):
        first += b["index"].tolist()
        if k == 1:
            break
    state = loader.state_dict()
    again = packio.DataLoader(arrays, batch_size=3, sampler=packio.ResumableSampler(n, shuffle=True, seed=4))
    again.load_state_dict(state)
    rest = list(again)
    assert sorted(first + _check(arrays, rest)) == list(range(n))
    # a failing gather goes through the per-sample path (which applies on_error), same batches
    monkeypatch.setattr(type(arrays.reader), "read_batch",
                        lambda *a: (_ for _ in ()).throw(packio.errors.FormatError("x")))
    assert sorted(_check(arrays, list(packio.DataLoader(arrays, batch_size=4)))) == list(range(n))


def test_a_replaced_dataset_fails_the_batch_without_reading_again(arrays, monkeypatch):
    """DatasetReplacedError from a batch read is that batch's error, with or without on_error="skip":
    nothing is read again sample by sample (before: any error of the gather fell back to per-sample
    reads, which a replaced dataset must not get)."""
    from packio.errors import DatasetReplacedError

    reads = []
    monkeypatch.setattr(type(arrays.reader), "read_batch",
                        lambda *a: (_ for _ in ()).throw(DatasetReplacedError("replaced on purpose")))
    monkeypatch.setattr(type(arrays.reader), "read", lambda self, i: reads.append(i))
    for ds in (arrays, packio.open_dataset(arrays.reader.path, on_error="skip")):
        with pytest.raises(DatasetReplacedError, match="on purpose"):
            ds.__getitems__([0, 1, 2])
        with pytest.raises(DatasetReplacedError, match="on purpose"):
            next(iter(packio.DataLoader(ds, batch_size=3)))
    assert reads == []


def test_batch_index_checks_match_per_sample_ones(arrays):
    r = arrays.reader
    n = len(r)
    assert r.check_indices([0, -1, n - 1, 2]).tolist() == [0, n - 1, n - 1, 2]
    assert r.check_indices(np.array([3, 1], np.uint8)).tolist() == [3, 1]
    for bad, err in (([0, n], IndexError), ([-n - 1], IndexError), ([True, 1], TypeError), ([1.0], TypeError)):
        with pytest.raises(err):
            r.check_indices(bad)


def test_flat_columns_match_per_sample_slices():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 4, 40)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    cols = Columns.checked({"labels": rng.integers(0, 9, 40), "boxes": rng.random((off[-1], 4), np.float32),
                            "box_labels": rng.integers(0, 5, off[-1]), "box_offsets": off}, 40, "t")
    for idx in (np.arange(7, 19), rng.permutation(40)[:13], np.array([5, 5, 0, 39]), np.array([3])):
        labels, boxes, box_labels, got_counts = cols.take(idx)
        per_sample = [(off[i], off[i + 1]) for i in idx]
        assert labels.tolist() == cols.labels[idx].tolist()
        assert got_counts.tolist() == [b - a for a, b in per_sample]
        np.testing.assert_array_equal(boxes, np.concatenate([cols.boxes[a:b] for a, b in per_sample]))
        np.testing.assert_array_equal(box_labels, np.concatenate([cols.box_labels[a:b] for a, b in per_sample]))
        boxes[:] = -1  # a copy: the dataset's column is untouched
        assert not (cols.boxes == -1).all(axis=1).any()


@pytest.mark.parametrize("workers", [0, 2])
def test_tar_stream_batches_are_one_decoded_buffer(gen_folder, tmp_path, monkeypatch, workers):
    """The iterable tar reader decodes each batch into consecutive slots of one buffer, which
    packio.collate hands on without a stack; pixels equal per-sample reads; each key once."""
    src, csv = gen_folder
    packio.convert(src, tmp_path / "d.wds", csv=csv, shards=3, progress=False)
    ref_ds = packio.open_dataset(tmp_path / "d.wds", resize=(24, 32))
    ref = {i: ref_ds[i] for i in range(len(ref_ds))}
    ds = packio.open_dataset(tmp_path / "d.wds", iterable=True, shuffle=True, seed=2, resize=(24, 32))

    real_stack = torch.stack

    def no_stack(tensors: list, *args: object, **kwargs: object) -> torch.Tensor:
        if len(tensors) > 1:
            raise AssertionError("collate stacked a batch")
        return real_stack(tensors, *args, **kwargs)  # a worker's fresh buffer: one zero, broadcast, into shared memory

    monkeypatch.setattr(torch, "stack", no_stack)  # inherited by the forked workers
    kw = {"multiprocessing_context": "fork"} if workers else {}
    seen = []
    for b in packio.DataLoader(ds, batch_size=4, num_workers=workers, **kw):
        assert b["image"].shape[1:] == (3, 24, 32)
        for j, i in enumerate(b["index"].tolist()):
            assert torch.equal(b["image"][j], ref[i]["image"]) and b["key"][j] == ref[i]["key"]
            assert torch.equal(b["boxes"][j], ref[i]["boxes"])
            seen.append(i)
    assert sorted(seen) == list(range(len(ref)))
