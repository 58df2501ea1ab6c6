"""Thin PyTorch datasets over reader + decoder + positions.

:class:`PackedDataset` (map-style) reads what it is asked for. :class:`PackedIterableDataset`
streams a :class:`Source` (a packed dataset's reader and decoder in a seeded order,
:class:`Packed`; or a mix of sources, ``packio.read.mix``), split over DDP ranks and
DataLoader workers by its :class:`~packio.read.positions.Position`. Rank and world size are
resolved where the dataset is built and travel to workers inside the pickled object; the
epoch and resume position reach every worker through shared memory. Resume states are
global positions, so they continue on any number of ranks and workers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from packio.errors import FormatError, StateError, redact
from packio.formats import open_reader
from packio.formats.base import Reader
from packio.options import DecodeOptions, check_int, merge_options
from packio.read.batch import Batch, Item
from packio.read.decoder import Decoder
from packio.read.positions import (Cursor, Position, SharedPosition, check_flags, epoch_order, make_state,
                                   read_state, units_digest, worker_batches, worker_share)
from packio.sample import Sample

__all__ = ["Source", "Packed", "PackedDataset", "PackedIterableDataset", "open_dataset", "format_classes"]

WORKER_STATE = "packio_worker_state"


class Source(ABC):
    """What an iterable dataset streams: an epoch of ``len(self)`` samples in a seeded order,
    each sample an id in ``range(self.space)``, read into one :class:`Batch`. Its state (what
    fixes the order, and where its parts stand) nests: a mix's holds its sources'."""

    space: int
    streams: bool  # its reader(s) want the process's sequence ahead (:meth:`plan`)
    options: DecodeOptions
    name: str
    classes: list[str]
    box_classes: list[str]

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def ids(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The ids at ``positions`` of ``epoch``'s order."""

    @abstractmethod
    def read(self, ids: np.ndarray, epoch: int) -> Batch: ...

    @abstractmethod
    def one(self, i: int, epoch: int) -> Item | None: ...

    @abstractmethod
    def plan(self, ids: np.ndarray) -> None:
        """Tell the reader(s) the ids this process will read, in order."""

    @abstractmethod
    def order_state(self) -> dict[str, Any]:
        """What fixes the order (JSON-safe): a state must match it to resume."""

    def state_at(self, epoch: int, consumed: int) -> dict[str, Any]:
        """Where its parts stand after ``consumed`` samples of ``epoch`` (a mix: its sources)."""
        return {}

    def load_state_dict(self, state: dict[str, Any], epoch: int, consumed: int) -> None:
        """Check what :meth:`state_at` saved; a :class:`StateError` when it does not follow."""

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """What it is, for a mix's state: a dataset's id and length; a mix's sources and weights."""

    @abstractmethod
    def decoders(self) -> list[Decoder]: ...


class Packed(Source):
    """One packed dataset as a source: its reader and decoder, in a seeded order of its own
    (quasi-random over ``window`` of its units at a time, see ``epoch_order``)."""

    def __init__(self, reader: Reader, decoder: Decoder, *, shuffle: bool, seed: int, window: int) -> None:
        self.reader, self.decoder, self.options, self.name = reader, decoder, decoder.options, str(reader.path)
        self.shuffle, self.seed = check_flags(shuffle, seed)
        self.window = check_int("window", window, 1)
        self.space, self.streams = len(reader), reader.streams
        self.classes, self.box_classes = list(reader.manifest.classes), reader.manifest.box_class_names()
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its order): one epoch kept

    def __len__(self) -> int:
        return self.space

    def order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.space, shuffle=self.shuffle, seed=self.seed, epoch=epoch,
                                              units=self.reader.units(), window=self.window))
        return self._order[1]

    def ids(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        return self.order(epoch)[positions]

    def read(self, ids: np.ndarray, epoch: int) -> Batch:
        return self.decoder.read(self.reader, ids, epoch)

    def one(self, i: int, epoch: int) -> Item | None:
        return self.decoder.one(self.reader, i, epoch)

    def plan(self, ids: np.ndarray) -> None:
        self.reader.plan(ids)

    def order_state(self) -> dict[str, Any]:
        """Seed, shuffle, window, and the dataset (manifest id) and order units it reads."""
        units = units_digest(self.reader.units())
        return {"seed": self.seed, "shuffle": self.shuffle, "window": self.window, "dataset": self.reader.manifest.id,
                "units": units}

    def identity(self) -> dict[str, Any]:
        return {"id": self.reader.manifest.id or self.name, "length": self.space}

    def decoders(self) -> list[Decoder]:
        return [self.decoder]

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _order=None)  # an epoch's whole order: not worth pickling


