"""Issue 39: labels and boxes without pixels (``ds.labels``, ``box_counts``, ``class_counts``) for
every format, local and over HTTP (tests/servers.py), multi-part, foreign shards and a mix, each
compared with the labels read with the pixels; and the weighted ``ResumableSampler``, whose resume
(on another world size, after DataLoader workers) matches an uninterrupted run key for key."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

import packio
from conftest import jpeg
from packio import decode as dec
from packio.errors import StateError

SUFFIXES = {".lmdb": None, ".h5": None, ".wds": None, ".bmpdir": dec.ResizeSpec(short_side=20),
            ".arrays": dec.ResizeSpec(size=(20, 24))}
N = 13


def _source(root: Path, n: int, first: int, names: str) -> tuple[Path, Path]:
    """``n`` JPEGs and a CSV giving some an image label (one of ``names``, interleaved) and 0-2
    boxes; the others no label (-1) and no box."""
    root.mkdir(parents=True)
    rows = ["filename,label,class,xmin,ymin,xmax,ymax"]
    for k in range(first, first + n):
        (root / f"im{k:03d}.jpg").write_bytes(jpeg(20 + k % 7, 24, seed=k))
        rows += [f"im{k:03d}.jpg,{names[(k * 7) % len(names)]},b{b},1,2,{10 + b},12"
                 for b in range(k % 3 if k % 5 != 4 else 0)]
    (root.parent / f"{root.name}.csv").write_text("\n".join(rows) + "\n")
    return root, root.parent / f"{root.name}.csv"


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The source packed in every format, and ``+.lmdb`` / ``+.wds``: those grown by an append."""
    tmp = tmp_path_factory.mktemp("labels")
    src, csv = _source(tmp / "a", N, 0, "xyz")
    more, more_csv = _source(tmp / "b", 7, 100, "zw")
    out = {}
    for suffix, resize in SUFFIXES.items():
        out[suffix] = Path(packio.convert(src, tmp / f"ds{suffix}", csv=csv, resize=resize, shard_samples=4,
                                          progress=False, workers=0).output)
    for suffix in (".lmdb", ".wds"):
        grown = tmp / f"grown{suffix}"
        shutil.copytree(out[suffix], grown)
        packio.convert(more, grown, csv=more_csv, append=True, shard_samples=4, progress=False, workers=0)
        out["+" + suffix] = grown
    return out


def _with_pixels(ds) -> tuple[list[int], list[int]]:
    items = [ds[i] for i in range(len(ds))]
    return [int(x["label"]) for x in items], [len(x["boxes"]) for x in items]


def _same_as_with_pixels(ds) -> None:
    labels, boxes = _with_pixels(ds)
    assert ds.labels.dtype == np.int64 and ds.box_counts.dtype == np.int64
    assert ds.labels.tolist() == labels and ds.box_counts.tolist() == boxes
    assert ds.class_counts == {name: labels.count(k) for k, name in enumerate(ds.classes)}
    assert -1 in labels and len(set(labels)) >= 3 and len(set(boxes)) == 3  # a truth worth comparing with


@pytest.mark.parametrize("name", [*SUFFIXES, "+.lmdb", "+.wds"])
def test_labels_equal_those_read_with_pixels(packed, name):
    ds = packio.open_dataset(packed[name])
    assert ("parts" in ds.reader.manifest.extra) == name.startswith("+")
    _same_as_with_pixels(ds)
    with pytest.raises(ValueError):  # handed to every caller: read-only
        ds.labels[0] = 3
    stream = packio.open_dataset(packed[name], iterable=True)
    assert stream.labels.tolist() == ds.labels.tolist() and stream.box_counts.tolist() == ds.box_counts.tolist()


def test_bmp_labels_open_no_image_file(packed, tmp_path):
    """The records alone: a BMP dataset whose image files are gone still tells its labels."""
    ds = tmp_path / "ds.bmpdir"
    shutil.copytree(packed[".bmpdir"], ds)
    want = packio.open_dataset(ds).labels.tolist()
    shutil.rmtree(ds / "images")
    assert packio.open_dataset(ds).labels.tolist() == want


@pytest.mark.parametrize("name", [".wds", ".h5", "+.wds"])
def test_labels_over_http(packed, name, http_server, tmp_path):
    path = packed[name]
    shutil.copytree(path, http_server.root / path.name) if path.is_dir() else shutil.copy(path, http_server.root)
    cache = tmp_path / "cache"
    ds = packio.open_dataset(f"{http_server.url}/{path.name}", cache_dir=cache)
    labels = ds.labels.tolist()
    if name == ".wds":  # the .json members by range: no shard (no image) fetched
        assert not list(cache.rglob("*.tar")) and len(labels) == N
        assert 0 < sum(n for p, n in http_server.counts.items() if p.endswith(".tar")) <= N
    _same_as_with_pixels(ds)
    assert labels == packio.open_dataset(path).labels.tolist()


def _foreign(folder: Path) -> None:
    """Shards another tool wrote: a .cls on most samples, a .json with boxes on some (one not
    packio's shape: ignored), one sample with no .json."""
    folder.mkdir(parents=True)
    for s in range(2):
        with wds.TarWriter(str(folder / f"shard-{s:06d}.tar")) as sink:
            for j in range(5):
                i = s * 5 + j
                sample = {"__key__": f"k{i:02d}", "jpg": jpeg(12, 16, seed=i)}
                if i != 7:
                    sample["json"] = {"boxes": [[1.0, 1.0, 5.0, 6.0]] * (i % 3)} if i != 4 else {"boxes": "bad"}
                if i % 4 != 3:
                    sample["cls"] = (i * 3) % 4
                sink.write(sample)


