"""``ds[i]`` (one sample, no batch built around it) hands out exactly the per-sample dict
a batch holding sample ``i`` yields, for every format and decode setting, and what it
hands out is never written again."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import packio
from packio.formats.base import Reader
from packio.read.decoder import Decoder

# name: (suffix, pack options); "h5-raw" is the fixed-shape HDF5 (pixels, block reads)
FORMATS = {"lmdb": (".lmdb", {}), "tar": (".wds", {}), "hdf5": (".h5", {}), "bmp": (".bmpdir", {}),
           "arrays": (".arrays", {"resize": packio.ResizeSpec(size=(24, 32))}),
           "h5-raw": (".h5", {"resize": packio.ResizeSpec(size=(24, 32))})}
READS = {"decoded": {}, "resized": {"resize": (20, 28)}, "as stored": {"decode": False},
         "transformed": {"resize": (20, 28), "transform": lambda im: im.flip(-1).float() / 255}}


@pytest.fixture(scope="module")
def packed(gen_folder_once, tmp_path_factory) -> dict[str, Path]:
    src, csv = gen_folder_once
    root = tmp_path_factory.mktemp("single")
    out = {}
    for name, (suffix, kw) in FORMATS.items():
        out[name] = root / f"{name}{suffix}"
        packio.convert(src, out[name], csv=csv, progress=False, **kw)
    assert {packio.open_dataset(p).reader.manifest.format for p in out.values()} == set(packio.formats.formats())
    return out


def _same(one: dict, ref: dict) -> None:
    """``one`` is ``ref``: keys, types, dtypes, shapes, strides (memory format) and values."""
    assert list(one) == list(ref)
    for k, v in ref.items():
        got = one[k]
        assert type(got) is type(v), k
        if isinstance(v, torch.Tensor):
            assert (got.dtype, got.shape) == (v.dtype, v.shape), k
            assert not v.numel() or got.stride() == v.stride(), k  # an empty tensor's strides mean nothing
            assert torch.equal(got, v), k
        else:
            assert got == v, k


@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_one_sample_is_the_batch_item(packed, fmt, read):
    ds = packio.open_dataset(packed[fmt], **READS[read])
    n = len(ds)
    order = [int(i) for i in np.random.default_rng(1).permutation(n)]
    batch = ds.__getitems__(order)
    boxes = 0
    for j, i in enumerate(order):
        ref = batch[j]
        _same(ds[i], ref)
        _same(ds[i - n], ref)  # a negative index: the same sample, its index as stored
        assert ref["index"] == i
        boxes += len(ref["boxes"])
    assert boxes, "no sample with boxes: the box columns went untested"
    streamed = list(packio.open_dataset(packed[fmt], iterable=True, **READS[read]))  # batch_size=1: one by one
    assert len(streamed) == n
    for i, got in enumerate(streamed):
        _same(got, batch[order.index(i)])
    if read in ("resized", "transformed"):
        assert ds[0]["image"].shape == (3, 20, 28)
    if read == "as stored" and fmt not in ("arrays", "h5-raw"):
        assert isinstance(ds[0]["image"], bytes)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_one_sample_builds_no_batch(packed, fmt, monkeypatch):
    """The one-index path (``ds[i]``, a stream of batch_size=1) does not go through the
    batch route (its cost was a batch's)."""
    ds = packio.open_dataset(packed[fmt], resize=(20, 28))
    want = [ds[i] for i in range(len(ds))]
    stream = packio.open_dataset(packed[fmt], iterable=True, resize=(20, 28))  # batch_size=1

    def no_batch(*args, **kwargs):
        raise AssertionError("ds[i] built a batch")

    for name in ("samples", "block"):
        monkeypatch.setattr(Decoder, name, no_batch)
    monkeypatch.setattr(Reader, "check_indices", no_batch)
    for i, w in enumerate(want):
        _same(ds[i], w)
    for w, got in zip(want, stream, strict=True):
        _same(got, w)


@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("fmt", ["lmdb", "arrays", "h5-raw"])
def test_kept_sample_never_changes(packed, fmt, read):
    """Every tensor of a kept ``ds[i]`` still holds what it held after many later reads
    (single and batched) of other samples, and shares no memory with them."""
    ds = packio.open_dataset(packed[fmt], **READS[read])
    kept = ds[1]
    copies = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kept.items()}
    later = [ds[i] for i in range(len(ds)) for _ in range(2)] + list(ds.__getitems__(list(range(len(ds)))))
    for k, v in kept.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, copies[k]), k
            ptr = v.untyped_storage().data_ptr()
            assert all(x[k].untyped_storage().data_ptr() != ptr for x in later if x[k].numel()), k
        else:
            assert v == copies[k]


def test_corrupt_sample_is_skipped_or_raised_alike(packed, tmp_path):
    """A sample that does not decode: ``ds[i]`` is ``None`` where the batch holds ``None``
    (``on_error="skip"``, counted), and raises the batch's error otherwise."""
    import shutil

    path = tmp_path / "d.bmpdir"
    shutil.copytree(packed["bmp"], path)
    bad = path / "images" / "000000" / "0000000003.bmp"
    bad.write_bytes(b"BM" + bytes(len(bad.read_bytes()) - 2))  # a BMP header of zeros: no image
    ds = packio.open_dataset(path, on_error="skip")
    batch = ds.__getitems__(list(range(len(ds))))
    assert batch[3] is None and ds[3] is None and ds.decoder.errors.count == 2
    for i in (0, 4):
        _same(ds[i], batch[i])
    raising = packio.open_dataset(path)
    with pytest.raises(packio.errors.CorruptSampleError) as one:
        raising[3]
    with pytest.raises(packio.errors.CorruptSampleError) as many:
        raising.__getitems__([2, 3])
    assert str(one.value) == str(many.value)


def test_mix_streams_one_sample_like_its_batches(packed):
    """A mix iterated one sample at a time (batch_size=1) yields what its batches hold,
    ``source`` included."""
    paths = [packed["lmdb"], packed["tar"]]
    one = list(packio.mix(paths, epoch_samples=30, seed=3, resize=(20, 28)))
    batched = [x for b in packio.DataLoader(packio.mix(paths, epoch_samples=30, seed=3, resize=(20, 28)),
                                            batch_size=7) for x in _unbatch(b)]
    assert len(one) == len(batched) == 30 and {x["source"] for x in one} == {0, 1}
    for got, ref in zip(one, batched):
        assert got["key"] == ref["key"] and got["source"] == ref["source"] and got["index"] == ref["index"]
        assert torch.equal(got["image"], ref["image"]) and torch.equal(got["boxes"], ref["boxes"])
        assert got["label"] == ref["label"] and torch.equal(got["box_labels"], ref["box_labels"])


def _unbatch(b: dict) -> list[dict]:
    return [{"image": b["image"][j], "label": int(b["label"][j]), "boxes": b["boxes"][j],
             "box_labels": b["box_labels"][j], "key": b["key"][j], "index": int(b["index"][j]),
             "source": int(b["source"][j])} for j in range(len(b["key"]))]
