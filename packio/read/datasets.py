"""Thin PyTorch datasets over reader + decoder + positions: :class:`PackedDataset` reads what it is
asked for; :class:`PackedIterableDataset` streams a :class:`Source` (:class:`Packed`, or a mix) dealt
to ranks and workers by its ``Position`` (the epoch and position reach workers in shared memory).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from packio.errors import FormatError, StateError, is_url, redact
from packio.formats import open_reader
from packio.formats.columns import LabelColumns
from packio.formats.reader import Reader
from packio.options import DecodeOptions, check_int, merge_options
from packio.read.batch import Batch, Item
from packio.read.decoder import Decoder
from packio.read.positions import (Cursor, Position, SharedPosition, epoch_order, make_state, read_state,
                                   units_digest, worker_batches)
from packio.sample import Sample

__all__ = ["Source", "Packed", "PackedDataset", "PackedIterableDataset", "format_classes"]

WORKER_STATE = "packio_worker_state"


class Source(ABC):
    """What an iterable dataset streams: an epoch of ``len(self)`` samples in a seeded order, each an
    id in ``range(space)`` (``ids``: those at some positions of an epoch), read into one
    :class:`Batch` (``read``) or one dict (``one``); ``plan`` tells streaming readers the ids ahead;
    ``order_state`` is what fixes the order, ``identity`` what it is (for a mix's state); its
    state nests (``state_at``, ``check_state``: a mix's holds its sources')."""

    space: int
    streams: bool
    options: DecodeOptions
    name: str
    classes: list[str]
    box_classes: list[str]
    @abstractmethod
    def __len__(self) -> int: ...
    @abstractmethod
    def ids(self, epoch: int, positions: np.ndarray) -> np.ndarray: ...
    @abstractmethod
    def read(self, ids: Any, epoch: int) -> Batch: ...
    @abstractmethod
    def one(self, i: int, epoch: int) -> Item | None: ...
    @abstractmethod
    def plan(self, ids: np.ndarray) -> None: ...
    @abstractmethod
    def order_state(self) -> dict[str, Any]: ...
    @abstractmethod
    def identity(self) -> dict[str, Any]: ...
    @abstractmethod
    def decoders(self) -> list[Decoder]: ...
    @abstractmethod
    def columns(self) -> LabelColumns: ...  # labels and box counts by id, no image decoded

    def state_at(self, epoch: int, consumed: int) -> dict[str, Any]:
        return {}

    def check_state(self, state: dict[str, Any], epoch: int, consumed: int) -> None:
        return None


class Packed(Source):
    """A packed dataset as a source: its reader and decoder, in a seeded order (see ``epoch_order``)."""

    def __init__(self, reader: Reader, decoder: Decoder, *, shuffle: bool, seed: int, window: int) -> None:
        self.reader: Reader = reader
        self.decoder: Decoder = decoder
        self.options, self.name = decoder.options, str(reader.path)
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be True or False, not {shuffle!r}")
        self.shuffle, self.seed = shuffle, check_int("seed", seed, 0)
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

    def read(self, ids: Any, epoch: int) -> Batch:
        return self.decoder.batch_of(self.reader, ids, epoch)

    def one(self, i: int, epoch: int) -> Item | None:
        return self.decoder.item_of(self.reader, i, epoch)

    def plan(self, ids: np.ndarray) -> None:
        self.reader.plan(ids)

    def order_state(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle, "window": self.window, "dataset": self.reader.manifest.id,
                "units": units_digest(self.reader.units())}

    def identity(self) -> dict[str, Any]:
        return {"id": self.reader.manifest.id or self.name, "length": self.space}

    def decoders(self) -> list[Decoder]:
        return [self.decoder]

    def columns(self) -> LabelColumns:
        return self.reader.columns()

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _order=None)  # an epoch's whole order: not worth pickling


def _open(owner: Any, path: str | Path | Reader, options: DecodeOptions | None, fields: dict) -> tuple[Reader, Decoder]:
    """The reader of a local path (a Reader as is; of the class's format when pinned) and the decoder
    of the options: a URL is refused first, then the options are checked, then the path opened."""
    cls = type(owner).__name__
    if is_url(path):  # a URL reads through a cache with retries and timeouts, set up by open_dataset
        how = "url, iterable=True" if isinstance(owner, IterableDataset) else "url"
        raise FormatError(f"{redact(str(path))}: a URL; use packio.open_dataset({how}) (it takes cache_dir=, "
                          f"cache_limit=, retries=, timeout=, and every {cls} option), not {cls}(url)")
    decoder = Decoder(merge_options(DecodeOptions, options, fields, cls))
    reader = open_reader(path)
    if owner.format_name and reader.manifest.format != owner.format_name:
        raise FormatError(f"{path} holds the {reader.manifest.format!r} format, not {owner.format_name!r}; "
                          f"use packio.open_dataset() to open any format")
    return reader, decoder


class Reading:
    """What both datasets share: a :class:`Source` and what it tells (classes, decode threads)."""

    source: Source

    @property
    def options(self) -> DecodeOptions:
        return self.source.options

    @property
    def classes(self) -> list[str]:  # image class names: what ``label`` indexes
        return list(self.source.classes)

    @property
    def box_classes(self) -> list[str]:  # box class names: what ``box_labels`` index
        return list(self.source.box_classes)

    @property
    def labels(self) -> np.ndarray:  # each sample's index in ``classes`` (int64, -1: none), no image decoded
        return self.source.columns().labels

    @property
    def box_counts(self) -> np.ndarray:  # each sample's number of boxes (int64), read as ``labels`` is
        return self.source.columns().box_counts

    @property
    def class_counts(self) -> dict[str, int]:  # samples per name of ``classes``, in order (0 too; -1 not counted)
        return self.source.columns().class_counts(self.classes)

    @property
    def threads(self) -> int | None:  # decode threads per batch (None: torch's CPU thread count)
        return self.decoder.threads

    @threads.setter
    def threads(self, n: int | None) -> None:
        for d in self.source.decoders():
            d.threads = n

    @property
    def decoder(self) -> Decoder:
        return self.source.decoders()[0]

    @property
    def reader(self) -> Reader:
        if not isinstance(self.source, Packed):
            raise AttributeError(f"a {type(self).__name__} reads several datasets: see its sources")
        return self.source.reader

    def sample(self, i: int) -> Sample:
        """The stored sample itself (payload and record), undecoded."""
        return self.reader.read(i)


class PackedDataset(Reading, Dataset):
    """Random access to a packed dataset: ``ds[i]`` → ``image`` (``uint8`` CHW tensor; ``decode=False``:
    the stored bytes, or a raw format's pixels as CHW), ``label``, ``boxes`` (``float32[N, 4]`` xyxy),
    ``box_labels``, ``key``, ``index``. ``options=packio.DecodeOptions(...)`` and/or its fields as
    keywords (a keyword wins): ``resize=224`` or ``(h, w)`` squashes to that shape (boxes follow);
    ``on_error="skip"``: ``None`` for a corrupt sample; ``threads=N`` decode threads per batch.
    ``__getitems__`` (torch's DataLoader calls it with a batch's indices) reads the batch in one go:
    a list-like :class:`Batch` any collate function takes. ``set_epoch`` (``packio.DataLoader``
    forwards it) gives the decoder the epoch, in workers too. Handles open lazily per process."""

    format_name: str | None = None

    def __init__(self, path: str | Path | Reader, *, options: DecodeOptions | None = None, **fields: Any) -> None:
        self.source = Packed(*_open(self, path, options, fields), shuffle=False, seed=0, window=1)
        self.path, self.shared_epoch = str(path.path if isinstance(path, Reader) else path), SharedPosition()

    @property
    def epoch(self) -> int:
        return self.shared_epoch.get()[0]

    def set_epoch(self, epoch: int) -> None:
        self.shared_epoch.set(check_int("epoch", epoch, 0), 0)

    def __len__(self) -> int:
        return self.source.space

    def __getitem__(self, i: int) -> Item | None:
        return self.source.one(self.reader.check_index(i), self.epoch)

    def __getitems__(self, indices: list[int]) -> Batch:
        return self.source.read(indices, self.epoch)


class PackedIterableDataset(Reading, IterableDataset):
    """Streams a packed dataset (or any :class:`Source`), split across DDP ranks and DataLoader workers.

    Every sample once per epoch, plus with ``even="pad"`` (default) the first of the epoch's rest
    repeated on the last step so every rank gets the same count (else DDP's all-reduce hangs);
    ``"drop"`` leaves the last ``< world_size`` out; ``None`` keeps each exactly once. ``shuffle``
    is seeded, changes with :meth:`set_epoch`, quasi-random over ``window`` blocks/shards at a time
    (reads stay sequential), whatever the world size. ``batch_size`` must be the DataLoader's
    (``packio.DataLoader`` sets it): each worker makes whole batches and the loader yields the
    rank's sequence in order. A skipped sample (``on_error="skip"``) is a ``None``, still consumed.
    :meth:`state_dict` / :meth:`load_state_dict` resume exactly; inside torchdata's
    StatefulDataLoader workers, each worker's own position. Decode options: as for PackedDataset."""

    format_name: str | None = None
    kind = "iterable"

    def __init__(self, path: str | Path | Reader | Source, *, shuffle: bool = False, seed: int = 0,
                 batch_size: int | None = 1, window: int = 8, rank: int | None = None, world_size: int | None = None,
                 even: str | None = "pad", options: DecodeOptions | None = None, **fields: Any) -> None:
        if isinstance(path, Source):
            self.source = path
        else:
            self.source = Packed(*_open(self, path, options, fields), shuffle=shuffle, seed=seed, window=window)
        self.batch_size = None if batch_size is None else check_int("batch_size", batch_size, 1)
        self.position = Position(len(self.source), type(self).__name__, rank=rank, world_size=world_size, even=even)
        self.path = self.source.name if isinstance(path, (Source, Reader)) else str(path)
        self.whole_batches = False  # set by packio.DataLoader: yield whole batches (Batch), not sample dicts
        self.drop_last = False  # with whole_batches: leave out a last batch shorter than batch_size
        self.worker_resume: dict[str, Any] | None = None  # a worker's own state, loaded inside it

    @property
    def epoch(self) -> int:
        return self.position.epoch

    def set_epoch(self, epoch: int) -> None:  # the current one: a no-op (a resumed epoch keeps its position)
        self.position.set_epoch(epoch)

    def rank_sequence(self) -> np.ndarray:
        """This rank's sample ids for the rest of the current epoch."""
        split = self.position.split()
        return self.source.ids(self.epoch, split.span(0, split.mine))

    def __len__(self) -> int:
        return self.position.split().mine

    def __iter__(self) -> Iterator[Batch | Item | None]:
        info = get_worker_info()
        chunk = self.batch_size or 1
        cur = self.position.begin(chunk) if info is None else self._worker_cursor(info.id, info.num_workers, chunk)
        if self.source.streams:  # remote shards: fetched whole, in this order, prefetched
            self.source.plan(self.source.ids(cur.epoch, np.concatenate(
                [cur.split.span(a, b) for a, b in self._batches(cur)] or [np.zeros(0, np.int64)])))
        return self._stream(cur)

    def _batches(self, cur: Cursor) -> Iterator[tuple[int, int]]:
        worker, workers = cur.worker or (0, 1)
        return worker_batches(cur.split.mine, worker, workers, cur.chunk, cur.taken)

    def _worker_cursor(self, worker: int, workers: int, chunk: int) -> Cursor:
        """A worker's pass: from its own loaded state (once), else from the shared position."""
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
        n = self.position.split(resume["consumed"]).mine
        mine = sum(b - a for a, b in worker_batches(n, worker, workers, chunk))
        done = resume.get("done")
        if isinstance(done, bool) or not isinstance(done, int) or not 0 <= done <= mine:
            raise StateError(f"a DataLoader worker state says done={done!r}, but this worker's share of the rest "
                             f"of the epoch is {mine} samples: the state is damaged; resume from a fresh one")
        return self.position.begin(chunk, (worker, workers), (resume["epoch"], resume["consumed"]), done)

    def _stream(self, cur: Cursor) -> Iterator[Batch | Item | None]:
        source, whole = self.source, self.whole_batches
        for a, b in self._batches(cur):
            ids = source.ids(cur.epoch, cur.split.span(a, b))
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
        state = make_state(self.kind, epoch, consumed, p.length, p.world, p.even, **self.source.order_state())
        return {**state, **self.source.state_at(epoch, consumed)}

    def state_dict(self) -> dict[str, Any]:
        """The global position (JSON-safe): ``epoch``, ``consumed`` (samples every rank together took)
        and what fixes the order; the same on every rank, it resumes on any number of ranks and
        workers. In a DataLoader worker (StatefulDataLoader asks there): that worker's own."""
        c = self.position.cursor
        if get_worker_info() is None or c is None or c.worker is None:
            return self.state_at(**self.position.state_dict())
        return {**self.state_at(c.epoch, c.split.start), WORKER_STATE: 1, "rank": self.position.rank,
                "worker": c.worker[0], "num_workers": c.worker[1], "chunk": c.chunk, "done": c.taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` stopped; :class:`packio.StateError` when it cannot exactly."""
        want = self.source.order_state()
        if not want["shuffle"]:
            want.pop("window")  # no shuffle: the window changes nothing
        epoch, consumed = read_state(state, self.kind, self.position.length, want)
        self.source.check_state(state, epoch, consumed)
        if isinstance(state, dict) and WORKER_STATE in state:
            if get_worker_info() is None:
                raise StateError("this is one DataLoader worker's state (torchdata's StatefulDataLoader keeps one "
                                 "per worker): it resumes only through that loader, with the same num_workers; "
                                 "for a state that resumes anywhere use packio.DataLoader.state_dict()")
            self.worker_resume = state
            return
        self.position.load_state_dict({"epoch": epoch, "consumed": consumed})


_FORMAT_CLASSES: dict[str, type] = {}


def format_classes() -> dict[str, type]:
    """``{prefix}Dataset`` / ``{prefix}IterableDataset`` of every registered format (``LMDBDataset``, ...),
    pinned to it; made once per name, so pickling (spawn workers) finds the same class."""
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
