"""One contract, run against every format in the registry, and against a toy format
that only this module registers (tests/toyformat.py): a format is one module plus
one registration."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import packio
from packio import decode as dec
from packio.formats import formats, register, unregister
from conftest import TRUTH
import toyformat

PLUGINS = {toyformat.FORMAT.name: toyformat.FORMAT}  # registered by the `packed` fixture only
SPECS = {**formats(), **PLUGINS}
FORMATS = sorted(SPECS)


def resize_for(fmt: str) -> dec.ResizeSpec | None:
    """Fixed-shape formats need one shape; BMP stores pixels, kept small here."""
    spec = SPECS[fmt]
    if spec.needs_fixed_shape:
        return dec.ResizeSpec(size=(48, 64))
    return dec.ResizeSpec(short_side=40) if spec.encoding == "bmp" else None


def pack(src: Path, csv: Path | None, out: Path, fmt: str, **kw):
    return packio.convert(src, out / f"ds{SPECS[fmt].suffixes[0]}", csv=csv, resize=resize_for(fmt),
                          progress=False, **kw)


@pytest.fixture(scope="module")
def packed_once(gen_folder_once, tmp_path_factory):
    """Packs ``gen_folder_once`` into a format on first use, once per module: ``{fmt: summary}``.
    The contract tests only read what is packed."""
    made = {}

    def get(fmt: str):
        if fmt not in made:
            made[fmt] = pack(*gen_folder_once, tmp_path_factory.mktemp(f"packed-{fmt}"), fmt)
        return made[fmt]

    return get


def _registered(request, fmt: str) -> None:
    if fmt in PLUGINS:
        register(PLUGINS[fmt])
        request.addfinalizer(lambda: unregister(fmt))


@pytest.fixture(params=FORMATS)
def packed(request, gen_folder_once, packed_once):
    _registered(request, request.param)
    src, csv = gen_folder_once
    summary = packed_once(request.param)
    return request.param, Path(summary.output), src, csv, summary


def expected(src: Path, fmt: str):
    """What each stored sample must be, from the generator's own truth and the files."""
    truth = TRUTH[str(src)]
    classes = sorted({t[0] for t in truth.values()})
    box_classes = sorted({c for t in truth.values() for c in t[2]})
    spec = resize_for(fmt)
    out = {}
    for key, (label, boxes, names) in truth.items():
        data = (src / key).read_bytes()
        b = np.asarray(boxes, np.float32).reshape(-1, 4)
        box_labels = [box_classes.index(c) for c in names]
        if spec is None:
            out[key] = (data, classes.index(label), b, box_labels)
        else:
            img, b2, bl = dec.apply_spec(dec.decode(data), b, np.asarray(box_labels, np.int64), spec)
            out[key] = (img, classes.index(label), b2, list(bl))
    return out, classes, box_classes


def test_round_trip(packed):
    fmt, path, src, csv, summary = packed
    want, classes, box_classes = expected(src, fmt)
    ds = packio.open_dataset(path, decode=False)
    assert ds.reader.manifest.format == fmt
    assert len(ds) == len(want) == summary.packed == 14
    assert ds.classes == classes and ds.box_classes == box_classes
    seen = set()
    for i in range(len(ds)):
        s = ds.sample(i)
        data, label, boxes, box_labels = want[s.key]
        if isinstance(data, bytes):
            assert s.payload == data  # byte for byte
        else:
            got = s.payload if isinstance(s.payload, np.ndarray) else dec.decode(s.payload)
            np.testing.assert_array_equal(got, data)  # pixel for pixel (lossless BMP / raw)
        assert s.label == label
        np.testing.assert_allclose(s.boxes, boxes, rtol=1e-6)
        assert list(s.box_labels) == list(box_labels)
        assert (s.width, s.height) != (0, 0)
        seen.add(s.key)
    assert seen == set(want)
    truth = [want[ds.reader.key(i)] for i in range(len(ds))]  # ds.labels: from the columns or records alone
    assert ds.labels.tolist() == [t[1] for t in truth] and ds.box_counts.tolist() == [len(t[2]) for t in truth]
    assert not summary.skipped
    # the decoded view agrees with the raw one
    item = packio.open_dataset(path)[0]
    assert item["image"].dtype == torch.uint8 and item["image"].shape[0] == 3


