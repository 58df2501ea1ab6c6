"""Positions: an epoch's order, its split over ranks and workers, and where a run stands (its
:class:`Position`), all pure functions of (length, seed, epoch, ...). The global order never
depends on the world size, so a position ("consumed") resumes on any number of ranks and workers.
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

__all__ = ["epoch_order", "weighted_order", "rank_lengths", "worker_batches", "Split", "Cursor", "Position",
           "SharedPosition", "ResumableSampler", "dist_info", "check_epoch", "units_digest", "make_state", "read_state"]

STATE_VERSION = 2  # 2: iterable states name their dataset and its order units
MAX_EPOCH = (1 << 63) - 1  # epochs and positions travel as int64 (the workers' shared position)


def check_epoch(epoch: Any) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or not 0 <= epoch <= MAX_EPOCH:
        raise StateError(f"epoch must be an int from 0 to 2**63-1, not {epoch!r}")
    return int(epoch)


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int, units: Sequence[range] | None = None,
                window: int = 8) -> np.ndarray:
    """One epoch's order: a permutation, or quasi-random over ``units`` (shards, blocks read in
    sequence): the units permuted, shuffled together ``window`` at a time, so reads stay local."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    if units is None:
        return rng.permutation(n).astype(np.int64)
    perm, out = rng.permutation(len(units)), [np.zeros(0, np.int64)]
    for g in range(0, len(perm), window):
        idx = np.concatenate([np.arange(units[u].start, units[u].stop, dtype=np.int64) for u in perm[g:g + window]])
        out.append(idx[rng.permutation(len(idx))])
    return np.concatenate(out)


def weighted_order(weights: np.ndarray, draws: int, *, replacement: bool, seed: int, epoch: int) -> np.ndarray:
    """``draws`` indices drawn by ``weights`` (float64, >= 0): independent draws, or without
    replacement the first of a weighted random order (keys ``Exp(1) / w``, Efraimidis-Spirakis;
    weight 0: never drawn). A pure function of its arguments."""
    rng = np.random.default_rng([seed, epoch])
    if replacement:
        return rng.choice(len(weights), draws, p=weights / weights.sum()).astype(np.int64)
    with np.errstate(divide="ignore"):
        return np.argsort(rng.exponential(size=len(weights)) / weights, kind="stable")[:draws].astype(np.int64)