def _open(path: str | Path | Reader, owner: type, format_name: str | None) -> Reader:
    """The reader of a local path (or a Reader as is), of ``format_name`` when the class is pinned."""
    from packio.remote import is_url

    if is_url(path):  # a URL reads through a cache with retries and timeouts, set up by open_dataset
        how = "url, iterable=True" if issubclass(owner, IterableDataset) else "url"
        raise FormatError(f"{redact(str(path))}: a URL; use packio.open_dataset({how}) (it takes cache_dir=, "
                          f"cache_limit=, retries=, timeout=, and every {owner.__name__} option), not "
                          f"{owner.__name__}(url)")
    reader = open_reader(path)
    if format_name and reader.manifest.format != format_name:
        raise FormatError(f"{path} holds the {reader.manifest.format!r} format, not {format_name!r}; "
                          f"use packio.open_dataset() to open any format")
    return reader


class PackedDataset(Dataset):
    """Random access to a packed dataset: ``ds[i]`` → dict with ``image`` (``uint8`` CHW tensor;
    with ``decode=False`` the stored bytes, or for pre-resized raw formats the stored pixels as a
    CHW tensor), ``label``, ``boxes`` (``float32[N, 4]`` xyxy), ``box_labels``, ``key``, ``index``.

    ``options=packio.DecodeOptions(...)`` and/or its fields as keywords (``decode``, ``resize``,
    ``transform``, ``backend``, ``on_error``, ``verify``, ``threads``; a keyword wins).
    ``resize=224`` or ``(h, w)`` squashes to that shape, aspect not kept (boxes follow).
    ``on_error="skip"``: ``None`` for a corrupt sample (``packio.collate`` drops it).
    ``threads=N``: each batch decoded on N threads where it is read (default: torch's CPU
    thread count there). ``__getitems__`` (what torch's DataLoader calls with a batch's
    indices) reads the batch in one go: a list-like :class:`Batch` of sample dicts that any
    collate function takes. ``set_epoch`` (``packio.DataLoader`` forwards it) gives the decoder
    the epoch, in DataLoader workers too. Handles open lazily in each process."""

    format_name: str | None = None

    def __init__(self, path: str | Path | Reader, *, options: DecodeOptions | None = None, **fields: Any) -> None:
        self.reader = _open(path, type(self), self.format_name)
        self.options = merge_options(DecodeOptions, options, fields, type(self).__name__)
        self.decoder = Decoder(self.options)
        self.path = str(path)
        self.shared_epoch = SharedPosition()

    @property
    def classes(self) -> list[str]:
        """Image class names: what ``label`` indexes."""
        return list(self.reader.manifest.classes)

    @property
    def box_classes(self) -> list[str]:
        """Box class names: what ``box_labels`` index."""
        return self.reader.manifest.box_class_names()

    @property
    def threads(self) -> int | None:
        """Decode threads per batch (``None``: torch's CPU thread count)."""
        return self.decoder.threads

    @threads.setter
    def threads(self, n: int | None) -> None:
        self.decoder.threads = n

    @property
    def epoch(self) -> int:
        return self.shared_epoch.get()[0]

    def set_epoch(self, epoch: int) -> None:
        self.shared_epoch.set(check_int("epoch", epoch, 0), 0)

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> Item | None:
        return self.decoder.one(self.reader, self.reader.check_index(i), self.epoch)

    def __getitems__(self, indices: list[int]) -> Batch:
        """The batch, read in one go: a list-like :class:`Batch` of sample dicts (``None`` for a
        skipped one) that any collate function takes."""
        return self.decoder.read(self.reader, indices, self.epoch)

    def sample(self, i: int) -> Sample:
        """The stored sample itself (payload bytes/array and record), undecoded."""
        return self.reader.read(i)


