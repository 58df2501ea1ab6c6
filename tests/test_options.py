"""PackOptions / DecodeOptions: one object or its fields as keywords give the same
output, a keyword wins over ``options``, checks live in the option classes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import packio
import toyformat
from packio import DecodeOptions, PackOptions, ResizeSpec
from packio.errors import FormatError, PackioError
from packio.formats import register, unregister
from packio.pack import output_format


def _payloads(path: Path) -> dict[str, tuple[str, bytes]]:
    ds = packio.open_dataset(path, decode=False)
    return {s.key: (s.encoding, bytes(s.payload)) for s in (ds.sample(i) for i in range(len(ds)))}


def test_convert_options_object_equals_keywords_and_keywords_win(gen_folder, tmp_path):
    src, _ = gen_folder
    opts = PackOptions(format="lmdb", resize=ResizeSpec(size=(24, 32)), encode="jpeg", quality=70)
    a = packio.convert(src, tmp_path / "a.lmdb", options=opts, workers=0, progress=False)
    b = packio.convert(src, tmp_path / "b.lmdb", format="lmdb", resize=ResizeSpec(size=(24, 32)), encode="jpeg",
                       quality=70, workers=0, progress=False)
    c = packio.convert(src, tmp_path / "c.lmdb", options=opts, encode="png", workers=0, progress=False)
    assert a.packed == b.packed == c.packed == 14
    pa, pb, pc = (_payloads(tmp_path / n) for n in ("a.lmdb", "b.lmdb", "c.lmdb"))
    assert pa == pb  # byte for byte
    assert {e for e, _ in pa.values()} == {"jpeg"} and {e for e, _ in pc.values()} == {"png"}
    assert a.manifest.image["quality"] == 70 and c.manifest.image["quality"] is None  # no JPEG encoded in c
    assert a.manifest.image["encodings"] == {"jpeg": 14} and c.manifest.image["encodings"] == {"png": 14}


@pytest.mark.parametrize("make", [
    lambda p: packio.convert(p, p.parent / "x.lmdb", qualty=80),
    lambda p: packio.convert(p, p.parent / "x.lmdb", options=PackOptions(), on_error="skip"),
    lambda p: packio.open_dataset(p, resise=8),
    lambda p: packio.PackedIterableDataset(p, shuffle=True, options=DecodeOptions(), dcode=False),
    lambda p: packio.LMDBDataset(p, options=PackOptions()),
])
def test_unknown_keywords_and_wrong_option_types_are_type_errors(make, tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(TypeError):
        make(tmp_path / "src")


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"quality": 0}, PackioError, "quality must be an integer from 1 to 100"),
    ({"quality": True}, PackioError, "quality"),
    ({"shards": 2, "shard_samples": 5}, PackioError, "not both"),
    ({"encode": "webp"}, PackioError, "encode must be one of"),
    ({"check": "full"}, PackioError, "check must be one of"),
    ({"shard_bytes": 0}, PackioError, "shard_bytes"),
    ({"resize": (8, 8)}, TypeError, "ResizeSpec"),
])
def test_pack_options_check_their_fields_wherever_they_come_from(kwargs, exc, match, gen_folder, tmp_path):
    src, _ = gen_folder
    with pytest.raises(exc, match=match):
        PackOptions(**kwargs)
    with pytest.raises(exc, match=match):  # the same check, through convert's keywords
        packio.convert(src, tmp_path / "x.lmdb", **kwargs)
    with pytest.raises(exc, match=match):  # and through dataclasses.replace
        dataclasses.replace(PackOptions(), **kwargs)
    assert not (tmp_path / "x.lmdb").exists()


@pytest.mark.parametrize("kwargs,exc", [
    ({"decode": 1}, TypeError), ({"verify": "yes"}, TypeError), ({"transform": 3}, TypeError),
    ({"on_error": "ignore"}, ValueError), ({"backend": "nope"}, ValueError), ({"threads": -1}, ValueError),
    ({"resize": (0, 8)}, ValueError), ({"resize": 10**6}, ValueError), ({"resize": (8, 8, 3)}, ValueError),
])
def test_decode_options_check_their_fields(kwargs, exc):
    with pytest.raises(exc):
        DecodeOptions(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"random_resized_crop": 224, "resize": 224}, "give one of resize, random_resized_crop"),
    ({"random_resized_crop": 224, "short_side": 256}, "give one of resize, random_resized_crop"),
    ({"random_resized_crop": 0}, "random_resized_crop must be a positive int"),
    ({"random_resized_crop": 224, "crop_scale": (0.5, 0.1)}, "crop_scale must be"),
    ({"random_resized_crop": 224, "crop_scale": (0.0, 1.0)}, "crop_scale must be"),
    ({"random_resized_crop": 224, "crop_ratio": "wide"}, "crop_ratio must be"),
    ({"crop_scale": (0.5, 1.0)}, "give random_resized_crop=SIZE too"),
    ({"flip_p": 1.5}, "flip_p must be a number from 0 to 1"), ({"flip_p": True}, "flip_p must be"),
    ({"min_visible": -0.1}, "min_visible must be"),
    ({"short_side": 200, "center_crop": 224}, "larger than short_side"),
    ({"short_side": -3}, "short_side must be a positive int"),
    ({"center_crop": 10**6}, "over packio's limit"),
    ({"crop_seed": -1}, "crop_seed must be"),
    ({"flip_p": 0.5, "decode": False}, "need decode=True"),
])
def test_decode_options_check_the_crop_fields_when_made(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecodeOptions(**kwargs)


def test_decode_options_crop_recipe_normalised_and_pickled():
    import pickle

    o = DecodeOptions(random_resized_crop=np.int64(64), crop_ratio=[0.5, 2], flip_p=1)
    assert o.random_resized_crop == (64, 64) and o.crop_ratio == (0.5, 2.0) and o.flip_p == 1.0
    assert o.recipe.size == (64, 64) and o.recipe.flip_p == 1.0
    assert pickle.loads(pickle.dumps(o)) == o and pickle.loads(pickle.dumps(o)).recipe == o.recipe
    assert dataclasses.replace(o, flip_p=0.0).recipe.flip_p == 0.0  # made again from the new fields
    assert DecodeOptions(resize=32).recipe is None  # a plain squash keeps the plain resize path
    assert DecodeOptions(short_side=32, center_crop=(24, 30)).recipe.size == (24, 30)
    assert DecodeOptions(short_side=32).recipe.size is None  # shapes follow each image


def test_decode_options_normalise_resize_and_pickle():
    import pickle

    o = DecodeOptions(resize=np.int64(16), threads=np.int32(2))
    assert o.resize == (16, 16) and type(o.resize[0]) is int and o.threads == 2 and type(o.threads) is int
    assert dataclasses.replace(o, verify=True).resize == (16, 16)
    assert pickle.loads(pickle.dumps(o)) == o


def test_dataset_options_object_equals_keywords_and_keywords_win(gen_folder, tmp_path):
    src, _ = gen_folder
    packio.convert(src, tmp_path / "d.lmdb", workers=0, progress=False)
    opts = DecodeOptions(resize=(20, 28), on_error="skip")
    by_obj = packio.open_dataset(tmp_path / "d.lmdb", options=opts)
    by_kw = packio.open_dataset(tmp_path / "d.lmdb", resize=(20, 28), on_error="skip")
    assert by_obj.options == by_kw.options == opts
    for i in range(len(by_obj)):
        a, b = by_obj[i], by_kw[i]
        assert a["image"].shape == (3, 20, 28) and torch.equal(a["image"], b["image"])
        assert torch.equal(a["boxes"], b["boxes"]) and a["key"] == b["key"]
    with pytest.raises(ValueError, match="decode=True"):  # a resize that would be ignored
        packio.LMDBIterableDataset(tmp_path / "d.lmdb", options=opts, decode=False)
    raw = packio.LMDBIterableDataset(tmp_path / "d.lmdb", options=opts, decode=False, resize=None)
    assert raw.options.resize is None and raw.options.on_error == "skip"
    first = next(iter(raw))
    assert first["image"] == bytes(raw.reader.read(first["index"]).payload)  # as stored: bytes, not pixels


def test_refused_suffixes_come_from_the_registry(tmp_path):
    assert {s for f in packio.formats.formats().values() for s, _ in f.refused_suffixes} >= {".tar", ".npy", ".bmp"}
    spec = dataclasses.replace(toyformat.FORMAT, refused_suffixes=((".toyfile", "toy viewers"),),
                               folder_holds="toy.json")
    register(spec)
    try:
        with pytest.raises(FormatError, match=r"breaks toy viewers\); name the output .*x\.toy \(it will hold toy"):
            output_format(tmp_path / "x.toyfile")
        with pytest.raises(FormatError, match="names a toyfile file, not the lmdb format"):
            output_format(tmp_path / "x.toyfile", "lmdb")
    finally:
        unregister("toy")
    assert output_format(tmp_path / "x.toyfile", "lmdb").name == "lmdb"  # no format refuses it now
