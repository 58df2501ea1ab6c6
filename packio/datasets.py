"""Map-style and iterable PyTorch datasets over any format's reader, and the
resumable DDP sampler.

Rank and world size are resolved once, where the dataset or sampler is built (the
training process, where torch.distributed is initialised), and travel to
DataLoader workers inside the pickled object. The epoch and resume position of an
iterable dataset live in a small shared-memory tensor, read by each worker when it
starts an epoch: they reach workers of every start method, persistent ones
included. Resume states are global positions (see :mod:`packio.order`), so they
continue on any number of ranks and workers.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sized

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from packio.collation import Batch
from packio.errors import FormatError, PackioError, StateError, is_url, redact
from packio.formats.reader import Reader
from packio.items import Item, Items
from packio.options import DecodeOptions, merge_options
from packio.order import (Split, check_epoch, check_even, check_int, dist_info, dist_world, epoch_order,
                          make_state, rank_lengths, read_state, units_digest, worker_slice)
from packio.sample import Sample

__all__ = ["PackedDataset", "PackedIterableDataset", "ResumableSampler", "format_classes"]

WORKER_STATE = "packio_worker_state"


class PackedDataset(Dataset):
    """Random access to a packed dataset: ``ds[i]`` → dict with ``image`` (``uint8``
    CHW tensor; with ``decode=False`` the stored bytes, or for pre-resized raw
    formats the stored pixels as a CHW tensor), ``label``, ``boxes``
    (``float32[N, 4]`` xyxy), ``box_labels``, ``key``, ``index``.

    What shapes the items: ``options=packio.DecodeOptions(...)`` and/or its fields as
    keywords (``decode``, ``resize``, ``transform``, ``backend``, ``on_error``,
    ``verify``, ``threads``; a keyword wins over ``options``). ``resize=224`` or
    ``(h, w)`` squashes to that shape after decode, aspect not kept (boxes follow). Handles open lazily in each
    process, so it works in DataLoader workers under any start method.
    ``on_error="skip"`` returns ``None`` for a corrupt sample (``packio.collate`` drops it).
    ``threads=N`` decodes each batch with N threads in whichever process reads it
    (default: torch's own CPU thread count there; see :class:`packio.DecodeOptions`).
    ``__getitems__`` (what torch's DataLoader calls with a batch's indices) returns
    the batch, read in one go, as a list-like of sample dicts, so any collate function
    works; ``packio.collate`` hands its one-shape images on without a copy.
    """

    format_name: str | None = None

    def __init__(self, path: str | Path, *, options: DecodeOptions | None = None, **fields: Any) -> None:
        _not_a_url(path, type(self), iterable=False)
        self.options = merge_options(DecodeOptions, options, fields, type(self).__name__)
        self.items = Items(path, self.format_name, self.options)
        self.path = str(path)

    @property
    def reader(self) -> Reader:
        return self.items.reader

    @property
    def classes(self) -> list[str]:
        """Image class names: what ``label`` indexes."""
        return list(self.reader.manifest.classes)

    @property
    def box_classes(self) -> list[str]:
        """Box class names: what ``box_labels`` index."""
        return self.reader.manifest.box_class_names()

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> Item | None:
        return self.items.one(self.reader.check_index(i))

    def __getitems__(self, indices: list[int]) -> Batch:
        """The batch, read in one go: a list-like :class:`packio.collation.Batch` of
        sample dicts (``None`` for a skipped one) that any collate function takes."""
        return self.items.get(indices)

    def sample(self, i: int) -> Sample:
        """The stored sample itself (payload bytes/array and record), undecoded."""
        return self.reader.read(i)


def _not_a_url(path: Any, cls: type, iterable: bool) -> None:
    """A URL reads through a cache with retries and timeouts, which open_dataset sets up
    (and takes the options of): said before any keyword of those options is refused."""
    if is_url(path):
        how = "url, iterable=True" if iterable else "url"
        raise FormatError(f"{redact(path)}: a URL; use packio.open_dataset({how}) (it takes cache_dir=, "
                          f"cache_limit=, retries=, timeout=, and every {cls.__name__} option), not "
                          f"{cls.__name__}(url)")


@dataclass
class _Pass:
    """One pass over the rest of an epoch, as one process sees it."""

    epoch: int
    split: Split
    generation: int  # the position's generation it started from (see _Resumable)
    taken: int = 0  # positions of this process's sequence handed out (skipped samples included)
    finished: bool = False
    worker: tuple[int, int] | None = None  # (id, num_workers) inside a DataLoader worker
    chunk: int = 1

    def consumed(self) -> int:
        return len(self.split.order) if self.finished else self.split.consumed(self.taken)


class _Resumable:
    """Epoch, global resume position and state of the iterable dataset and the sampler.

    ``set_epoch(e)`` starts epoch ``e`` from its beginning, except when ``e`` is
    already the current epoch (a loop that calls it after ``load_state_dict`` keeps
    the resumed position). A pass that runs to the end of the epoch in the training
    process leaves the position at the epoch's beginning again.
    """

    kind = ""
    length: int
    seed: int
    shuffle: bool
    even: str | None
    rank: int
    world_size: int
    _explicit_world: bool
    _pass: _Pass | None
    _generation: int

    def _get_position(self) -> tuple[int, int]:
        raise NotImplementedError

    def _set_position(self, epoch: int, start: int) -> None:
        raise NotImplementedError

    def _order(self, epoch: int) -> np.ndarray:
        raise NotImplementedError

    def _order_args(self) -> dict[str, Any]:
        return {}

    @property
    def epoch(self) -> int:
        return self._get_position()[0]

    def set_epoch(self, epoch: int) -> None:
        epoch = check_epoch(check_int("epoch", epoch, 0))
        self._check_world()
        if epoch != self.epoch:
            self._set_position(epoch, 0)
            self._pass, self._generation = None, self._generation + 1

    def split(self, epoch: int | None = None, start: int | None = None) -> Split:
        """How the rest of the current epoch (or ``epoch`` from ``start``) is dealt to the ranks."""
        now = self._get_position()
        epoch, start = now[0] if epoch is None else epoch, now[1] if start is None else start
        return Split(self._order(epoch), start, self.rank, self.world_size, self.even)

    def _remaining_here(self) -> int:
        return rank_lengths(max(0, self.length - self._get_position()[1]), self.world_size, self.even)[self.rank]

    def _check_world(self) -> None:
        """Catch a dataset or sampler built before init_process_group() (it would read everything on every rank)."""
        if not self._explicit_world and dist_world() not in (None, self.world_size):
            raise PackioError(f"this {type(self).__name__} was built for a world of {self.world_size} rank(s), "
                              f"but torch.distributed now has {dist_world()}: build it after "
                              f"init_process_group(), or pass rank= and world_size=")

    def _begin(self) -> _Pass:
        """A pass in the training process (the sampler's, a main-process dataset's, or a loader's)."""
        self._check_world()
        epoch, start = self._get_position()
        return _Pass(epoch, self.split(epoch, start), self._generation)

    def _end(self, p: _Pass) -> None:
        p.finished = True
        if p.generation == self._generation:
            self._set_position(p.epoch, 0)

    def _state(self, consumed: int, epoch: int | None = None) -> dict[str, Any]:
        epoch = self.epoch if epoch is None else epoch
        return make_state(self.kind, epoch=epoch, consumed=consumed, length=self.length, seed=self.seed,
                          shuffle=self.shuffle, world=self.world_size, even=self.even, **self._order_args())

    def state_dict(self) -> dict[str, Any]:
        """The global position (JSON-safe): ``epoch``, ``consumed`` (samples of the
        epoch every rank together has taken) and what fixes the order. It is the
        same on every rank and resumes on any number of ranks and workers."""
        p = self._pass
        if p is not None and p.generation == self._generation:
            return self._state(p.consumed(), p.epoch)
        return self._state(self._get_position()[1])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` (from :meth:`state_dict`) stopped; raises
        :class:`packio.StateError` when it cannot continue this order exactly."""
        if isinstance(state, dict) and WORKER_STATE in state:
            raise StateError("this is one DataLoader worker's state (torchdata's StatefulDataLoader keeps one "
                             "per worker): it resumes only through that loader, with the same num_workers; for "
                             "a state that resumes anywhere use packio.DataLoader.state_dict()")
        epoch, consumed = read_state(state, self.kind, length=self.length, seed=self.seed, shuffle=self.shuffle,
                                     **self._order_args())
        self._set_position(epoch, consumed)
        self._pass, self._generation = None, self._generation + 1


def _check_flags(shuffle: Any, seed: Any) -> tuple[bool, int]:
    if not isinstance(shuffle, bool):
        raise TypeError(f"shuffle must be True or False, not {shuffle!r}")
    return shuffle, check_int("seed", seed, 0)


class _SharedPosition:
    """(epoch, start) shared with DataLoader workers: the training process writes it,
    and every worker reads it when it begins an epoch — persistent workers (which keep
    their own copy of the dataset) and spawn / forkserver ones included.

    Held in an anonymous shared page (inherited by forked workers, no descriptor), and
    only when the dataset is pickled (spawn / forkserver workers) also in a torch
    shared-memory tensor, sent as a handle: an idle dataset holds no descriptor."""

    def __init__(self) -> None:
        self._page = mmap.mmap(-1, 16)
        self.t: torch.Tensor | None = None

    def get(self) -> tuple[int, int]:
        if self.t is not None:
            epoch, start = self.t.tolist()
            return int(epoch), int(start)
        return struct.unpack("<qq", self._page[:16])

    def set(self, epoch: int, start: int) -> None:
        self._page[:16] = struct.pack("<qq", epoch, start)
        if self.t is not None:
            self.t.copy_(torch.tensor([epoch, start], dtype=torch.int64))

    def __getstate__(self) -> dict[str, Any]:
        if self.t is None:  # from now on both are written: forked copies read the page, pickled ones the tensor
            self.t = torch.tensor(self.get(), dtype=torch.int64).share_memory_()
        return {"t": self.t}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._page, self.t = mmap.mmap(-1, 16), state["t"]


class PackedIterableDataset(_Resumable, IterableDataset):
    """Streams a packed dataset, split across DDP ranks and DataLoader workers.

    Every sample once per epoch across ranks and workers, plus with ``even="pad"``
    (the default) the first samples of the rest of the epoch repeated on the last
    step so every rank gets the same count (a rank with one batch fewer would hang
    DDP's all-reduce); ``"drop"`` leaves the last ``< world_size`` out; ``None`` keeps
    each sample exactly once. ``shuffle`` is seeded and changes with
    :meth:`set_epoch`; the order is quasi-random over ``window`` blocks/shards at a
    time so reads stay sequential, and does not depend on the world size.

    ``batch_size`` must be the DataLoader's (``packio.DataLoader`` sets it; ``None``
    for a loader with ``batch_size=None``): each worker then makes whole batches and
    the loader yields the rank's sequence in order. With ``on_error="skip"`` a
    skipped sample is a ``None`` in its place (``packio.collate`` drops it), so it
    still counts as consumed. :meth:`state_dict` / :meth:`load_state_dict` resume
    exactly; inside workers of torchdata's ``StatefulDataLoader`` they save and
    restore each worker's own position. ``options`` / its fields as keywords: as
    for :class:`PackedDataset`.
    """

    format_name: str | None = None
    kind = "iterable"

    def __init__(self, path: str | Path, *, shuffle: bool = False, seed: int = 0, batch_size: int | None = 1,
                 window: int = 8, rank: int | None = None, world_size: int | None = None,
                 even: str | None = "pad", options: DecodeOptions | None = None, **fields: Any) -> None:
        _not_a_url(path, type(self), iterable=True)
        self.shuffle, self.seed = _check_flags(shuffle, seed)
        self.batch_size = None if batch_size is None else check_int("batch_size", batch_size, 1)
        self.window, self.even = check_int("window", window, 1), check_even(even)
        self.rank, self.world_size = dist_info(rank, world_size)
        self._explicit_world = rank is not None and world_size is not None
        self.options = merge_options(DecodeOptions, options, fields, type(self).__name__)
        self.items = Items(path, self.format_name, self.options)
        self.path = str(path)
        self.length = len(self.reader)
        self._position = _SharedPosition()
        self._pass: _Pass | None = None
        self._generation = 0
        self._worker_resume: dict[str, Any] | None = None  # a worker's own state, loaded inside it
        self._units_digest: str | None = None
        self.whole_batches = False  # set by packio.DataLoader: yield whole batches (Batch), not sample dicts
        self.drop_last = False  # with whole_batches: leave out a last batch shorter than batch_size

    @property
    def reader(self) -> Reader:
        return self.items.reader

    @property
    def classes(self) -> list[str]:
        """Image class names: what ``label`` indexes."""
        return list(self.reader.manifest.classes)

    @property
    def box_classes(self) -> list[str]:
        """Box class names: what ``box_labels`` index."""
        return self.reader.manifest.box_class_names()

    def _get_position(self) -> tuple[int, int]:
        return self._position.get()

    def _set_position(self, epoch: int, start: int) -> None:
        self._position.set(epoch, start)

    def _order(self, epoch: int) -> np.ndarray:
        return epoch_order(self.length, shuffle=self.shuffle, seed=self.seed, epoch=epoch,
                           units=self.reader.units(), window=self.window)

    def _order_args(self) -> dict[str, Any]:
        """What a resume state must match besides length, seed and shuffle: the
        window, and the dataset and order units it was taken on."""
        if self._units_digest is None:
            self._units_digest = units_digest(self.reader.units())
        return {"window": self.window, "dataset": self.reader.manifest.id, "units": self._units_digest}

    def rank_sequence(self) -> np.ndarray:
        """This rank's sample indices for the rest of the current epoch."""
        return self.split().sequence()

    def __len__(self) -> int:
        return self._remaining_here()

    def __iter__(self) -> Iterator[Item | None]:
        info = get_worker_info()
        chunk = self.batch_size or 1
        if info is None:
            p = self._begin()
            p.chunk = chunk
            seq = p.split.sequence()
        else:
            p = self._worker_pass(info.id, info.num_workers, chunk)
            seq = worker_slice(p.split.sequence(), info.id, info.num_workers, chunk)
        self._pass = p
        self.reader.plan(seq[p.taken:])  # a streaming reader (remote shards) fetches them in this order
        return self._stream(seq, p)

    def _worker_pass(self, worker: int, workers: int, chunk: int) -> _Pass:
        """A worker's pass: from its own loaded state (consumed once), else from the
        shared position the training process set."""
        resume, self._worker_resume = self._worker_resume, None
        if resume is None:
            epoch, start = self._get_position()
            return _Pass(epoch, self.split(epoch, start), self._generation, worker=(worker, workers), chunk=chunk)
        want = {"rank": self.rank, "world_size": self.world_size, "num_workers": workers, "worker": worker,
                "chunk": chunk}
        got = {k: resume.get(k) for k in want}
        if got != want:
            raise StateError(f"a DataLoader worker state saved with {got} cannot resume with {want}: a worker's "
                             f"state resumes only with the same world size, num_workers and batch size; for a "
                             f"state that resumes anywhere use packio.DataLoader.state_dict()")
        split = self.split(resume["epoch"], resume["consumed"])
        mine = len(worker_slice(split.sequence(), worker, workers, chunk))
        done = resume.get("done")
        if isinstance(done, bool) or not isinstance(done, int) or not 0 <= done <= mine:
            raise StateError(f"a DataLoader worker state says done={done!r}, but this worker's share of the rest "
                             f"of the epoch is {mine} samples: the state is damaged; resume from a fresh one")
        return _Pass(resume["epoch"], split, self._generation, taken=done, worker=(worker, workers), chunk=chunk)

    def _stream(self, seq: np.ndarray, p: _Pass) -> Iterator[Batch | Item | None]:
        step = p.chunk
        for a in range(p.taken, len(seq), step):
            if step == 1 and not self.whole_batches:  # one sample at a time: no batch built around it
                p.taken += 1
                yield self.items.one(int(seq[a]))
                continue
            batch = self.items.get(seq[a:a + step])
            if self.whole_batches:  # packio.DataLoader's: one Batch per step
                if self.drop_last and len(batch) < step:
                    break
                p.taken += len(batch)
                yield batch
                continue
            for item in batch:
                p.taken += 1
                yield item
        if p.worker is None:
            self._end(p)
        else:
            p.finished = True

    def state_dict(self) -> dict[str, Any]:
        """See :meth:`_Resumable.state_dict`. Inside a DataLoader worker (torchdata's
        StatefulDataLoader asks there) it is that worker's own position."""
        p = self._pass
        if get_worker_info() is None or p is None or p.worker is None:
            return super().state_dict()
        state = self._state(p.split.start, p.epoch)
        return {**state, WORKER_STATE: 1, "rank": self.rank, "worker": p.worker[0], "num_workers": p.worker[1],
                "chunk": p.chunk, "done": p.taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if get_worker_info() is not None and isinstance(state, dict) and WORKER_STATE in state:
            read_state(state, self.kind, length=self.length, seed=self.seed, shuffle=self.shuffle,
                       **self._order_args())
            self._worker_resume = state
            return
        super().load_state_dict(state)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _pass=None)  # a pass holds the epoch's whole order: not worth pickling


class ResumableSampler(_Resumable, torch.utils.data.Sampler[int]):
    """A DDP sampler for map-style datasets that resumes mid-epoch: a seeded
    permutation per epoch (the same on any number of ranks), dealt to the ranks
    interleaved, with ``even`` as for the iterable reader (default ``"pad"``: equal
    counts, so equal batch counts, on every rank). Rank and world size come from
    ``torch.distributed`` when it is initialised and they are not given.

    :meth:`state_dict` counts the indices this sampler has handed out (what
    torchdata's ``StatefulDataLoader`` snapshots as each batch is drawn);
    ``packio.DataLoader`` counts the batches it has yielded instead.
    """

    kind = "sampler"

    def __init__(self, length: int | Sized, *, shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, even: str | None = "pad") -> None:
        n = len(length) if isinstance(length, Sized) and not isinstance(length, (int, np.integer)) else length
        self.length = check_int("length", n, 0)
        self.shuffle, self.seed = _check_flags(shuffle, seed)
        self.even = check_even(even)
        self.rank, self.world_size = dist_info(rank, world_size)
        self._explicit_world = rank is not None and world_size is not None
        self._epoch, self._start = 0, 0
        self._pass: _Pass | None = None
        self._generation = 0

    def _get_position(self) -> tuple[int, int]:
        return self._epoch, self._start

    def _set_position(self, epoch: int, start: int) -> None:
        self._epoch, self._start = epoch, start

    def _order(self, epoch: int) -> np.ndarray:
        return epoch_order(self.length, shuffle=self.shuffle, seed=self.seed, epoch=epoch)

    def __len__(self) -> int:
        return self._remaining_here()

    def __iter__(self) -> Iterator[int]:
        p = self._pass = self._begin()
        return self._indices(p)

    def _indices(self, p: _Pass) -> Iterator[int]:
        for i in p.split.sequence().tolist():
            p.taken += 1
            yield i
        self._end(p)


_FORMAT_CLASSES: dict[str, type] = {}


def format_classes() -> dict[str, type]:
    """``{prefix}Dataset`` / ``{prefix}IterableDataset`` for every registered format
    (``LMDBDataset``, ``TarIterableDataset``, ...): the generic classes pinned to one
    format. Made once per name, so pickling (spawn workers) finds the same class."""
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