def rank_lengths(m: int, world: int, even: str | None) -> list[int]:
    """Each rank's share of ``m`` samples: ``"pad"`` equal (the first ones repeated at the end,
    as DistributedSampler does), ``"drop"`` equal (the last ``m % world`` left out), ``None`` exact."""
    if even == "pad":
        return [-(-m // world)] * world
    return [m // world + (even is None and r < m % world) for r in range(world)]


def worker_batches(n: int, worker: int, workers: int, chunk: int, done: int = 0) -> Iterator[tuple[int, int]]:
    """The ``[a, b)`` batches of a rank sequence of ``n`` that worker ``worker`` of ``workers`` reads
    after its first ``done`` samples: chunks ``worker, worker + workers, ...`` of ``chunk``, so the
    in-order loader yields the rank's sequence unchanged, whatever ``num_workers`` is."""
    c, skip = divmod(done, chunk)
    for first in range((c * workers + worker) * chunk, n, workers * chunk):
        yield first + skip, min(first + chunk, n)
        skip = 0


@dataclass(frozen=True)
class Split:
    """The rest of an epoch of ``length`` from ``start``, rank ``r`` taking positions ``start + r``,
    ``start + r + world``, ..."""

    length: int
    start: int
    rank: int
    world: int
    even: str | None

    def lengths(self) -> list[int]:
        return rank_lengths(max(0, self.length - self.start), self.world, self.even)

    @property
    def mine(self) -> int:
        return self.lengths()[self.rank]

    def span(self, a: int, b: int) -> np.ndarray:
        """Epoch positions of this rank's samples ``a .. b - 1`` (padding wraps to the first)."""
        k = np.arange(a, b, dtype=np.int64) * self.world + self.rank
        return self.start + (k % (self.length - self.start) if self.even == "pad" else k)

    def consumed(self, taken: int) -> int:
        """Global position once every rank took ``taken`` (DDP ranks step together): padding counts
        for nothing, and a rank at its end ends the epoch."""
        lengths = self.lengths()
        if taken >= lengths[self.rank]:
            return self.length
        return self.start + sum(min(taken, n) for n in lengths)


@dataclass
class Cursor:
    """One pass over the rest of an epoch, as one process reads it."""

    epoch: int
    split: Split
    generation: int  # the Position's generation it began in
    chunk: int = 1
    taken: int = 0  # samples of this process's sequence handed out (skipped ones included)
    worker: tuple[int, int] | None = None  # (id, num_workers) in a DataLoader worker
    finished: bool = False

    def advance(self, n: int) -> None:
        self.taken = min(self.taken + n, self.split.mine)

    def consumed(self) -> int:
        return self.split.length if self.finished else self.split.consumed(self.taken)


class SharedPosition:
    """(epoch, start), written by the training process, read by every DataLoader worker when it
    begins an epoch (persistent, spawned and forkserver ones included): an anonymous shared page
    (inherited by forked workers) and, once pickled, a torch shared-memory tensor."""

    def __init__(self) -> None:
        self.page, self.tensor = mmap.mmap(-1, 16), None

    def get(self) -> tuple[int, int]:
        epoch, start = self.tensor.tolist() if self.tensor is not None else struct.unpack("<qq", self.page[:16])
        return int(epoch), int(start)

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
    """The epoch and the start of its rest, an epoch of ``length`` dealt to the ranks, and the last
    pass begun on it here. :meth:`set_epoch` starts an epoch from its beginning unless it is the
    current one (a resumed epoch keeps its position); a pass that runs to the end of its epoch in
    the training process leaves it at the beginning again. Each jump (set_epoch, resume) is a new
    ``generation``: a cursor begun before one no longer says where the run stands."""

    def __init__(self, length: int, owner: str, *, rank: int | None = None, world_size: int | None = None,
                 even: str | None = "pad") -> None:
        if even not in (None, "pad", "drop"):
            raise ValueError(f"even must be None, 'pad' or 'drop', not {even!r}")
        self.length, self.owner, self.even = length, owner, even
        self.rank, self.world = dist_info(rank, world_size)
        self.explicit = rank is not None and world_size is not None
        self.shared, self.generation, self.cursor = SharedPosition(), 0, None

    @property
    def epoch(self) -> int:
        return self.shared.get()[0]

    def split(self, start: int | None = None) -> Split:
        start = self.shared.get()[1] if start is None else start
        return Split(self.length, start, self.rank, self.world, self.even)

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
        self.cursor = Cursor(epoch, self.split(start), self.generation, chunk, taken, worker)
        return self.cursor

    def live(self, cursor: Cursor) -> bool:
        return cursor.generation == self.generation

    def end(self, cursor: Cursor) -> None:
        cursor.finished = True
        if cursor.worker is None and self.live(cursor):
            self.shared.set(cursor.epoch, 0)

    def state_dict(self) -> dict[str, int]:
        """``epoch`` and ``consumed``: the last live pass's here, else the stored start."""
        c = self.cursor
        epoch, consumed = (c.epoch, c.consumed()) if c and c.worker is None and self.live(c) else self.shared.get()
        return {"epoch": epoch, "consumed": consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.jump(state["epoch"], state["consumed"])

    def check_world(self) -> None:
        """Catch an object built before init_process_group() (it would read everything on every rank)."""
        now = _torch_dist()
        if not self.explicit and now is not None and now[1] != self.world:
            raise PackioError(f"this {self.owner} was built for a world of {self.world} rank(s), but torch.distributed "
                              f"now has {now[1]}: build it after init_process_group(), or pass rank= and world_size=")

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, cursor=None)


class ResumableSampler(torch.utils.data.Sampler[int]):
    """A DDP sampler for map-style datasets that resumes mid-epoch: a seeded permutation per epoch
    (the same on any number of ranks) dealt to the ranks interleaved, ``even`` as for the iterable
    datasets. Rank and world size: given, else torch.distributed's. :meth:`state_dict` counts the
    indices handed out (what torchdata's StatefulDataLoader snapshots per batch);
    ``packio.DataLoader`` counts the batches it yielded (:meth:`state_at`). ``weights`` (one per
    sample, >= 0): each epoch is ``num_samples`` draws by weight instead (default: the length, or
    without ``replacement`` every sample of positive weight once), dealt and resumed the same way."""

    kind = "sampler"

    def __init__(self, length: int | Sized, *, shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, even: str | None = "pad", weights: Any = None,
                 replacement: bool = True, num_samples: int | None = None) -> None:
        import xxhash

        n = len(length) if isinstance(length, Sized) and not isinstance(length, (int, np.integer)) else length
        self.length, self.seed, self.shuffle = check_int("length", n, 0), check_int("seed", seed, 0), shuffle
        if not isinstance(shuffle, bool) or not isinstance(replacement, bool):
            raise TypeError(f"shuffle and replacement must be True or False, not {shuffle!r}, {replacement!r}")
        self.weights, draws = _weights(weights, self.length, shuffle, replacement, num_samples)
        self.replacement = replacement
        self.position = Position(draws, type(self).__name__, rank=rank, world_size=world_size, even=even)
        self.order_fields = {"seed": self.seed, "shuffle": shuffle, "weights": None if self.weights is None else
                             f"{replacement}:{xxhash.xxh3_64_hexdigest(self.weights.tobytes())}"}

    @property
    def epoch(self) -> int:
        return self.position.epoch

    def set_epoch(self, epoch: int) -> None:
        self.position.set_epoch(epoch)

    def __len__(self) -> int:
        return self.position.split().mine

    def __iter__(self) -> Iterator[int]:
        c = self.position.begin()
        order = epoch_order(self.length, shuffle=self.shuffle, seed=self.seed, epoch=c.epoch) if self.weights is None \
            else weighted_order(self.weights, c.split.length, replacement=self.replacement, seed=self.seed,
                                epoch=c.epoch)
        return self._indices(c, order[c.split.span(0, c.split.mine)].tolist())

    def _indices(self, c: Cursor, seq: list[int]) -> Iterator[int]:
        for i in seq:
            c.advance(1)
            yield i
        self.position.end(c)

    def state_at(self, epoch: int, consumed: int) -> dict[str, Any]:
        """The state (JSON-safe) at global position ``consumed`` of ``epoch``."""
        p = self.position
        return make_state(self.kind, epoch, consumed, p.length, p.world, p.even, **self.order_fields)

    def state_dict(self) -> dict[str, Any]:
        """The global position: the same on every rank; resumes on any number of ranks."""
        return self.state_at(**self.position.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` stopped; :class:`packio.StateError` when it cannot exactly."""
        epoch, consumed = read_state(state, self.kind, self.position.length, self.order_fields)
        self.position.load_state_dict({"epoch": epoch, "consumed": consumed})


def _weights(weights: Any, n: int, shuffle: bool, replacement: bool, num_samples: int | None
             ) -> tuple[np.ndarray | None, int]:
    """The weights checked (a copy: the caller's may change later) and the draws per epoch."""
    if weights is None:
        return None, n
    w = np.array(weights, np.float64)
    if w.shape != (n,) or not np.isfinite(w).all() or (w < 0).any() or not 0 < w.sum() < np.inf or not shuffle:
        raise ValueError(f"weights must be {n} finite numbers >= 0 (one per sample; got shape {w.shape}) with a "
                         f"positive finite sum, and they draw at random: leave shuffle=True")
    top = n if replacement else int(np.count_nonzero(w))
    draws = top if num_samples is None else check_int("num_samples", num_samples, 1)
    if draws > top and not replacement:
        raise ValueError(f"num_samples={draws}, but without replacement only the {top} samples of positive weight "
                         f"can be drawn; lower it or draw with replacement=True")
    return w, draws


def dist_info(rank: int | None = None, world: int | None = None) -> tuple[int, int]:
    """(rank, world size): given, else torch.distributed's when initialised, else (0, 1). Asked
    where the object is built (the training process), never in a DataLoader worker."""
    got = _torch_dist() if rank is None or world is None else None
    rank, world = (got[0] if rank is None else rank, got[1] if world is None else world) if got else (rank, world)
    rank = check_int("rank", 0 if rank is None else rank, 0)
    world = check_int("world_size", 1 if world is None else world, 1)
    if rank >= world:
        raise ValueError(f"rank {rank} is not within a world of size {world}")
    return rank, world


def _torch_dist() -> tuple[int, int] | None:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else None


def units_digest(units: Sequence[range]) -> str:
    """A fingerprint of the order units (shards, blocks): other units deal another order."""
    import xxhash

    bounds = np.array([(u.start, u.stop) for u in units], dtype=np.int64).reshape(-1, 2)
    return f"{len(bounds)}:{xxhash.xxh3_64_hexdigest(bounds.tobytes())}"


def make_state(kind: str, epoch: int, consumed: int, length: int, world: int, even: str | None,
               **order: Any) -> dict[str, Any]:
    """A JSON-safe resume state: the global position in one epoch and what fixes the order."""
    return {"packio_state": STATE_VERSION, "kind": kind, "epoch": int(epoch), "consumed": int(consumed),
            "length": int(length), "window": None, "dataset": None, "units": None, **order, "world_size": int(world),
            "even": even}


def read_state(state: Any, kind: str, length: int, want: dict[str, Any]) -> tuple[int, int]:
    """(epoch, consumed) of a state of this ``kind`` and ``length`` whose fields match ``want``. The
    world size and ``even`` may differ (the position is global); what changes the order is a
    :class:`StateError` saying why."""
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
    if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= length:
        raise StateError(f"state field 'consumed' must be an int from 0 to the epoch's {length}, not {consumed!r}")
    return epoch, consumed