def _loader_indices(ds, workers: int, ctx: str | None = None, batch: int = 4) -> list[int]:
    kw = {"multiprocessing_context": ctx} if workers else {}
    dl = packio.DataLoader(ds, batch_size=batch, num_workers=workers, **kw)
    return [i for b in dl for i in b["index"].tolist()]


def test_exactly_once_two_ranks_two_workers(packed):
    fmt, path, *_ = packed
    n = len(packio.open_dataset(path))
    per_rank = []
    for rank in range(2):
        ds = packio.open_dataset(path, iterable=True, decode=False, shuffle=True, seed=3, rank=rank, world_size=2)
        per_rank.append(_loader_indices(ds, workers=2, ctx="fork"))
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(n))
    for even, size in (("pad", (n + 1) // 2), ("drop", n // 2)):
        counts = [len(packio.open_dataset(path, iterable=True, decode=False, rank=r, world_size=2, even=even))
                  for r in range(2)]
        assert counts == [size, size]


def test_shuffle_is_seeded_and_changes_per_epoch(packed):
    fmt, path, *_ = packed
    a = packio.open_dataset(path, iterable=True, decode=False, shuffle=True, seed=1)
    b = packio.open_dataset(path, iterable=True, decode=False, shuffle=True, seed=1)
    first = [x["index"] for x in a]
    assert first == [x["index"] for x in b]
    assert sorted(first) == list(range(len(first)))
    a.set_epoch(1)
    assert [x["index"] for x in a] != first
    s = packio.ResumableSampler(len(first), seed=1)
    s2 = packio.ResumableSampler(len(first), seed=1)
    assert list(s) == list(s2) and sorted(s) == list(range(len(first)))
    s.set_epoch(1)
    assert list(s) != list(s2)


@pytest.mark.parametrize("workers_after", [0, 1, 2])
def test_resume_mid_epoch(packed, workers_after):
    fmt, path, *_ = packed
    mk = lambda: packio.open_dataset(path, iterable=True, decode=False, shuffle=True, seed=5)  # noqa: E731
    full = _loader_indices(mk(), workers=2, ctx="fork", batch=3)
    ds = mk()
    dl = packio.DataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context="fork")
    taken = []
    for k, b in enumerate(dl):
        taken += b["index"].tolist()
        if k == 1:
            state = dl.state_dict()
            break
    assert state["consumed"] == len(taken) == 6
    ds2 = mk()
    dl2 = packio.DataLoader(ds2, batch_size=3, num_workers=workers_after,
                            **({"multiprocessing_context": "fork"} if workers_after else {}))
    dl2.load_state_dict(state)
    rest = [i for b in dl2 for i in b["index"].tolist()]
    assert taken + rest == full


class _OneOfEach(torch.utils.data.Dataset):
    """Several datasets behind one index, for one loader: every batch comes from one of
    them (see ``_batches``) and is read by that dataset's own ``__getitems__``, as a
    loader over that dataset alone would."""

    def __init__(self, datasets: list) -> None:
        self.datasets = datasets
        self.starts = np.cumsum([0] + [len(d) for d in datasets]).tolist()

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitems__(self, indices: list[int]):
        which = int(np.searchsorted(self.starts, indices[0], side="right")) - 1
        return self.datasets[which].__getitems__([i - self.starts[which] for i in indices])


def _batches(starts: list[int], size: int) -> list[list[int]]:
    """Batches of ``size`` over each dataset's range in turn: the batches a sequential
    loader of that size makes over each dataset alone."""
    return [list(range(i, min(i + size, end))) for start, end in zip(starts, starts[1:])
            for i in range(start, end, size)]


def test_map_style_spawn_workers_every_format(request, packed_once):
    """Every format's map-style dataset, read once in the parent, crosses to spawn workers
    (pickled, nothing inherited): each sample exactly once, resized, with its label. One
    spawn loader for all formats (two spawn workers cost seconds each); the fork side is
    test_map_style_workers_keep_labels."""
    datasets, want = [], []
    for fmt in FORMATS:
        _registered(request, fmt)
        ds = packio.open_dataset(packed_once(fmt).output, resize=32)
        ds[0]  # handles opened in the parent must not leak into workers
        datasets.append(ds)
        want.append({ds.sample(i).key: ds.sample(i).label for i in range(len(ds))})
    both = _OneOfEach(datasets)
    batches = _batches(both.starts, 4)
    dl = packio.DataLoader(both, batch_sampler=batches, num_workers=2, multiprocessing_context="spawn")
    seen: list[list[int]] = [[] for _ in FORMATS]
    for b, asked in zip(dl, batches, strict=True):  # in order: the k-th batch is from asked's dataset
        which = int(np.searchsorted(both.starts, asked[0], side="right")) - 1
        seen[which] += b["index"].tolist()
        assert b["image"].shape[1:] == (3, 32, 32)
        assert all(want[which][k] == int(lab) for k, lab in zip(b["key"], b["label"]))
    for fmt, idx, ds in zip(FORMATS, seen, datasets):
        assert sorted(idx) == list(range(len(ds))), fmt


def test_map_style_workers_keep_labels(packed):
    fmt, path, *_ = packed
    ds = packio.open_dataset(path, resize=32)
    ds[0]
    want = {ds.sample(i).key: ds.sample(i).label for i in range(len(ds))}
    dl = packio.DataLoader(ds, batch_size=5, num_workers=2, multiprocessing_context="fork",
                           persistent_workers=True)
    for _ in range(2):
        for b in dl:
            assert b["image"].shape[1:] == (3, 32, 32)
            assert all(want[k] == int(lab) for k, lab in zip(b["key"], b["label"]))


def test_map_style_fork_after_parent_read(packed):
    fmt, path, *_ = packed
    ds = packio.open_dataset(path, decode=False)
    ds[len(ds) - 1]
    assert sorted(_loader_indices(ds, workers=2, ctx="fork")) == list(range(len(ds)))


def test_the_reader_contract_is_declared_not_wrapped():
    """Every reader (the registry's, multi-part, remote tar) keeps the public doors of
    formats/reader.py as written there (a format implements hooks, never read / read_batch
    / key) and declares its capabilities; nothing wraps a subclass behind its back."""
    from packio.formats.parts import MultiPartReader
    from packio.formats.reader import Reader
    from packio.remote.reader import RemoteTarReader

    for cls in {spec.reader for spec in SPECS.values()} | {MultiPartReader, RemoteTarReader}:
        assert [n for n in ("read", "read_batch", "key", "columns") if getattr(cls, n) is not getattr(Reader, n)] == [], cls
        assert isinstance(cls.reads_batches, bool) and isinstance(cls.streams, bool), cls
    assert "__init_subclass__" not in Reader.__dict__
    assert RemoteTarReader.streams and RemoteTarReader.reads_batches and not SPECS["tar"].reader.streams


def test_a_replaced_dataset_sticks_and_one_bad_sample_stays_in_place(request, packed_once, monkeypatch):
    """read_batch puts one sample's damage in its place; a DatasetReplacedError is no
    sample's damage: the batch raises it, and so does every later call."""
    _registered(request, "toy")
    reader = packio.open_reader(packed_once("toy").output)
    load = type(reader)._load

    def failing(self, i):
        if i == 1:
            raise packio.CorruptSampleError(f"#{i}", "bad")
        if i == 2:
            raise packio.DatasetReplacedError("replaced")
        return load(self, i)

    monkeypatch.setattr(type(reader), "_load", failing)
    got = reader.read_batch([0, 1, 3]).samples
    assert isinstance(got[1], packio.CorruptSampleError) and got[0].key and got[2].key
    with pytest.raises(packio.DatasetReplacedError):
        reader.read_batch([0, 2, 3])
    for call in (lambda: reader.read(0), lambda: reader.key(3), lambda: reader.read_batch([0])):
        with pytest.raises(packio.DatasetReplacedError, match="replaced"):
            call()


def test_an_overwrite_under_an_open_reader_is_noticed_at_its_next_call(packed, tmp_path):
    """Handles kept open (LMDB's and .arrays' memory maps, an HDF5 file) would serve the old
    version for ever: 'convert --overwrite' makes the next call of an open reader raise, and
    every call after it (docs/formats.md), in the process that opened it too."""
    import shutil

    fmt, path, src, csv, _ = packed
    mine = tmp_path / path.name
    (shutil.copytree if path.is_dir() else shutil.copy2)(path, mine)
    reader = packio.open_reader(str(mine))
    reader.read(0), reader.read_batch([0, 1]), reader.key(1)
    pack(src, csv, tmp_path, fmt, overwrite=True)
    for call in (lambda: reader.read_batch([0, 1]), lambda: reader.read(0), lambda: reader.key(1),
                 lambda: reader.read_batch([0])):
        with pytest.raises(packio.DatasetReplacedError, match="replaced"):
            call()