def test_foreign_shards_local_and_over_http(tmp_path, http_server):
    _foreign(tmp_path / "f")
    _foreign(http_server.root / "f")
    pattern = "shard-{000000..000001}.tar"
    for where in (tmp_path / "f", str(tmp_path / "f" / pattern), f"{http_server.url}/f/{pattern}"):
        ds = packio.open_dataset(where, cache_dir=tmp_path / "cache") if isinstance(where, str) and "://" in where \
            else packio.open_dataset(where)
        _same_as_with_pixels(ds)
        assert ds.labels.tolist() == [-1 if i % 4 == 3 else (i * 3) % 4 for i in range(10)]


def test_a_mix_tells_labels_in_its_one_class_list(packed, tmp_path):
    other, other_csv = _source(tmp_path / "o", 6, 50, "az")
    b = packio.convert(other, tmp_path / "o.h5", csv=other_csv, progress=False, workers=0).output
    mixed = packio.mix([packed[".lmdb"], b], [1, 1], epoch_samples=30, seed=2, decode=False)
    assert mixed.classes == ["y", "z", "a"] and packio.open_dataset(b).classes == ["a", "z"]
    seen = set()
    for x in mixed:
        at = mixed.mix.offsets[x["source"]] + x["index"]
        assert mixed.labels[at] == x["label"] and mixed.box_counts[at] == len(x["boxes"])
        seen.add((x["source"], x["label"]))
    assert {(1, 1), (1, 2), (1, -1)} <= seen  # the second source's "a" and "z" relabelled
    by_name = Counter(packio.open_dataset(packed[".lmdb"]).class_counts) + Counter(packio.open_dataset(b).class_counts)
    assert mixed.class_counts == dict(by_name) and len(mixed.labels) == N + 6


def _keys(loader) -> list[str]:
    return [k for batch in loader for k in batch["key"]]


@pytest.mark.parametrize("replacement", [True, False])
def test_weighted_sampler_resumes_exactly_on_another_world_size(packed, replacement):
    """Draws by weight (label -1: weight 0, never drawn); stopped after two batches of a loader
    with two worker processes, resumed from its state on two ranks: the keys drawn before the
    stop and after, interleaved by rank, are the uninterrupted run's, each as often."""
    ds = packio.open_dataset(packed[".lmdb"], decode=False)
    counts = np.array(list(ds.class_counts.values()))
    weights = np.where(ds.labels >= 0, 1.0 / counts[ds.labels], 0.0)  # labels -1 index counts[-1]: weighed 0
    kw = dict(weights=weights, replacement=replacement, seed=7, num_samples=20 if replacement else None)

    whole = packio.DataLoader(ds, batch_size=3, sampler=packio.ResumableSampler(ds, **kw))
    whole.set_epoch(4)
    want = _keys(whole)
    assert len(want) == (20 if replacement else int((weights > 0).sum()))
    unlabelled = {ds.reader.key(i) for i in np.flatnonzero(ds.labels < 0).tolist()}
    assert not unlabelled & set(want) and (len(set(want)) < len(want)) == replacement
    assert want != _keys(packio.DataLoader(ds, batch_size=3, sampler=packio.ResumableSampler(ds, **{**kw, "seed": 8})))

    first = packio.DataLoader(ds, batch_size=3, sampler=packio.ResumableSampler(ds, **kw), num_workers=2)
    first.set_epoch(4)
    before, it = [], iter(first)
    for _ in range(2):
        before += next(it)["key"]
    state = first.state_dict()
    del it
    assert state["consumed"] == 6 and state["weights"]
    ranks = []
    for r in range(2):
        s = packio.ResumableSampler(ds, **kw, rank=r, world_size=2, even=None)
        s.load_state_dict(state)
        ranks.append([ds.reader.key(i) for i in s])
    after = [k for pair in zip(*ranks) for k in pair] + ranks[0][len(ranks[1]):]
    assert Counter(before + after) == Counter(want) and before + after == want
    with pytest.raises(StateError, match="weights"):
        packio.ResumableSampler(ds, **{**kw, "weights": weights * (1 + np.arange(N))}).load_state_dict(state)


def test_weighted_draws_follow_the_weights():
    """9:1 classes weighed 1/count are drawn about equally; without replacement each sample once,
    heavier ones earlier; the same (seed, epoch) draws the same, whatever else ran."""
    labels = np.array([0] * 900 + [1] * 100)
    w = 1.0 / np.bincount(labels)[labels]
    s = packio.ResumableSampler(len(labels), weights=w, num_samples=10_000, seed=1)
    drawn = np.array(list(s))
    assert 0.45 < (labels[drawn] == 1).mean() < 0.55
    assert list(s) == drawn.tolist()
    s.set_epoch(1)
    assert list(s) != drawn.tolist()
    once = np.array(list(packio.ResumableSampler(len(labels), weights=w, replacement=False, seed=1)))
    assert sorted(once.tolist()) == list(range(1000)) and (labels[once[:100]] == 1).mean() > 0.4
    for bad in (w[:-1], -w, w * np.inf, np.zeros_like(w)):
        with pytest.raises(ValueError, match="weights"):
            packio.ResumableSampler(len(labels), weights=bad)
    with pytest.raises(ValueError, match="num_samples"):
        packio.ResumableSampler(3, weights=[1, 0, 1], replacement=False, num_samples=3)
