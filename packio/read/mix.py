"""Weighted mixing: several sources as one, itself a source like any other (mixes nest).

An epoch takes exactly ``counts[s]`` from source ``s`` (integer shares). :class:`Plan` places them a
chunk at a time: before boundary ``x`` source ``s`` drew ``(counts[s] * x + phase[s]) // epoch_samples``
(a seeded phase), each chunk shuffled; no array of the epoch's length, and every stretch holds the
shares. Draw ``d`` of ``s`` is position ``d % len(s)`` of its own epoch ``d // len(s)``.
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from packio.errors import StateError
from packio.options import DecodeOptions, check_int, merge_options
from packio.read.batch import Batch, Item, merge
from packio.formats.columns import LabelColumns
from packio.formats.reader import Reader
from packio.read.datasets import Packed, PackedDataset, PackedIterableDataset, Source
from packio.read.decoder import Decoder

__all__ = ["mix", "MixedDataset", "Mix", "Plan", "shares"]

_MIX, _SOURCE, _PICK = 1, 2, 3  # distinct seed streams: the plan of a mix epoch, a source's epochs, picks
CHUNK = 1024  # positions per chunk of the plan
MIX_VERSION = 2  # 2: the chunked plan (older mixes drew in another order)


def _exact(weights: Sequence[Any]) -> list[Fraction]:
    return [Fraction(x) if isinstance(x, numbers.Rational) else Fraction(float(x)) for x in weights]


def shares(weights: Sequence[float] | None, lengths: list[int], epoch_samples: int | None) -> list[int]:
    """Samples per source in a mix epoch: ``weights`` (default: the lengths) scaled to ``epoch_samples``
    (default: their sum) in exact fractions, largest remainder first (ties: the earlier source)."""
    total = sum(lengths) if epoch_samples is None else check_int("epoch_samples", epoch_samples, 1)
    w = list(lengths) if weights is None else list(weights)
    if len(w) != len(lengths):
        raise ValueError(f"{len(w)} weights for {len(lengths)} sources: give one weight per source")
    if not all(isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in w) \
            or not any(x > 0 for x in w) or total >= 1 << 62:
        raise ValueError(f"weights must be finite numbers >= 0 with a positive sum (not {w!r}), and "
                         f"epoch_samples below 2**62 (not {total})")
    exact = _exact(w)
    ints = [int(f * math.lcm(*(f.denominator for f in exact))) for f in exact]
    counts, rest = map(list, zip(*(divmod(x * total, sum(ints)) for x in ints)))
    for s in sorted(range(len(w)), key=lambda s: -rest[s])[: total - sum(counts)]:
        counts[s] += 1
    empty = [s for s, (c, n) in enumerate(zip(counts, lengths)) if c and not n]
    if empty:
        raise ValueError(f"source(s) {empty} hold no samples but have a positive weight: drop them or weigh them 0")
    return counts


class Plan:
    """Which source each position of a mix epoch draws from, and how many draws of it come before:
    one chunk at a time (chunk ``j`` starts less than ``len(counts) <= k`` from ``j * k``)."""

    def __init__(self, counts: list[int], seed: int) -> None:
        self.counts, self.n, self.seed, self.k = counts, sum(counts), seed, max(CHUNK, len(counts))
        self.chunks: dict[tuple[int, int], tuple[list[int], np.ndarray, np.ndarray]] = {}

    def before(self, epoch: int, j: int) -> list[int]:
        """Draws of each source before chunk ``j``."""
        phase = np.random.default_rng([self.seed, _MIX, epoch]).integers(0, self.n, len(self.counts)).tolist()
        x = min(j * self.k, self.n)
        return [(c * x + r) // self.n for c, r in zip(self.counts, phase)]

    def chunk(self, epoch: int, j: int) -> tuple[list[int], np.ndarray, np.ndarray]:
        """(draws before chunk ``j``, the source of each of its positions, each one's draw within it)."""
        if (epoch, j) not in self.chunks:
            a = self.before(epoch, j)
            n = np.subtract(self.before(epoch, j + 1), a)
            src = np.random.default_rng([self.seed, _MIX, epoch, j]).permutation(np.repeat(np.arange(len(n)), n))
            within = np.empty(len(src), np.int64)
            within[np.argsort(src, kind="stable")] = np.arange(len(src)) - np.repeat(np.cumsum(n) - n, n)
            if len(self.chunks) >= 8:  # a few batches' worth
                self.chunks.clear()
            self.chunks[(epoch, j)] = (a, src, within)
        return self.chunks[(epoch, j)]

    def where(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The chunk holding each position: ``p // k``, or one of its neighbours."""
        g = positions // self.k
        firsts = np.unique(np.concatenate([g, g + 1]))
        starts = np.array([sum(self.before(epoch, j)) for j in firsts.tolist()], np.int64)
        at = starts[np.searchsorted(firsts, g)], starts[np.searchsorted(firsts, g + 1)]
        return g - (positions < at[0]) + (positions >= at[1])

    def locate(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, draws of it in this epoch before) of each position."""
        src, drawn = np.empty(len(positions), np.int64), np.empty(len(positions), np.int64)
        chunk = self.where(epoch, positions)
        for j in np.unique(chunk).tolist():
            rows = np.flatnonzero(chunk == j)
            a, s, within = self.chunk(epoch, j)
            o = positions[rows] - sum(a)
            src[rows], drawn[rows] = s[o], np.asarray(a, np.int64)[s[o]] + within[o]
        return src, drawn

    def taken(self, epoch: int, consumed: int) -> list[int]:
        """Draws of each source in the first ``consumed`` positions of ``epoch``."""
        if consumed >= self.n:
            return list(self.counts)
        a, s, _ = self.chunk(epoch, int(self.where(epoch, np.array([consumed]))[0]))
        return [x + int(np.count_nonzero(s[:consumed - sum(a)] == k)) for k, x in enumerate(a)]


def _split(base: int, rel: np.ndarray, size: int) -> tuple[int, np.ndarray, np.ndarray]:
    """``base + rel`` (``base`` may pass int64) divided by ``size``: ``(base // size, rest // size, rest % size)``."""
    lo = base % size + rel
    return base // size, lo // size, lo % size


class Mix(Source):
    """Sources mixed by weight (see the module); ids are ``offsets[s]`` + source ``s``'s ids."""

    def __init__(self, sources: list[Source], names: list[str], weights: Sequence[float] | None, *,
                 epoch_samples: int | None, seed: int, replacement: bool, window: int,
                 options: DecodeOptions) -> None:
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement must be True or False, not {replacement!r}")
        self.sources, self.names, self.options, self.name = sources, names, options, " + ".join(names)
        self.seed, self.replacement, self.window = seed, replacement, window
        self.lengths = [len(s) for s in sources]
        self.counts = shares(weights, self.lengths, epoch_samples)
        exact = _exact(self.lengths if weights is None else weights)
        self.weights = [float(x / sum(exact)) for x in exact]
        self.planner = Plan(self.counts, seed)
        self.offsets = np.cumsum([0] + [s.space for s in sources]).tolist()
        self.space, self.streams = self.offsets[-1], any(s.streams for s in sources)
        self.classes, self.class_map = _union([s.classes for s in sources])
        self.box_classes, self.box_map = _union([s.box_classes for s in sources])

    def __len__(self) -> int:
        return sum(self.counts)

    def ids(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        src, drawn = self.planner.locate(epoch, positions)
        out = np.empty(len(positions), np.int64)
        for s in np.unique(src).tolist():
            rows, size, first = np.flatnonzero(src == s), self.lengths[s], epoch * self.counts[s]
            hi, epochs, at = _split(first, drawn[rows], size)
            if self.replacement:  # uniform picks, drawn CHUNK at a time per seeded block of draws
                b0, blocks, k = _split(first, drawn[rows], CHUNK)
                for b in np.unique(blocks).tolist():
                    sel = blocks == b
                    at[sel] = np.random.default_rng([self.seed, _PICK, s, b0 + b]).integers(0, size, CHUNK)[k[sel]]
            for e in np.unique(epochs).tolist():
                sel = epochs == e
                out[rows[sel]] = self.offsets[s] + self.sources[s].ids(hi + e, at[sel])
        return out

    def _which(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, ids, side="right") - 1

    def read(self, ids: np.ndarray, epoch: int) -> Batch:
        """One batch in the order of ``ids``: each source reads its part in one go."""
        src, parts = self._which(ids), []
        for s in np.unique(src).tolist():
            rows = np.flatnonzero(src == s)
            b = self.sources[s].read(ids[rows] - self.offsets[s], epoch)
            b.label, b.box_labels = _relabel(b.label, self.class_map[s]), _relabel(b.box_labels, self.box_map[s])
            parts.append((rows, b))
        return merge(parts, src)

    def one(self, i: int, epoch: int) -> Item | None:
        s = int(self._which(np.array([i]))[0])
        got = self.sources[s].one(i - self.offsets[s], epoch)
        if got is not None:
            got["label"] = int(_relabel(torch.tensor([got["label"]]), self.class_map[s])[0])
            got["box_labels"], got["source"] = _relabel(got["box_labels"], self.box_map[s]), s
        return got

    def plan(self, ids: np.ndarray) -> None:
        src = self._which(ids)
        for s, source in enumerate(self.sources):
            if source.streams:
                source.plan(ids[src == s] - self.offsets[s])

    def identity(self) -> dict[str, Any]:  # names aside: a copy moved to a bucket keeps its place
        return {"version": MIX_VERSION, "sources": [s.identity() for s in self.sources], "weights": self.weights,
                "counts": self.counts, "replacement": self.replacement, "window": self.window}

    def order_state(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": True, "window": self.window}

    def state_at(self, epoch: int, consumed: int) -> dict[str, Any]:
        """What the mix is, and each source's ``draws`` after ``consumed`` samples of mix epoch ``epoch``
        and (without replacement) its own ``epoch`` and ``position`` in it, nested for a mix."""
        out = []
        for s, (taken, c, size) in enumerate(zip(self.planner.taken(epoch, consumed), self.counts, self.lengths)):
            d = epoch * c + taken
            pos = {} if self.replacement or not size else {"epoch": d // size, "position": d % size}
            inner = self.sources[s].state_at(d // size, d % size) if pos else {}
            out.append({"name": self.names[s], "draws": d, **pos, **inner})
        return {"mix": self.identity(), "sources": out}

    def check_state(self, state: dict[str, Any], epoch: int, consumed: int) -> None:
        saved, want = state.get("mix"), self.identity()
        if not isinstance(saved, dict) or saved.get("version") != MIX_VERSION:
            raise StateError("this mix state was saved by an older packio, whose mixes drew in another order: it "
                             "cannot resume this mix exactly; start the epoch again with set_epoch()")
        for name in (n for n in want if saved.get(n) != want[n]):
            raise StateError(f"this state was saved by another mix: its {name} {saved.get(name)!r} differ from "
                             f"this mix's {want[name]!r}; resume with the same sources, weights, epoch_samples, "
                             f"seed and replacement")
        if _unnamed(state.get("sources")) != _unnamed(self.state_at(epoch, consumed)["sources"]):
            raise StateError("this state's source positions do not follow from its mix position: it was edited "
                             "or saved by another packio; start the epoch again with set_epoch()")

    def decoders(self) -> list[Decoder]:
        return [d for s in self.sources for d in s.decoders()]

    def columns(self) -> LabelColumns:  # by id: the sources' one after another, in the mix's classes
        return LabelColumns.joined([s.columns() for s in self.sources], self.class_map)


def _union(lists: list[list[str]]) -> tuple[list[str], list[list[int]]]:
    """One list of names (first seen first: source 0's ids stay its own), and each list's ids in it."""
    ids: dict[str, int] = {}
    maps = [[ids.setdefault(name, len(ids)) for name in names] for names in lists]
    return list(ids), maps


def _relabel(labels: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """A source's class ids as the mix's (-1, and an id the source does not name: -1)."""
    return torch.tensor([*ids, -1], dtype=torch.int64)[torch.where((labels >= 0) & (labels < len(ids)), labels, -1)]


def _unnamed(positions: Any) -> Any:
    """Source positions without the names, nested (a moved copy keeps its position)."""
    if not isinstance(positions, list) or not all(isinstance(x, dict) for x in positions):
        return positions
    return [{k: _unnamed(v) for k, v in x.items() if k != "name"} for x in positions]


def _source(src: Any, k: int, seed: int, window: int, options: DecodeOptions) -> tuple[Source, str]:
    """Source ``k`` and its name: a mix as it is (its own order); a packio dataset (its own decode
    options) or a local path / an opened reader (``packio.mix`` opens URLs; read with the mix's
    options) in an order seeded by the mix."""
    if isinstance(src, (str, Path, Reader)):
        src = PackedDataset(src, options=options)
    if isinstance(src, PackedIterableDataset) and not isinstance(src.source, Packed):
        return src.source, src.path
    if not isinstance(src, (PackedDataset, PackedIterableDataset)):
        raise TypeError(f"a mix source is a path, a URL or a packio dataset, not {type(src).__name__}")
    own = int(np.random.SeedSequence([seed, _SOURCE, k]).generate_state(1)[0])
    return Packed(src.reader, src.decoder, shuffle=True, seed=own, window=window), src.path


class MixedDataset(PackedIterableDataset):
    """Several packio datasets streamed as one, by weight (see :func:`mix`); a
    :class:`PackedIterableDataset` in every other way (ranks, workers, ``even``, ``set_epoch``, a
    state that resumes on any world size and ``num_workers``). ``mix``: its :class:`Mix`."""

    kind = "mix"

    def __init__(self, sources: Sequence[Any], weights: Sequence[float] | None = None, *,
                 epoch_samples: int | None = None, seed: int = 0, replacement: bool = False,
                 batch_size: int | None = 1, window: int = 8, rank: int | None = None,
                 world_size: int | None = None, even: str | None = "pad", options: DecodeOptions | None = None,
                 **fields: Any) -> None:
        if isinstance(sources, (str, Path)) or not len(sources):
            raise ValueError("mix() takes a list of sources (paths, URLs or packio datasets)")
        options = merge_options(DecodeOptions, options, fields, type(self).__name__)
        seed, window = check_int("seed", seed, 0), check_int("window", window, 1)
        opened = [_source(s, k, seed, window, options) for k, s in enumerate(sources)]
        self.mix = Mix([s for s, _ in opened], [name for _, name in opened], weights, epoch_samples=epoch_samples,
                       seed=seed, replacement=replacement, window=window, options=options)
        super().__init__(self.mix, batch_size=batch_size, rank=rank, world_size=world_size, even=even)

    @property
    def class_map(self) -> list[list[int]]:
        """Per source, its class ids as ids of :attr:`classes`: ``class_map[s][label]``."""
        return self.mix.class_map

    def positions(self, epoch: int, consumed: int) -> list[dict[str, Any]]:
        """Each source's position after ``consumed`` samples of mix epoch ``epoch`` (as in the state)."""
        return self.mix.state_at(epoch, consumed)["sources"]


def mix(sources: Sequence[Any], weights: Sequence[float] | None = None, *, epoch_samples: int | None = None,
        seed: int = 0, replacement: bool = False, **kwargs: Any) -> MixedDataset:
    """Stream several packio datasets as one, by weight: a :class:`MixedDataset`.

    ``sources``: paths, URLs (opened with the decode keywords given here), opened packio datasets
    (their own decode options: give them one ``resize`` so a batch stacks) or other mixes (nested,
    in their own order). ``weights``: one per source, finite numbers >= 0 of any scale (default:
    the sources' lengths; a mix's is its ``epoch_samples``). ``epoch_samples``: samples per mix
    epoch (default: all the sources' together), each source's share exact to within 1 and spread
    evenly over the epoch. Each source is read without replacement within its own epochs,
    reshuffled when exhausted; ``replacement=True`` picks its samples uniformly at random instead.
    Labels are ids of one class list, ``classes``: the union of the sources' names, first seen
    first (source 0 keeps its ids; one name in two sources is one class); ``class_map[s]`` maps
    source ``s``'s ids into it; box labels likewise (``box_classes``). Samples carry ``source``
    (the position in ``sources``), batches a ``source`` column. ``kwargs``: ``batch_size``,
    ``window``, ``rank``, ``world_size``, ``even`` and decode options (see PackedIterableDataset)."""
    return MixedDataset(sources, weights, epoch_samples=epoch_samples, seed=seed, replacement=replacement, **kwargs)
