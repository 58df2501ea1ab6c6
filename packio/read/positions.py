"""Positions: which sample comes where, and where a run stands.

The seeded order of an epoch, its split over DDP ranks and DataLoader workers, and the
resume state are pure functions of (length, seed, epoch, world size, ...): every process
computes them without talking to the others. An epoch's global order never depends on
the world size, so a position in it ("consumed": samples every rank together has taken)
means the same on any number of ranks and a state resumes elastically.

:class:`Position` is the resume stage every resumable object holds (the iterable
datasets, :class:`ResumableSampler`): the epoch and the start of its rest, shared with
DataLoader workers, and the :class:`Cursor` of the pass reading it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any, Iterator, Sequence, Sized

import numpy as np
import torch

from packio.errors import PackioError, StateError
from packio.options import check_int

__all__ = ["epoch_order", "rank_lengths", "worker_batches", "Split", "Cursor", "Position", "SharedPosition",
           "ResumableSampler", "dist_info", "check_even", "check_epoch", "units_digest", "make_state", "read_state"]

EVEN = (None, "pad", "drop")
STATE_VERSION = 2  # 2: iterable states name their dataset and its order units
MAX_EPOCH = (1 << 63) - 1  # epochs and positions travel as int64 (the workers' shared position)


def check_even(even: Any) -> str | None:
    if even not in EVEN:
        raise ValueError(f"even must be None, 'pad' or 'drop', not {even!r}")
    return even


def check_epoch(epoch: Any) -> int:
    """``epoch`` as a non-negative int below 2**63, else a :class:`StateError`."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or not 0 <= epoch <= MAX_EPOCH:
        raise StateError(f"epoch must be an int from 0 to 2**63-1, not {epoch!r}")
    return int(epoch)


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int, units: Sequence[range] | None = None,
                window: int = 8) -> np.ndarray:
    """The global order of one epoch: a permutation (``units=None``), or quasi-random over
    ``units`` (shards, blocks read in sequence): the units permuted, then grouped ``window``
    at a time and shuffled within each group, so reads stay local."""
    window = check_int("window", window, 1)
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    if units is None:
        return rng.permutation(n).astype(np.int64)
    perm = rng.permutation(len(units))
    out = []
    for g in range(0, len(perm), window):
        idx = np.concatenate([np.arange(units[u].start, units[u].stop, dtype=np.int64)
                              for u in perm[g:g + window]] or [np.zeros(0, np.int64)])
        out.append(idx[rng.permutation(len(idx))])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def rank_lengths(m: int, world: int, even: str | None) -> list[int]:
    """How many of ``m`` remaining samples each rank gets: ``"pad"`` the same count each (the
    first samples repeated at the end, as torch's DistributedSampler does), ``"drop"`` the
    same count with the last ``m % world`` left out, ``None`` each sample exactly once."""
    if even == "pad":
        return [-(-m // world)] * world
    if even == "drop":
        return [m // world] * world
    return [m // world + (r < m % world) for r in range(world)]


def worker_batches(n: int, worker: int, workers: int, chunk: int, done: int = 0) -> Iterator[tuple[int, int]]:
    """The ``[a, b)`` ranges of a rank sequence of ``n`` that DataLoader worker ``worker`` of
    ``workers`` reads, one batch each, after its first ``done`` samples: worker ``w`` takes
    chunks ``w, w + workers, ...`` of ``chunk``, so the in-order loader yields the rank's
    sequence unchanged, whatever ``num_workers`` is."""
    c, skip = divmod(done, chunk)
    for first in range((c * workers + worker) * chunk, n, workers * chunk):
        yield first + skip, min(first + chunk, n)
        skip = 0


def worker_share(n: int, worker: int, workers: int, chunk: int) -> int:
    return sum(b - a for a, b in worker_batches(n, worker, workers, chunk))


@dataclass(frozen=True)
class Split:
    """The rest of an epoch of ``length`` samples from ``start``, dealt to the ranks
    interleaved: rank ``r`` takes positions ``start + r``, ``start + r + world``, ..."""

    length: int
    start: int
    rank: int
    world: int
    even: str | None

    @property
    def remaining(self) -> int:
        return max(0, self.length - self.start)

    def lengths(self) -> list[int]:
        return rank_lengths(self.remaining, self.world, self.even)

    @property
    def mine(self) -> int:
        return self.lengths()[self.rank]

    def positions(self, a: int, b: int) -> np.ndarray:
        """Epoch positions of this rank's samples ``a .. b - 1`` (padding wraps to the first)."""
        k = np.arange(a, b, dtype=np.int64) * self.world + self.rank
        return self.start + (k % self.remaining if self.even == "pad" else k)

    def consumed(self, taken: int) -> int:
        """Global position after every rank took ``taken`` of its sequence (DDP ranks step
        together): padding counts for nothing, and a rank at its end ends the epoch."""
        lengths = self.lengths()
        if taken >= lengths[self.rank]:
            return self.length
        return self.start + min(self.remaining, sum(min(taken, n) for n in lengths))


@dataclass
class Cursor:
    """One pass over the rest of an epoch, as one process reads it."""

    epoch: int
    split: Split
    generation: int  # the Position's generation it started from
    chunk: int = 1
    taken: int = 0  # samples of this process's sequence handed out (skipped ones included)
    finished: bool = False
    worker: tuple[int, int] | None = None  # (id, num_workers) in a DataLoader worker

    def advance(self, n: int) -> None:
        self.taken = min(self.taken + n, self.split.mine)

    def consumed(self) -> int:
        return self.split.length if self.finished else self.split.consumed(self.taken)


class SharedPosition:
    """(epoch, start) the training process writes and every DataLoader worker reads when it
    begins an epoch: persistent, spawned and forkserver workers included. An anonymous
    shared page (inherited by forked workers, no descriptor) and, once pickled (spawn,
    forkserver), a torch shared-memory tensor sent as a handle."""

    def __init__(self) -> None:
        self.page = mmap.mmap(-1, 16)
        self.tensor: torch.Tensor | None = None

    def get(self) -> tuple[int, int]:
        if self.tensor is not None:
            epoch, start = self.tensor.tolist()
            return int(epoch), int(start)
        return struct.unpack("<qq", self.page[:16])

    def set(self, epoch: int, start: int) -> None:
        self.page[:16] = struct.pack("<qq", epoch, start)
        if self.tensor is not None:
            self.tensor.copy_(torch.tensor([epoch, start], dtype=torch.int64))

    def __getstate__(self) -> dict[str, Any]:
        if self.tensor is None:  # from now on both are written: forked copies read the page, pickled ones the tensor
            self.tensor = torch.tensor(self.get(), dtype=torch.int64).share_memory_()
        return {"tensor": self.tensor}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.page, self.tensor = mmap.mmap(-1, 16), state["tensor"]


class Position:
    """Epoch and global start of the rest of it for an epoch of ``length`` dealt to
    ``world`` ranks, and the last :class:`Cursor` begun on it in this process.

    ``set_epoch(e)`` starts epoch ``e`` from its beginning, except when ``e`` is already
    the current epoch (a loop that calls it after a resume keeps the resumed position).
    A pass that runs to the end of its epoch in the training process leaves the position
    at the epoch's beginning again. ``generation`` changes with every jump (set_epoch,
    resume): a cursor begun before one no longer says where the run stands."""

    def __init__(self, length: int, owner: str, *, rank: int | None = None, world_size: int | None = None,
                 even: str | None = "pad") -> None:
        self.length, self.owner, self.even = length, owner, check_even(even)
        self.rank, self.world = dist_info(rank, world_size)
        self.explicit = rank is not None and world_size is not None
        self.shared = SharedPosition()
        self.generation = 0
        self.cursor: Cursor | None = None

    @property
    def epoch(self) -> int:
        return self.shared.get()[0]

    def split(self, start: int | None = None) -> Split:
        """The rest of the epoch from ``start`` (default: the stored one), dealt to the ranks."""
        start = self.shared.get()[1] if start is None else start
        return Split(self.length, start, self.rank, self.world, self.even)

    def remaining_here(self) -> int:
        return self.split().mine

    def set_epoch(self, epoch: int) -> None:
        epoch = check_epoch(check_int("epoch", epoch, 0))
        self.check_world()
        if epoch != self.epoch:
            self.jump(epoch, 0)

    def jump(self, epoch: int, start: int) -> None:
        self.shared.set(epoch, start)
        self.cursor, self.generation = None, self.generation + 1

    def begin(self, chunk: int = 1, worker: tuple[int, int] | None = None, at: tuple[int, int] | None = None,
              taken: int = 0) -> Cursor:
        """A pass from the shared position (or ``at``: a worker's own saved one)."""
        if worker is None:
            self.check_world()
        epoch, start = at or self.shared.get()
        self.cursor = Cursor(epoch, self.split(start), self.generation, chunk, taken, worker=worker)
        return self.cursor

    def live(self, cursor: Cursor) -> bool:
        """Whether ``cursor`` still says where the run stands (no jump since it began)."""
        return cursor.generation == self.generation

    def end(self, cursor: Cursor) -> None:
        cursor.finished = True
        if cursor.worker is None and self.live(cursor):
            self.shared.set(cursor.epoch, 0)

    def now(self) -> tuple[int, int]:
        """(epoch, consumed): the last live pass's, else the stored start."""
        c = self.cursor
        if c is not None and c.worker is None and self.live(c):
            return c.epoch, c.consumed()
        return self.shared.get()

    def check_world(self) -> None:
        """Catch an object built before init_process_group() (it would read everything on every rank)."""
        now = _torch_dist()
        if not self.explicit and now is not None and now[1] != self.world:
            raise PackioError(f"this {self.owner} was built for a world of {self.world} rank(s), but "
                              f"torch.distributed now has {now[1]}: build it after init_process_group(), "
                              f"or pass rank= and world_size=")

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, cursor=None)


class ResumableSampler(torch.utils.data.Sampler[int]):
    """A DDP sampler for map-style datasets that resumes mid-epoch: a seeded permutation per
    epoch (the same on any number of ranks), dealt to the ranks interleaved, ``even`` as for
    the iterable datasets (default ``"pad"``). Rank and world size come from
    ``torch.distributed`` when it is initialised and they are not given.

    :meth:`state_dict` counts the indices handed out (what torchdata's
    ``StatefulDataLoader`` snapshots per batch); ``packio.DataLoader`` counts the batches
    it yielded instead (:meth:`state_at`)."""

    kind = "sampler"

    def __init__(self, length: int | Sized, *, shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, even: str | None = "pad") -> None:
        n = len(length) if isinstance(length, Sized) and not isinstance(length, (int, np.integer)) else length
        self.length = check_int("length", n, 0)
        self.shuffle, self.seed = check_flags(shuffle, seed)
        self.position = Position(self.length, type(self).__name__, rank=rank, world_size=world_size, even=even)

    @property
    def epoch(self) -> int:
        return self.position.epoch

    def set_epoch(self, epoch: int) -> None:
        self.position.set_epoch(epoch)

    def __len__(self) -> int:
        return self.position.remaining_here()

    def __iter__(self) -> Iterator[int]:
        return self._indices(self.position.begin())

    def _indices(self, c: Cursor) -> Iterator[int]:
        order = epoch_order(self.length, shuffle=self.shuffle, seed=self.seed, epoch=c.epoch)
        for i in order[c.split.positions(0, c.split.mine)].tolist():
            c.advance(1)
            yield i
        self.position.end(c)

    def state_at(self, epoch: int, consumed: int) -> dict[str, Any]:
        """The state at global position ``consumed`` of ``epoch`` (JSON-safe)."""
        return make_state(self.kind, epoch=epoch, consumed=consumed, length=self.length, world=self.position.world,
                          even=self.position.even, seed=self.seed, shuffle=self.shuffle)

    def state_dict(self) -> dict[str, Any]:
        """The global position: the same on every rank; resumes on any number of ranks."""
        return self.state_at(*self.position.now())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` stopped; :class:`packio.StateError` when it cannot exactly."""
        self.position.jump(*read_state(state, self.kind, self.length, {"seed": self.seed, "shuffle": self.shuffle}))


def check_flags(shuffle: Any, seed: Any) -> tuple[bool, int]:
    if not isinstance(shuffle, bool):
        raise TypeError(f"shuffle must be True or False, not {shuffle!r}")
    return shuffle, check_int("seed", seed, 0)


def dist_info(rank: int | None = None, world: int | None = None) -> tuple[int, int]:
    """(rank, world size): given, else torch.distributed's when initialised, else (0, 1).
    Called where the object is built (the training process), never in a DataLoader worker."""
    got = _torch_dist() if rank is None or world is None else None
    if got is not None:
        rank = got[0] if rank is None else rank
        world = got[1] if world is None else world
    rank = check_int("rank", 0 if rank is None else rank, 0)
    world = check_int("world_size", 1 if world is None else world, 1)
    if rank >= world:
        raise ValueError(f"rank {rank} is not within a world of size {world}")
    return rank, world


def _torch_dist() -> tuple[int, int] | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def units_digest(units: Sequence[range]) -> str:
    """A short fingerprint of the order units (shards, blocks): a state taken on other
    units would deal another order, even over the same samples."""
    import xxhash

    bounds = np.array([(u.start, u.stop) for u in units], dtype=np.int64).reshape(-1, 2)
    return f"{len(bounds)}:{xxhash.xxh3_64_hexdigest(bounds.tobytes())}"


def make_state(kind: str, *, epoch: int, consumed: int, length: int, world: int, even: str | None,
               **order: Any) -> dict[str, Any]:
    """A JSON-safe resume state: the global position in one epoch and what fixes the order
    (``seed``, ``shuffle``, ``window``, and what it was taken on)."""
    order = {"window": None, "dataset": None, "units": None, **order}
    return {"packio_state": STATE_VERSION, "kind": kind, "epoch": int(epoch), "consumed": int(consumed),
            "length": int(length), **order, "world_size": int(world), "even": even}


def read_state(state: Any, kind: str, length: int, want: dict[str, Any]) -> tuple[int, int]:
    """(epoch, consumed) of a state made by :func:`make_state` for the same order: each
    field of ``want`` must match. The world size and ``even`` may differ (the position is
    global); what changes the order is refused with a :class:`StateError` saying why."""
    if not isinstance(state, dict) or state.get("packio_state") != STATE_VERSION:
        raise StateError("not a packio resume state (or one from an older packio that did not record the "
                         "global position): it cannot resume exactly; start the epoch again with set_epoch()")
    if state.get("kind") != kind:
        raise StateError(f"this state was saved by a packio {state.get('kind')} but is loaded into a {kind}: "
                         f"they order samples differently; load it into the same kind of object")
    saved = state.get("length")
    if isinstance(saved, int) and not isinstance(saved, bool) and saved < length:
        raise StateError(f"this state was saved on {saved} samples, but the dataset now holds {length}: it grew "
                         f"since (packio convert --append?), which changes the order of every epoch, so the state "
                         f"cannot resume; start the epoch again with set_epoch(), or resume on the dataset as it was")
    for name, value in {"length": length, **want}.items():
        if state.get(name) != value:
            raise StateError(f"this state was saved with {name}={state.get(name)!r}, but this {kind} has "
                             f"{name}={value!r}: the order would differ; use the same {name}")
    epoch, consumed = check_epoch(state.get("epoch")), state.get("consumed")
    if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
        raise StateError(f"state field 'consumed' must be a non-negative int, not {consumed!r}")
    if consumed > length:
        raise StateError(f"state says {consumed} samples consumed, but the epoch has only {length}")
    return epoch, consumed
