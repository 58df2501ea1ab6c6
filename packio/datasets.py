"""Map-style and iterable PyTorch datasets over any format's reader."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from packio import decode as dec
from packio import geometry as geo
from packio.collation import collate, ragged, unpack
from packio.errors import CorruptSampleError, DatasetReplacedError, FormatError, PackioError
from packio.formats import open_reader
from packio.formats.base import Reader
from packio.order import dist_info, epoch_order, rank_slice, worker_slice
from packio.sample import Sample, checksum

__all__ = ["PackedDataset", "PackedIterableDataset", "open_dataset", "format_classes", "ResumableSampler",
           "DataLoader", "DeferredBatch"]

log = logging.getLogger("packio")
Size = int | tuple[int, int] | None


def _resize_hw(resize: Size) -> tuple[int, int] | None:
    if resize is None:
        return None
    if isinstance(resize, int):
        return resize, resize
    h, w = resize
    return int(h), int(w)


class DeferredBatch:
    """What a worker of ``packio.DataLoader`` sends for a memory-mapped batch: only the
    indices; the main process reads the batch itself (see ``_Items.batch``)."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices


class _Items:
    """Turns stored samples into the dicts a training loop gets."""

    def __init__(self, path: str | Path, format_name: str | None, decode: bool, resize: Size,
                 transform: Callable[[torch.Tensor], Any] | None, backend: str, on_error: str,
                 verify: bool, threads: int = 0) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
        self.reader: Reader = open_reader(path)
        if format_name and self.reader.manifest.format != format_name:
            raise FormatError(f"{path} holds the {self.reader.manifest.format!r} format, not {format_name!r}; "
                              f"use packio.open_dataset() to open any format")
        self.decode, self.size, self.transform = decode, _resize_hw(resize), transform
        self.backend, self.on_error, self.verify = backend, on_error, verify
        self.errors = 0
        self.threads = threads  # decode threads per process (the decoders release the GIL)
        self._pool: tuple[int, Any] | None = None
        self.defer_images = False  # set by packio.DataLoader, which knows how to fill them in

    def item(self, i: int, s: Sample) -> dict[str, Any]:
        if self.verify and s.checksum and checksum(s.payload) != s.checksum:
            raise CorruptSampleError(s.key, "checksum mismatch")
        boxes = s.boxes
        if not self.decode:
            image: Any = s.payload if not isinstance(s.payload, np.ndarray) else torch.from_numpy(s.payload.copy())
        else:
            if isinstance(s.payload, np.ndarray):
                img = s.payload
            else:
                try:
                    img = dec.decode(s.payload, backend=self.backend, min_size=self.size)
                except ValueError as exc:
                    raise CorruptSampleError(s.key, f"image does not decode ({exc})") from None
            if self.size is not None:
                img = dec.resize(img, self.size)
            if len(boxes):  # from the stored size, not the decoded one (DCT scaling)
                try:
                    boxes = geo.resize(boxes, dec.stored_hw(s.payload, s.encoding, s.width, s.height), img.shape[:2])
                except ValueError as exc:
                    raise CorruptSampleError(s.key, f"image size unreadable ({exc})") from None
            image = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)
            if self.transform is not None:
                image = self.transform(image)
        return {"image": image, "label": s.label, "boxes": torch.from_numpy(np.asarray(boxes, np.float32)),
                "box_labels": torch.from_numpy(s.box_labels), "key": s.key, "index": i}

    def batch(self, indices: list[int]) -> dict[str, Any] | DeferredBatch | None:
        """A whole collated batch built in one go, or None to use the per-sample path.

        Fixed-shape raw formats: one gather from the reader. For memory-mapped ones,
        a worker of ``packio.DataLoader`` sends back only the indices: reading a
        page-cached batch in the main process beats moving it between processes
        (torch's shared-memory transfer: ~11x slower in tools/bench_levers.py). Encoded formats with a
        ``resize``: every image is decoded (on ``threads`` threads) and resized
        straight into its slot of the batch buffer: no per-sample tensors, no stack.
        """
        if not self.decode or self.transform is not None or self.verify or len(indices) < 2:
            return None
        shape = (self.reader.manifest.image or {}).get("shape")
        raw = bool(shape) and (self.size is None or tuple(self.size) == tuple(shape[:2]))
        if raw:
            if self.defer_images and self.reader.cheap_gather and get_worker_info() is not None:
                return DeferredBatch(indices)
            try:
                got = self.reader.read_batch(indices)
            except PackioError:
                got = None  # the per-sample path finds and reports the bad one
            if got is not None:
                return self._batch_dict(torch.from_numpy(got["image"]), got["label"], got["boxes"],
                                        got["box_labels"], got["key"], got["index"])
        if self.size is None:
            return None
        return self._decoded_batch(indices)

    def _batch_dict(self, hwc: torch.Tensor, labels: Any, boxes: list, box_labels: list, keys: list[str],
                    index: Any) -> dict[str, Any]:
        packed = self.defer_images and get_worker_info() is not None  # packio.DataLoader unpacks in the main process
        return {"image": hwc.permute(0, 3, 1, 2),  # NCHW shape, channels_last memory: no transpose copy
                "label": torch.as_tensor(np.asarray(labels, np.int64)),
                "boxes": ragged([torch.from_numpy(np.asarray(b, np.float32)) for b in boxes], packed),
                "box_labels": ragged([torch.from_numpy(np.asarray(b, np.int64)) for b in box_labels], packed),
                "key": list(keys), "index": torch.as_tensor(np.asarray(index, np.int64))}

    def _decoded_batch(self, indices: list[int]) -> dict[str, Any] | None:
        try:
            samples = self.reader.read_many(indices)
        except PackioError:
            return None
        h, w = self.size  # type: ignore[misc]
        n = len(samples)
        if get_worker_info() is not None:  # straight into shared memory: crosses to the main process as is
            out = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(n * h * w * 3)).view(n, h, w, 3)
        else:
            out = torch.empty((n, h, w, 3), dtype=torch.uint8)
        arr = out.numpy()

        def one(j: int) -> np.ndarray | PackioError:
            s = samples[j]
            try:
                img = s.payload if isinstance(s.payload, np.ndarray) else dec.decode(
                    s.payload, backend=self.backend, min_size=self.size)
                hw0 = dec.stored_hw(s.payload, s.encoding, s.width, s.height) if len(s.boxes) else (h, w)
            except ValueError as exc:
                return CorruptSampleError(s.key, f"image does not decode ({exc})")
            dec.resize(img, (h, w), out=arr[j])
            return geo.resize(s.boxes, hw0, (h, w))

        pool = self._executor() if self.threads > 1 else None
        boxes = list(pool.map(one, range(n)) if pool else map(one, range(n)))
        if any(isinstance(b, PackioError) for b in boxes):
            return None  # the per-sample path raises or skips, as on_error says
        return self._batch_dict(out, [s.label for s in samples], boxes, [s.box_labels for s in samples],
                                [s.key for s in samples], indices)

    def get(self, indices: list[int]) -> list[dict[str, Any] | None]:
        try:
            samples: list[Sample | None] = list(self.reader.read_many(indices))
        except PackioError:
            samples = []
            for i in indices:  # find which one failed; keep the others
                try:
                    samples.append(self.reader.read(i))
                except PackioError as exc:
                    samples.append(self._failed(exc))
        def one(pair: tuple[int, Sample | None]) -> dict[str, Any] | PackioError | None:
            try:
                return None if pair[1] is None else self.item(*pair)
            except PackioError as exc:
                return exc

        pairs = list(zip(indices, samples))
        results = self._executor().map(one, pairs) if self.threads > 1 and len(pairs) > 1 else map(one, pairs)
        return [self._failed(r) if isinstance(r, PackioError) else r for r in results]

    def _executor(self) -> Any:
        """A decode thread pool, one per process (a forked child makes its own)."""
        if self._pool is None or self._pool[0] != os.getpid():
            from concurrent.futures import ThreadPoolExecutor

            self._pool = (os.getpid(), ThreadPoolExecutor(self.threads, thread_name_prefix="packio-decode"))
        return self._pool[1]

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _pool=None)

    def _failed(self, exc: PackioError) -> None:
        if self.on_error == "raise" or isinstance(exc, DatasetReplacedError):  # not one bad sample: all are
            raise exc
        self.errors += 1
        if self.errors == 1 or self.errors % 100 == 0:
            log.warning("packio: skipped %d corrupt sample(s) so far; latest: %s", self.errors, exc)
        return None


