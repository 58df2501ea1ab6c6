"""Sample order: seeded epoch shuffles, rank / worker splits, resume offsets.

Everything here is a pure function of (length, seed, epoch, rank, world size), so
every process computes the same global order without talking to the others.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["epoch_order", "rank_slice", "worker_slice", "dist_info"]


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int,
                units: Sequence[range] | None = None, window: int = 8) -> np.ndarray:
    """The global order of one epoch.

    Without ``units``: a full permutation (map-style random access). With
    ``units`` (shards or blocks read sequentially): quasi-random — the units are
    permuted, then grouped ``window`` at a time and shuffled within each group, so
    reads stay local while the order still changes every epoch.
    """
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    if units is None:
        return rng.permutation(n).astype(np.int64)
    perm = rng.permutation(len(units))
    out = []
    for g in range(0, len(perm), max(1, window)):
        idx = np.concatenate([np.arange(units[u].start, units[u].stop, dtype=np.int64)
                              for u in perm[g:g + window]] or [np.zeros(0, np.int64)])
        out.append(idx[rng.permutation(len(idx))])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def rank_slice(order: np.ndarray, rank: int, world: int, even: str | None = None) -> np.ndarray:
    """This rank's share, interleaved (rank r takes positions r, r+world, ...).

    ``even="pad"`` repeats samples from the start so every rank gets the same count;
    ``even="drop"`` drops the tail instead; ``None`` keeps every sample exactly once.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not within a world of size {world}")
    if even not in (None, "pad", "drop"):
        raise ValueError(f"even must be None, 'pad' or 'drop', not {even!r}")
    n = len(order)
    if even == "drop":
        order = order[: n - n % world]
    elif even == "pad" and n % world and n:
        extra = world - n % world
        order = np.concatenate([order, np.resize(order, extra)])
    return order[rank::world]


def worker_slice(seq: np.ndarray, worker: int, num_workers: int, chunk: int) -> np.ndarray:
    """Worker ``w`` takes chunks ``w, w+num_workers, ...`` of ``chunk`` samples.

    With ``chunk`` equal to the DataLoader's batch size, the in-order DataLoader
    yields the rank's sequence unchanged, whatever ``num_workers`` is: that is what
    makes a resume offset (samples consumed) valid across worker counts.
    """
    chunk = max(1, chunk)
    pos = np.arange(len(seq))
    return seq[(pos // chunk) % num_workers == worker]


def dist_info(rank: int | None = None, world: int | None = None) -> tuple[int, int]:
    """(rank, world size): given explicitly, or from torch.distributed when initialised."""
    if rank is not None and world is not None:
        return rank, world
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    return (rank or 0), (world or 1)
