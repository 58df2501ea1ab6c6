"""Sample order: seeded epoch shuffles, the rank / worker split, resume positions.

Everything here is a pure function of (length, seed, epoch, world size, ...), so
every process computes the same order without talking to the others.

The global order of an epoch never depends on the world size. A position in it
("consumed": how many of its samples every rank together has taken) therefore
means the same thing on any number of ranks: a job stopped after ``consumed``
samples deals the rest of the epoch, ``order[consumed:]``, to however many ranks
it resumes on (MosaicML calls this elastic determinism).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["epoch_order", "rank_slice", "rank_lengths", "worker_slice", "Split", "dist_info", "make_state",
           "read_state", "check_int", "check_even", "check_epoch", "units_digest"]

EVEN = (None, "pad", "drop")


def check_int(name: str, value: Any, low: int | None = None) -> int:
    """``value`` as an int (bools refused), at least ``low``; a clear error otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, not {value}")
    return int(value)


def check_even(even: Any) -> str | None:
    if even not in EVEN:
        raise ValueError(f"even must be None, 'pad' or 'drop', not {even!r}")
    return even


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int,
                units: Sequence[range] | None = None, window: int = 8) -> np.ndarray:
    """The global order of one epoch.

    Without ``units``: a full permutation (map-style random access). With
    ``units`` (shards or blocks read sequentially): quasi-random — the units are
    permuted, then grouped ``window`` at a time and shuffled within each group, so
    reads stay local while the order still changes every epoch.
    """
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
    """How many of ``m`` remaining samples each rank gets (see :func:`rank_slice`)."""
    if even == "pad":
        return [-(-m // world)] * world
    if even == "drop":
        return [m // world] * world
    return [m // world + (r < m % world) for r in range(world)]


def rank_slice(order: np.ndarray, rank: int, world: int, even: str | None = "pad") -> np.ndarray:
    """This rank's share, interleaved (rank r takes positions r, r+world, ...).

    ``even="pad"`` repeats the first samples of ``order`` at its end so every rank
    gets the same count (as torch's DistributedSampler does); ``"drop"`` leaves the
    last ``len(order) % world`` out; ``None`` keeps every sample exactly once, and
    ranks may then differ by one sample.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not within a world of size {world}")
    check_even(even)
    n = len(order)
    if even == "drop":
        order = order[: n - n % world]
    elif even == "pad" and n % world:
        order = np.concatenate([order, np.resize(order, world - n % world)])
    return order[rank::world]


def worker_slice(seq: np.ndarray, worker: int, num_workers: int, chunk: int) -> np.ndarray:
    """Worker ``w`` takes chunks ``w, w+num_workers, ...`` of ``chunk`` samples.

    With ``chunk`` equal to the DataLoader's batch size, each batch is one chunk and
    the in-order DataLoader yields the rank's sequence unchanged, whatever
    ``num_workers`` is: batch ``k`` covers positions ``[k*chunk, (k+1)*chunk)``.
    """
    chunk = max(1, chunk)
    pos = np.arange(len(seq))
    return seq[(pos // chunk) % num_workers == worker]


@dataclass(frozen=True)
class Split:
    """The rest of one epoch, dealt to the ranks: ``order[start:]`` interleaved."""

    order: np.ndarray  # the epoch's global order
    start: int  # global samples already consumed
    rank: int
    world: int
    even: str | None

    @property
    def remaining(self) -> int:
        return max(0, len(self.order) - self.start)

    def lengths(self) -> list[int]:
        return rank_lengths(self.remaining, self.world, self.even)

    def sequence(self) -> np.ndarray:
        """This rank's sample indices, in order."""
        return rank_slice(self.order[self.start:], self.rank, self.world, self.even)

    def consumed(self, taken: int) -> int:
        """Global position after every rank has taken ``taken`` of its sequence (the
        ranks of a DDP job step together): padding counts for nothing, and a rank at
        the end of its sequence means the epoch is complete (samples ``"drop"`` left
        out included)."""
        lengths = self.lengths()
        if taken >= lengths[self.rank]:
            return len(self.order)
        return self.start + min(self.remaining, sum(min(taken, n) for n in lengths))


def dist_info(rank: int | None = None, world: int | None = None) -> tuple[int, int]:
    """(rank, world size): given explicitly, else from torch.distributed when it is
    initialised, else (0, 1). Call it where the dataset or sampler is built (the
    training process), never in a DataLoader worker: there torch.distributed is not
    initialised, whatever the start method."""
    if rank is None or world is None:
        got = _torch_dist()
        if got is not None:
            rank = got[0] if rank is None else rank
            world = got[1] if world is None else world
    rank = check_int("rank", 0 if rank is None else rank, 0)
    world = check_int("world_size", 1 if world is None else world, 1)
    if rank >= world:
        raise ValueError(f"rank {rank} is not within a world of size {world}")
    return rank, world


def dist_world() -> int | None:
    """torch.distributed's world size when initialised (a check, not a source of truth)."""
    got = _torch_dist()
    return None if got is None else got[1]


def _torch_dist() -> tuple[int, int] | None:
    """(rank, world size) from torch.distributed when it is initialised, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


STATE_VERSION = 2  # 2: iterable states name their dataset and its order units
MAX_EPOCH = (1 << 63) - 1  # epochs and positions travel as int64 (the workers' shared position)


def check_epoch(epoch: Any) -> int:
    """``epoch`` as a non-negative int below 2**63, else a :class:`StateError`."""
    from packio.errors import StateError

    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or not 0 <= epoch <= MAX_EPOCH:
        raise StateError(f"epoch must be an int from 0 to 2**63-1, not {epoch!r}")
    return int(epoch)


def units_digest(units: Sequence[range]) -> str:
    """A short fingerprint of the order units (shards, blocks): a state taken on other
    units would deal another order, even over the same samples."""
    import xxhash

    bounds = np.array([(u.start, u.stop) for u in units], dtype=np.int64).reshape(-1, 2)
    return f"{len(bounds)}:{xxhash.xxh3_64_hexdigest(bounds.tobytes())}"


def make_state(kind: str, *, epoch: int, consumed: int, length: int, seed: int, shuffle: bool, world: int,
               even: str | None, window: int | None = None, dataset: str | None = None,
               units: str | None = None) -> dict[str, Any]:
    """A JSON-safe resume state: the global position in one epoch, what fixes the
    order, and (iterable) the dataset id and order units it was taken on."""
    return {"packio_state": STATE_VERSION, "kind": kind, "epoch": int(epoch), "consumed": int(consumed),
            "length": int(length), "seed": int(seed), "shuffle": bool(shuffle), "window": window,
            "world_size": int(world), "even": even, "dataset": dataset, "units": units}


def read_state(state: Any, kind: str, *, length: int, seed: int, shuffle: bool,
               window: int | None = None, dataset: str | None = None, units: str | None = None) -> tuple[int, int]:
    """(epoch, consumed) of a state made by :func:`make_state` for the same order.

    The world size and ``even`` may differ (the position is global); anything that
    changes the order itself is refused with a :class:`StateError` saying why."""
    from packio.errors import StateError

    if not isinstance(state, dict) or state.get("packio_state") != STATE_VERSION:
        raise StateError("not a packio resume state (or one from an older packio that did not record the "
                         "global position): it cannot resume exactly; start the epoch again with set_epoch()")
    if state.get("kind") != kind:
        raise StateError(f"this state was saved by a packio {state.get('kind')} but is loaded into a {kind}: "
                         f"they order samples differently; load it into the same kind of object")
    want = {"length": length, "seed": seed, "shuffle": shuffle}
    if kind == "iterable":
        want.update(dataset=dataset, units=units, **({"window": window} if shuffle else {}))
    saved = state.get("length")
    if isinstance(saved, int) and not isinstance(saved, bool) and saved < length:
        raise StateError(f"this state was saved on {saved} samples, but the dataset now holds {length}: it grew "
                         f"since (packio convert --append?), which changes the order of every epoch, so the state "
                         f"cannot resume; start the epoch again with set_epoch(), or resume on the dataset as it was")
    for name, value in want.items():
        if state.get(name) != value:
            raise StateError(f"this state was saved with {name}={state.get(name)!r}, but this {kind} has "
                             f"{name}={value!r}: the order would differ; use the same {name}")
    epoch, consumed = check_epoch(state.get("epoch")), state.get("consumed")
    if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
        raise StateError(f"state field 'consumed' must be a non-negative int, not {consumed!r}")
    if consumed > length:
        raise StateError(f"state says {consumed} samples consumed, but the epoch has only {length}")
    return epoch, consumed