class PackedDataset(Dataset):
    """Random access to a packed dataset: ``ds[i]`` → dict with ``image`` (``uint8``
    CHW tensor, or the stored bytes with ``decode=False``), ``label``, ``boxes``
    (``float32[N, 4]`` xyxy), ``box_labels``, ``key``, ``index``.

    ``resize=224`` or ``(h, w)`` resizes after decode (boxes follow). Handles open
    lazily in each process, so it works in DataLoader workers under fork and spawn.
    ``on_error="skip"`` returns ``None`` for a corrupt sample (``collate`` drops it).
    ``threads=N`` decodes each batch with N threads in whichever process reads it
    (libjpeg-turbo and OpenCV release the GIL): with ``num_workers=0`` this feeds
    from one process with no batch crossing between processes.
    """

    format_name: str | None = None

    def __init__(self, path: str | Path, *, decode: bool = True, resize: Size = None,
                 transform: Callable[[torch.Tensor], Any] | None = None, backend: str = "auto",
                 on_error: str = "raise", verify: bool = False, threads: int = 0) -> None:
        self.items = _Items(path, self.format_name, decode, resize, transform, backend, on_error, verify, threads)
        self.path = str(path)

    @property
    def reader(self) -> Reader:
        return self.items.reader

    @property
    def classes(self) -> list[str]:
        return list(self.reader.manifest.classes)

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> dict[str, Any] | None:
        return self.items.get([self.reader.check_index(i)])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any] | None] | dict[str, Any] | DeferredBatch:
        """Batch read (the DataLoader calls this with a batch's indices). Fixed-shape
        raw formats return the collated batch itself, or a ``DeferredBatch`` (``packio.collate``
        passes both on)."""
        indices = [self.reader.check_index(i) for i in indices]
        return self.items.batch(indices) or self.items.get(indices)

    def sample(self, i: int) -> Sample:
        """The stored sample itself (payload bytes/array and record), undecoded."""
        return self.reader.read(i)