class PackedIterableDataset(IterableDataset):
    """Streams a packed dataset (or a :class:`Source`), split across DDP ranks and DataLoader workers.

    Every sample once per epoch across ranks and workers, plus with ``even="pad"`` (default) the
    first samples of the rest of the epoch repeated on the last step so every rank gets the same
    count (a rank with one batch fewer would hang DDP's all-reduce); ``"drop"`` leaves the last
    ``< world_size`` out; ``None`` keeps each sample exactly once. ``shuffle`` is seeded and
    changes with :meth:`set_epoch`; the order is quasi-random over ``window`` blocks/shards at a
    time so reads stay sequential, and does not depend on the world size.

    ``batch_size`` must be the DataLoader's (``packio.DataLoader`` sets it; ``None`` for a loader
    with ``batch_size=None``): each worker then makes whole batches and the loader yields the
    rank's sequence in order. With ``on_error="skip"`` a skipped sample is a ``None`` in its
    place, still consumed. :meth:`state_dict` / :meth:`load_state_dict` resume exactly; inside
    workers of torchdata's ``StatefulDataLoader`` they save and restore each worker's own
    position. ``options`` / its fields as keywords: as for :class:`PackedDataset`."""

    format_name: str | None = None
    kind = "iterable"

    def __init__(self, path: str | Path | Reader | Source, *, shuffle: bool = False, seed: int = 0,
                 batch_size: int | None = 1, window: int = 8, rank: int | None = None, world_size: int | None = None,
                 even: str | None = "pad", options: DecodeOptions | None = None, **fields: Any) -> None:
        if isinstance(path, Source):
            self.source = path
        else:
            reader = _open(path, type(self), self.format_name)
            decoder = Decoder(merge_options(DecodeOptions, options, fields, type(self).__name__))
            self.source = Packed(reader, decoder, shuffle=shuffle, seed=seed, window=window)
        self.options = self.source.options
        self.batch_size = None if batch_size is None else check_int("batch_size", batch_size, 1)
        self.position = Position(len(self.source), type(self).__name__, rank=rank, world_size=world_size, even=even)
        self.path = path.name if isinstance(path, Source) else str(path)
        self.whole_batches = False  # set by packio.DataLoader: yield whole batches (Batch), not sample dicts
        self.drop_last = False  # with whole_batches: leave out a last batch shorter than batch_size
        self.worker_resume: dict[str, Any] | None = None  # a worker's own state, loaded inside it

    @property
    def reader(self) -> Reader:
        """The reader of a packed dataset's source (a mix has one per source)."""
        if not isinstance(self.source, Packed):
            raise AttributeError(f"a {type(self).__name__} reads several datasets: see its sources")
        return self.source.reader

    @property
    def classes(self) -> list[str]:
        """Image class names: what ``label`` indexes."""
        return list(self.source.classes)

    @property
    def box_classes(self) -> list[str]:
        """Box class names: what ``box_labels`` index."""
        return list(self.source.box_classes)

    @property
    def threads(self) -> int | None:
        """Decode threads per batch (``None``: torch's CPU thread count)."""
        return self.source.decoders()[0].threads

    @threads.setter
    def threads(self, n: int | None) -> None:
        for d in self.source.decoders():
            d.threads = n

    @property
    def epoch(self) -> int:
        return self.position.epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a no-op when it is the current one: a resumed epoch keeps its position)."""
        self.position.set_epoch(epoch)

    def sample(self, i: int) -> Sample:
        """The stored sample itself (payload bytes/array and record), undecoded."""
        return self.reader.read(i)

    def rank_sequence(self) -> np.ndarray:
        """This rank's sample ids for the rest of the current epoch."""
        split = self.position.split()
        return self.source.ids(self.epoch, split.positions(0, split.mine))

    def __len__(self) -> int:
        return self.position.remaining_here()

    def __iter__(self) -> Iterator[Batch | Item | None]:
        info = get_worker_info()
        chunk = self.batch_size or 1
        cur = self.position.begin(chunk) if info is None else self._worker_cursor(info.id, info.num_workers, chunk)
        if self.source.streams:  # remote shards: fetched whole, in this order, prefetched
            self.source.plan(self.source.ids(cur.epoch, np.concatenate(
                [cur.split.positions(a, b) for a, b in self._batches(cur)] or [np.zeros(0, np.int64)])))
        return self._stream(cur)

    def _batches(self, cur: Cursor) -> Iterator[tuple[int, int]]:
        worker, workers = cur.worker or (0, 1)
        return worker_batches(cur.split.mine, worker, workers, cur.chunk, cur.taken)

    def _worker_cursor(self, worker: int, workers: int, chunk: int) -> Cursor:
        """A worker's pass: from its own loaded state (used once), else from the shared position."""
        resume, self.worker_resume = self.worker_resume, None
        if resume is None:
            return self.position.begin(chunk, worker=(worker, workers))
        want = {"rank": self.position.rank, "world_size": self.position.world, "num_workers": workers,
                "worker": worker, "chunk": chunk}
        got = {k: resume.get(k) for k in want}
        if got != want:
            raise StateError(f"a DataLoader worker state saved with {got} cannot resume with {want}: a worker's "
                             f"state resumes only with the same world size, num_workers and batch size; for a "
                             f"state that resumes anywhere use packio.DataLoader.state_dict()")
        mine = worker_share(self.position.split(resume["consumed"]).mine, worker, workers, chunk)
        done = resume.get("done")
        if isinstance(done, bool) or not isinstance(done, int) or not 0 <= done <= mine:
            raise StateError(f"a DataLoader worker state says done={done!r}, but this worker's share of the rest "
                             f"of the epoch is {mine} samples: the state is damaged; resume from a fresh one")
        return self.position.begin(chunk, (worker, workers), (resume["epoch"], resume["consumed"]), done)

    def _stream(self, cur: Cursor) -> Iterator[Batch | Item | None]:
        source, whole = self.source, self.whole_batches
        for a, b in self._batches(cur):
            ids = source.ids(cur.epoch, cur.split.positions(a, b))
            if cur.chunk == 1 and not whole:  # one sample at a time: no batch built around it
                cur.taken += 1
                yield source.one(int(ids[0]), cur.epoch)
                continue
            batch = source.read(ids, cur.epoch)
            if whole:  # packio.DataLoader's: one Batch per step
                if self.drop_last and len(batch) < cur.chunk:
                    break
                cur.taken += len(batch)
                yield batch
                continue
            for x in batch:
                cur.taken += 1
                yield x
        self.position.end(cur)

    def state_at(self, epoch: int, consumed: int) -> dict[str, Any]:
        """The state at global position ``consumed`` of ``epoch`` (JSON-safe), nested for a mix."""
        p = self.position
        return {**make_state(self.kind, epoch=epoch, consumed=consumed, length=p.length, world=p.world, even=p.even,
                             **self.source.order_state()), **self.source.state_at(epoch, consumed)}

    def state_dict(self) -> dict[str, Any]:
        """The global position (JSON-safe): ``epoch``, ``consumed`` (samples of the epoch every
        rank together has taken) and what fixes the order; the same on every rank, it resumes on
        any number of ranks and workers. Inside a DataLoader worker (torchdata's
        StatefulDataLoader asks there) it is that worker's own position."""
        c = self.position.cursor
        if get_worker_info() is None or c is None or c.worker is None:
            return self.state_at(*self.position.now())
        return {**self.state_at(c.epoch, c.split.start), WORKER_STATE: 1, "rank": self.position.rank,
                "worker": c.worker[0], "num_workers": c.worker[1], "chunk": c.chunk, "done": c.taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` (from :meth:`state_dict`) stopped; :class:`packio.StateError`
        when it cannot continue this order exactly."""
        want = self.source.order_state()
        if not want["shuffle"]:
            want.pop("window")  # no shuffle: the window changes nothing
        epoch, consumed = read_state(state, self.kind, self.position.length, want)
        self.source.load_state_dict(state, epoch, consumed)
        if isinstance(state, dict) and WORKER_STATE in state:
            if get_worker_info() is None:
                raise StateError("this is one DataLoader worker's state (torchdata's StatefulDataLoader keeps one "
                                 "per worker): it resumes only through that loader, with the same num_workers; "
                                 "for a state that resumes anywhere use packio.DataLoader.state_dict()")
            self.worker_resume = state
            return
        self.position.jump(epoch, consumed)


def open_dataset(path: str | Path, *, iterable: bool = False, options: DecodeOptions | None = None,
                 cache_dir: str | Path | None = None, cache_limit: int | str | None = None,
                 storage_options: dict[str, Any] | None = None, retries: int = 10, timeout: float = 10.0,
                 retry_seconds: float = 30.0, **kwargs: Any) -> PackedDataset | PackedIterableDataset:
    """Open any packed dataset (the format comes from its manifest) as a :class:`PackedDataset`,
    or with ``iterable=True`` a :class:`PackedIterableDataset`; ``options`` and ``kwargs`` go to
    that class. A URL (``s3://``, ``https://``, any fsspec URL) reads through a local cache: see
    :func:`packio.remote.open_url` for ``cache_dir``, ``cache_limit``, ``storage_options``,
    ``retries``, ``timeout`` and ``retry_seconds``."""
    from packio.remote import is_url, open_url

    cls = PackedIterableDataset if iterable else PackedDataset
    if not is_url(path):
        return cls(path, options=options, **kwargs)
    reader = open_url(path, cache_dir=cache_dir, cache_limit=cache_limit, storage_options=storage_options,
                      retries=retries, timeout=timeout, retry_seconds=retry_seconds)
    ds = cls(reader, options=options, **kwargs)
    ds.path = str(path)
    return ds


_FORMAT_CLASSES: dict[str, type] = {}


def format_classes() -> dict[str, type]:
    """``{prefix}Dataset`` / ``{prefix}IterableDataset`` for every registered format (``LMDBDataset``,
    ``TarIterableDataset``, ...): the generic classes pinned to one format. Made once per name,
    so pickling (spawn workers) finds the same class."""
    from packio.formats import formats

    for spec in formats().values():
        doc = f"A {spec.name} dataset; see :class:`PackedDataset` / :class:`PackedIterableDataset`."
        for base in (PackedDataset, PackedIterableDataset):
            name = f"{spec.class_prefix}{base.__name__.removeprefix('Packed')}"
            if name not in _FORMAT_CLASSES:
                _FORMAT_CLASSES[name] = type(name, (base,), {"format_name": spec.name, "__doc__": doc,
                                                            "__module__": __name__})
    return _FORMAT_CLASSES


def __getattr__(name: str) -> Any:
    cls = format_classes().get(name) if name.endswith("Dataset") else None
    if cls is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return cls
