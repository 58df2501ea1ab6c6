"""Weighted mixing of several packio datasets, resumable like one.

A mix epoch of ``epoch_samples`` samples takes exactly ``counts[s]`` samples from
source ``s`` (the weights' shares of the epoch, largest-remainder rounded: each
count is within 1 of ``weight * epoch_samples`` and they sum to ``epoch_samples``).
The order of sources within the epoch is a seeded permutation of those counts;
the samples come from each source's own seeded epochs, one after another: draw
``d`` of source ``s`` (``d = epoch * counts[s] + k``) is sample ``d % len`` of the
source's epoch ``d // len``, so every sample of a source appears once per source
epoch, and the source reshuffles when it is exhausted. Everything is a pure
function of (seed, epoch): the mix is dealt to ranks and workers, and resumes on
any world size, exactly as :class:`packio.PackedIterableDataset` does.
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from packio.collation import Batch
from packio.datasets import PackedDataset, PackedIterableDataset, _SharedPosition
from packio.errors import StateError
from packio.formats.reader import Reader
from packio.items import Items
from packio.options import DecodeOptions, merge_options
from packio.order import check_even, check_int, dist_info, epoch_order, make_state, read_state

__all__ = ["mix", "MixedDataset", "MixedBatch"]

_MIX, _SOURCE, _PICK = 1, 2, 3  # distinct seed streams: the source order of a mix epoch, a source's epochs, picks


class MixedBatch(Batch):
    """A :class:`Batch` whose samples come from several sources: ``source`` (int64[B])
    says which (the position in ``mix(sources)``); ``label`` and ``index`` are that
    source's own class id and sample index."""

    def __init__(self, *args: Any, source: torch.Tensor, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.source = source

    def _all(self) -> list[dict[str, Any] | None]:
        if self._items is None:
            for item, s in zip(super()._all(), self.source.tolist()):
                if item is not None:
                    item["source"] = s
        return super()._all()

    def collated(self, packed: bool = False) -> dict[str, Any]:
        out = super().collated(packed)
        kept = self.kept
        out["source"] = self.source if kept is None else self.source[[j for j, k in enumerate(kept) if k]]
        return out


def shares(weights: Sequence[float] | None, lengths: list[int], epoch_samples: int | None) -> list[int]:
    """Samples per source in one mix epoch: ``weights`` (default: the sources' lengths)
    scaled to ``epoch_samples`` (default: all the sources' samples), largest remainder
    first (ties to the earlier source), so they sum exactly to ``epoch_samples``."""
    total = sum(lengths) if epoch_samples is None else check_int("epoch_samples", epoch_samples, 1)
    w = [float(x) for x in lengths] if weights is None else list(weights)
    if len(w) != len(lengths):
        raise ValueError(f"{len(w)} weights for {len(lengths)} sources: give one weight per source")
    if not all(isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in w) \
            or sum(w) <= 0:
        raise ValueError(f"weights must be finite numbers >= 0 with a positive sum, not {w!r}")
    ideal = np.asarray(w, np.float64) / sum(w) * total
    counts = np.floor(ideal).astype(np.int64)
    for s in np.argsort(-(ideal - counts), kind="stable")[: total - int(counts.sum())]:
        counts[s] += 1
    empty = [s for s, (c, n) in enumerate(zip(counts, lengths)) if c and not n]
    if empty:
        raise ValueError(f"source(s) {empty} hold no samples but have a positive weight: drop them or weigh them 0")
    return counts.tolist()


def _items(source: Any, options: DecodeOptions) -> tuple[Items, str]:
    """A source's Items and name: an opened packio dataset as it is (its own decode
    options), or a local path or an opened reader (a URL, opened by ``packio.mix``) read
    with the mix's options."""
    if isinstance(source, (PackedDataset, PackedIterableDataset)):
        return source.items, source.path
    if not isinstance(source, (str, Path, Reader)):
        raise TypeError(f"a mix source is a path, a URL or a packio dataset, not {type(source).__name__}")
    ds = PackedDataset(source, options=options)
    return ds.items, str(source)


class _Sources:
    """The sources' Items behind one global index: source ``s``'s sample ``i`` is
    ``offsets[s] + i``. What the iterable dataset's stream calls (``get``, ``one``, ``plan``)."""

    def __init__(self, items: list[Items]) -> None:
        self.items = items
        self.offsets = np.concatenate([[0], np.cumsum([len(x.reader) for x in items])]).astype(np.int64)

    def which(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, ids, side="right") - 1

    def plan(self, ids: np.ndarray) -> None:
        """Tell each streaming (remote) reader the part of ``ids`` it will read, in order."""
        src = self.which(np.asarray(ids, np.int64))
        for s, items in enumerate(self.items):
            items.reader.plan(ids[src == s] - self.offsets[s])

    def one(self, gid: int) -> dict[str, Any] | None:
        """Global sample ``gid`` as one sample of a :class:`MixedBatch` holding it."""
        s = int(np.searchsorted(self.offsets, gid, side="right")) - 1
        got = self.items[s].one(gid - int(self.offsets[s]))
        if got is not None:
            got["source"] = s
        return got

    def get(self, ids: Sequence[int]) -> MixedBatch:
        """One batch in the order of ``ids``: each source reads its part in one go."""
        ids = np.asarray(ids, np.int64)
        src = self.which(ids)
        parts = [(np.flatnonzero(src == s), self.items[s].get(ids[src == s] - self.offsets[s]))
                 for s in np.unique(src).tolist()]
        return _merge(parts, src)


def _images(parts: list[tuple[np.ndarray, Batch]], n: int) -> torch.Tensor | list[Any]:
    """One ``[B, C, H, W]`` tensor when every part's images are tensors of one shape,
    else a list of the images (``None`` for a skipped sample)."""
    shapes = {tuple(b.image.shape[1:]) if isinstance(b.image, torch.Tensor) else None for _, b in parts}
    if len(shapes) == 1 and None not in shapes:
        first = parts[0][1].image
        fmt = torch.channels_last if first.dim() == 4 and first.is_contiguous(
            memory_format=torch.channels_last) else torch.contiguous_format
        out = torch.empty((n, *first.shape[1:]), dtype=first.dtype, memory_format=fmt)
        for rows, b in parts:
            out[torch.from_numpy(rows)] = b.image
        return out
    images: list[Any] = [None] * n
    for rows, b in parts:
        for r, im in zip(rows.tolist(), b.image.unbind(0) if isinstance(b.image, torch.Tensor) else b.image):
            images[r] = im
    return images


def _merge(parts: list[tuple[np.ndarray, Batch]], src: np.ndarray) -> MixedBatch:
    """The sources' batches back in the mix's order, with a ``source`` column."""
    n = len(src)
    label, index = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    keys: list[str] = [""] * n
    kept = [True] * n
    boxes: list[Any] = [None] * n
    box_labels: list[Any] = [None] * n
    for rows, b in parts:
        at = torch.from_numpy(rows)
        label[at], index[at] = b.label, b.index
        for j, r in enumerate(rows.tolist()):
            keys[r], kept[r] = b.key[j], b.kept is None or b.kept[j]
        for r, bx, bl in zip(rows.tolist(), b.boxes.split(b.counts), b.box_labels.split(b.counts)):
            boxes[r], box_labels[r] = bx, bl
    counts = [len(x) for x in boxes]
    return MixedBatch(_images(parts, n), label, torch.cat(boxes) if n else torch.zeros((0, 4)),
                      torch.cat(box_labels) if n else torch.zeros(0, dtype=torch.int64), counts, keys, index, kept,
                      source=torch.from_numpy(src.astype(np.int64)))


class MixedDataset(PackedIterableDataset):
    """Several packio datasets streamed as one, by weight (see :func:`mix`).

    It is a :class:`PackedIterableDataset` in every other way: split over ranks and
    DataLoader workers, ``even``, ``batch_size``, ``set_epoch``, and a state that
    resumes on any world size and ``num_workers`` (``packio.DataLoader``'s too).
    """

    kind = "mix"

    def __init__(self, sources: Sequence[Any], weights: Sequence[float] | None = None, *,
                 epoch_samples: int | None = None, seed: int = 0, replacement: bool = False,
                 batch_size: int | None = 1, window: int = 8, rank: int | None = None,
                 world_size: int | None = None, even: str | None = "pad", options: DecodeOptions | None = None,
                 **fields: Any) -> None:
        if isinstance(sources, (str, Path)) or not len(sources):
            raise ValueError("mix() takes a list of sources (paths, URLs or packio datasets)")
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement must be True or False, not {replacement!r}")
        self.shuffle, self.seed, self.replacement = True, check_int("seed", seed, 0), replacement
        self.batch_size = None if batch_size is None else check_int("batch_size", batch_size, 1)
        self.window, self.even = check_int("window", window, 1), check_even(even)
        self.rank, self.world_size = dist_info(rank, world_size)
        self._explicit_world = rank is not None and world_size is not None
        self.options = merge_options(DecodeOptions, options, fields, type(self).__name__)
        opened = [_items(s, self.options) for s in sources]
        self.items = _Sources([it for it, _ in opened])  # type: ignore[assignment]
        self.names = [name for _, name in opened]
        self.path = " + ".join(self.names)
        self.lengths = [len(it.reader) for it, _ in opened]
        self.counts = shares(weights, self.lengths, epoch_samples)
        w = [float(x) for x in (self.lengths if weights is None else weights)]
        self.weights = [x / sum(w) for x in w]
        self.length = sum(self.counts)
        self._position = _SharedPosition()
        self._pass, self._generation, self._worker_resume = None, 0, None
        self.whole_batches, self.drop_last = False, False  # set by packio.DataLoader

    @property
    def reader(self) -> Any:  # what the stream asks to plan remote reads: the sources, each told its part
        return self.items

    @property
    def classes(self) -> list[list[str]]:  # type: ignore[override]
        """Each source's class names: a label is its own source's class id."""
        return [list(it.reader.manifest.classes) for it in self.items.items]  # type: ignore[attr-defined]

    def _choices(self, epoch: int) -> np.ndarray:
        """Which source each position of the mix epoch draws from."""
        rng = np.random.default_rng([self.seed, _MIX, epoch])
        return rng.permutation(np.repeat(np.arange(len(self.counts)), self.counts))

    def _source_order(self, s: int, epoch: int) -> np.ndarray:
        seed = int(np.random.SeedSequence([self.seed, _SOURCE, s]).generate_state(1)[0])
        return epoch_order(self.lengths[s], shuffle=True, seed=seed, epoch=epoch,
                           units=self.items.items[s].reader.units(), window=self.window)  # type: ignore[attr-defined]

    def _draws(self, s: int, first: int, n: int) -> np.ndarray:
        """Source ``s``'s samples for its draws ``first .. first + n - 1``."""
        size = self.lengths[s]
        if self.replacement:
            return np.random.default_rng([self.seed, _PICK, s, first]).integers(0, size, n)
        e0, e1 = first // size, (first + n - 1) // size
        seq = np.concatenate([self._source_order(s, e) for e in range(e0, e1 + 1)])
        return seq[first - e0 * size: first - e0 * size + n]

    def _order(self, epoch: int) -> np.ndarray:
        choices = self._choices(epoch)
        out = np.empty(len(choices), np.int64)
        offsets = self.items.offsets  # type: ignore[attr-defined]
        for s, c in enumerate(self.counts):
            if c:
                out[choices == s] = offsets[s] + self._draws(s, epoch * c, c)
        return out

    def _order_args(self) -> dict[str, Any]:
        """The window; the sources' ids and lengths are checked as the mix's identity (``mix``)."""
        return {"window": self.window}

    def _identity(self) -> dict[str, Any]:
        ids = [it.reader.manifest.id for it in self.items.items]  # type: ignore[attr-defined]
        return {"sources": [{"name": n, "id": i, "length": size} for n, i, size in zip(self.names, ids, self.lengths)],
                "weights": self.weights, "counts": self.counts, "replacement": self.replacement,
                "window": self.window}

    def positions(self, epoch: int, consumed: int) -> list[dict[str, Any]]:
        """Each source's position after ``consumed`` samples of mix epoch ``epoch``:
        ``draws`` taken from it so far, and (without replacement) its own ``epoch``
        and ``position`` in that epoch."""
        taken = np.bincount(self._choices(epoch)[:consumed], minlength=len(self.counts))
        out = []
        for s, (c, size) in enumerate(zip(self.counts, self.lengths)):
            d = epoch * c + int(taken[s])
            pos = {} if self.replacement or not size else {"epoch": d // size, "position": d % size}
            out.append({"name": self.names[s], "draws": d, **pos})
        return out

    def _state(self, consumed: int, epoch: int | None = None) -> dict[str, Any]:
        epoch = self.epoch if epoch is None else epoch
        state = make_state(self.kind, epoch=epoch, consumed=consumed, length=self.length, seed=self.seed,
                           shuffle=True, world=self.world_size, even=self.even, **self._order_args())
        return {**state, "mix": self._identity(), "sources": self.positions(epoch, consumed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """As :meth:`PackedIterableDataset.load_state_dict`; a state saved by another mix
        (other sources, weights, ``epoch_samples``, seed or ``replacement``) is a
        :class:`packio.StateError`."""
        epoch, consumed = read_state(state, self.kind, length=self.length, seed=self.seed, shuffle=True,
                                     **self._order_args())
        got, want = state.get("mix"), self._identity()
        for name in want:
            a = got.get(name) if isinstance(got, dict) else None
            a, b = (_source_keys(a), _source_keys(want[name])) if name == "sources" else (a, want[name])
            if a != b:
                raise StateError(f"this state was saved by another mix: its {name} {a!r} differ from this mix's "
                                 f"{b!r}; resume with the same sources, weights, epoch_samples, seed and replacement")
        if _unnamed(state.get("sources")) != _unnamed(self.positions(epoch, consumed)):
            raise StateError("this state's source positions do not follow from its mix position: it was edited "
                             "or saved by another packio; start the epoch again with set_epoch()")
        super().load_state_dict(state)


def _source_keys(sources: Any) -> Any:
    """What identifies the sources: each dataset's manifest id (its name when it has
    none) and length; the name alone may change (a copy moved to a bucket)."""
    if not isinstance(sources, list) or not all(isinstance(x, dict) for x in sources):
        return sources
    return [(x.get("id") or x.get("name"), x.get("length")) for x in sources]


def _unnamed(positions: Any) -> Any:
    """Source positions without the names (a moved copy keeps its position)."""
    if not isinstance(positions, list) or not all(isinstance(x, dict) for x in positions):
        return positions
    return [{k: v for k, v in x.items() if k != "name"} for x in positions]


def mix(sources: Sequence[Any], weights: Sequence[float] | None = None, *, epoch_samples: int | None = None,
        seed: int = 0, replacement: bool = False, **kwargs: Any) -> MixedDataset:
    """Stream several packio datasets as one, by weight: a :class:`MixedDataset`.

    ``sources``: paths, URLs (opened with the decode keywords given here) or opened
    packio datasets (their own decode options; give them one ``resize`` so a batch
    stacks into one tensor). ``weights``: one per source, any scale (default: the
    sources' lengths). ``epoch_samples``: samples per mix epoch (default: all the
    sources' samples together); each source gets its weight's share, rounded to
    whole samples by largest remainder (each within 1 of exact, summing exactly).
    Each source is read without replacement within its own epochs, reshuffled when
    exhausted; ``replacement=True`` picks each of a source's samples uniformly at
    random instead (repeats and misses within an epoch). Every sample carries
    ``source`` (its source's position in ``sources``), and batches a ``source``
    column. ``kwargs``: ``batch_size``, ``window``, ``rank``, ``world_size``,
    ``even`` and decode options, as for :class:`PackedIterableDataset`.
    """
    return MixedDataset(sources, weights, epoch_samples=epoch_samples, seed=seed, replacement=replacement, **kwargs)