class PackedIterableDataset(IterableDataset):
    """Streams a packed dataset, split across DataLoader workers and DDP ranks.

    Every sample once per epoch across all ranks and workers (``even="pad"`` /
    ``"drop"`` equalise counts per rank). ``shuffle`` is seeded and changes with
    :meth:`set_epoch`; the order is quasi-random over blocks/shards so reads stay
    sequential. ``batch_size`` should match the DataLoader's: then the loader
    yields the rank's sequence in order, and :meth:`state_dict` /
    :meth:`load_state_dict` resume exactly after ``consumed`` samples, with any
    ``num_workers``.
    """

    format_name: str | None = None

    def __init__(self, path: str | Path, *, shuffle: bool = False, seed: int = 0, batch_size: int = 1,
                 window: int = 8, rank: int | None = None, world_size: int | None = None,
                 even: str | None = None, decode: bool = True, resize: Size = None,
                 transform: Callable[[torch.Tensor], Any] | None = None, backend: str = "auto",
                 on_error: str = "raise", verify: bool = False, threads: int = 0) -> None:
        self.items = _Items(path, self.format_name, decode, resize, transform, backend, on_error, verify, threads)
        self.path = str(path)
        self.shuffle, self.seed, self.batch_size, self.window = shuffle, seed, batch_size, window
        self._rank, self._world, self.even = rank, world_size, even
        rank_slice(np.zeros(0, np.int64), *dist_info(rank, world_size), even)  # validate early
        self.epoch = 0
        self._start = 0  # samples of this epoch already consumed (resume)
        self._yielded = 0

    @property
    def reader(self) -> Reader:
        return self.items.reader

    @property
    def classes(self) -> list[str]:
        return list(self.reader.manifest.classes)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._start = int(epoch), 0

    def rank_sequence(self) -> np.ndarray:
        """This rank's full sequence of sample indices for the current epoch."""
        order = epoch_order(len(self.reader), shuffle=self.shuffle, seed=self.seed, epoch=self.epoch,
                            units=self.reader.units(), window=self.window)
        rank, world = dist_info(self._rank, self._world)
        return rank_slice(order, rank, world, self.even)

    def __len__(self) -> int:
        return len(self.rank_sequence())

    def __iter__(self) -> Iterator[dict[str, Any]]:
        seq = self.rank_sequence()[self._start:]
        info = get_worker_info()
        if info is not None:
            seq = worker_slice(seq, info.id, info.num_workers, self.batch_size)
        self._yielded = self._start
        step = max(1, min(self.batch_size, 64))
        for a in range(0, len(seq), step):
            for item in self.items.get([int(i) for i in seq[a:a + step]]):
                self._yielded += 1
                if item is not None:
                    yield item

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Resume point. ``consumed``: samples of this epoch the training loop has
        taken (count them from the batches); by default, what this process's
        iterator yielded (exact with ``num_workers=0``)."""
        return {"epoch": self.epoch, "consumed": self._yielded if consumed is None else int(consumed),
                "seed": self.seed, "shuffle": self.shuffle, "length": len(self.reader)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("length") != len(self.reader) or state.get("seed") != self.seed \
                or state.get("shuffle") != self.shuffle:
            raise ValueError("this state was saved for another dataset, seed or shuffle setting")
        self.epoch, self._start = int(state["epoch"]), int(state["consumed"])


def open_dataset(path: str | Path, *, iterable: bool = False, **kwargs: Any) -> PackedDataset | PackedIterableDataset:
    """Open any packed dataset (the format comes from its manifest)."""
    return (PackedIterableDataset if iterable else PackedDataset)(path, **kwargs)


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


class ResumableSampler(torch.utils.data.Sampler[int]):
    """Map-style counterpart of the iterable split: a seeded per-epoch permutation,
    this rank's interleaved share (``even`` as in :func:`packio.order.rank_slice`),
    and a resume offset. Works as a DDP sampler (rank / world size from
    ``torch.distributed`` when not given)."""

    def __init__(self, length: int, *, shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, even: str | None = None) -> None:
        self.length, self.shuffle, self.seed, self.even = length, shuffle, seed, even
        self.rank, self.world_size = dist_info(rank, world_size)
        rank_slice(np.zeros(0, np.int64), self.rank, self.world_size, even)
        self.epoch, self._start = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._start = int(epoch), 0

    def _seq(self) -> np.ndarray:
        order = epoch_order(self.length, shuffle=self.shuffle, seed=self.seed, epoch=self.epoch)
        return rank_slice(order, self.rank, self.world_size, self.even)

    def __len__(self) -> int:
        return len(self._seq()) - self._start

    def __iter__(self) -> Iterator[int]:
        return iter(self._seq()[self._start:].tolist())

    def state_dict(self, consumed: int) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": int(consumed), "seed": self.seed, "shuffle": self.shuffle,
                "length": self.length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("length") != self.length or state.get("seed") != self.seed:
            raise ValueError("this state was saved for another dataset or seed")
        self.epoch, self._start = int(state["epoch"]), int(state["consumed"])


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` with packio's ``collate`` and a resumable
    position: it counts the samples it hands out, and :meth:`state_dict` turns the
    count into the dataset's (iterable) or sampler's (map-style) resume point."""

    def __init__(self, dataset: Any, batch_size: int = 1, **kwargs: Any) -> None:
        workers = kwargs.get("num_workers", 0) > 0
        kwargs.setdefault("collate_fn", functools.partial(collate, packed=True) if workers else collate)
        if isinstance(dataset, PackedIterableDataset):
            dataset.batch_size = batch_size  # chunking that keeps the loader's order = the rank's sequence
        if isinstance(dataset, PackedDataset) and workers:
            dataset.items.defer_images = True  # this loader fills DeferredImages in (see _Items.batch)
        super().__init__(dataset, batch_size=batch_size, **kwargs)
        self._consumed = 0

    def _resumable(self) -> Any:
        if isinstance(self.dataset, PackedIterableDataset):
            return self.dataset
        if isinstance(self.sampler, ResumableSampler):
            return self.sampler
        raise TypeError("state_dict needs a packio iterable dataset, or sampler=packio.ResumableSampler(...)")

    def __iter__(self) -> Iterator[Any]:
        target = self._resumable() if isinstance(self.dataset, PackedIterableDataset) or isinstance(
            self.sampler, ResumableSampler) else None
        self._consumed = getattr(target, "_start", 0)
        for batch in super().__iter__():
            if isinstance(batch, DeferredBatch):
                batch = self.dataset.items.batch(batch.indices) or collate(self.dataset.items.get(batch.indices))
                if self.pin_memory:
                    batch["image"] = batch["image"].pin_memory()
            batch = unpack(batch)
            self._consumed += len(batch["label"]) if isinstance(batch, dict) else len(batch)
            yield batch
        if target is not None:
            target._start = 0  # the epoch is complete; the next one starts at its beginning

    def state_dict(self) -> dict[str, Any]:
        return self._resumable().state_dict(consumed=self._consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resumable().load_state_dict(state)
