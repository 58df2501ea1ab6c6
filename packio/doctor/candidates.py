"""Candidate storage layouts: pack a sample into each, time it with the loader
settings ``packio.tune`` picks, and say how to build and read the real thing."""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from packio import decode as dec
from packio.read.batch import collate, item
from packio.read.datasets import PackedDataset
from packio.doctor.stages import StageCosts
from packio.measure import Rate, throughput
from packio.tuning import measure, tune

__all__ = ["Layout", "layouts", "Candidate", "IndexedDataset", "FilesDataset", "repeat_index", "tune_and_measure", "process_settings", "measure_files", "output_name", "convert_line", "reader_lines", "pack", "enlarged"]


@dataclass(frozen=True)
class Layout:
    """One way to store the dataset, as ``packio convert`` options."""

    tag: str  # goes into the output name
    title: str
    format: str  # a name in packio's format registry
    resize: dec.ResizeSpec | None
    flags: tuple[str, ...]  # packio convert options
    reader_resize: int | None  # resize= for open_dataset (None: images come at the training size)
    keeps_crops: bool  # False: the training crop is fixed at pack time
    # Pack the sample from this layout's sample instead of the originals: reading speed
    # and size depend on the stored image's dimensions only, and this saves a full
    # decode of every original per layout.
    pack_from: str | None = None

    @property
    def suffix(self) -> str:
        """The output suffix the registry gives this layout's format."""
        from packio.formats import get_format

        return get_format(self.format).suffixes[0]


def layouts(size: int, quality: int = 90) -> list[Layout]:
    """Original bytes, JPEG and BMP pre-resized to a short side leaving room for
    random crops (256 for 224, the ImageNet habit), and uint8 at the training size."""
    short = max(size, round(size * 256 / 224))
    jpeg = f"jpeg{short}"
    return [
        Layout("orig", "original bytes, LMDB", "lmdb", None, (), size, True),
        Layout(jpeg, f"JPEG short side {short} q{quality}, LMDB", "lmdb",
               dec.ResizeSpec(short_side=short), ("--short-side", str(short), "--quality", str(quality)), size, True),
        Layout(f"bmp{short}", f"BMP short side {short}", "bmp", dec.ResizeSpec(short_side=short),
               ("--short-side", str(short)), size, True, pack_from=jpeg),
        Layout(f"u8-{size}", f"uint8 {size}x{size} arrays", "arrays", dec.ResizeSpec(size=(size, size)),
               ("--size", f"{size}x{size}"), None, False, pack_from=jpeg),
    ]


@dataclass
class Candidate:
    """A layout (or the data as it is now) with what measuring it found."""

    title: str
    tag: str
    samples_per_s: float = 0.0  # measured, wall clock
    cpu_per_sample: float = 0.0  # CPU seconds per sample (this process + its workers) while measured
    settings: dict[str, Any] = field(default_factory=dict)  # DataLoader kwargs + threads
    bytes_per_sample: float = 0.0
    full_bytes: float = 0.0  # extrapolated to the whole dataset
    pack_s_per_sample: float = 0.0
    stages: StageCosts | None = None
    convert_line: str = ""
    reader_lines: list[str] = field(default_factory=list)
    keeps_crops: bool = True
    now: bool = False  # the data as it is stored today (the baseline)
    note: str = ""
    error: str = ""
    estimated: str = ""  # why samples/s is an estimate from the stage costs (not timed), or ""
    enlarged: int = 0  # sampled images this layout stores with more pixels than they have
    timed_batch: int = 0  # the batch size timed, when smaller than the training batch (huge images)

    def ceiling(self, cpus: int) -> float:
        """Samples/s on ``cpus`` CPUs of its own, from the CPU time measured (an upper bound)."""
        return cpus / self.cpu_per_sample if self.cpu_per_sample > 0 else self.samples_per_s

    def measured(self, rate: Rate, settings: dict[str, Any]) -> None:
        self.samples_per_s, self.cpu_per_sample, self.settings = rate.samples_per_s, rate.cpu_per_sample, settings

    def estimate(self, cpus: int, why: str) -> None:
        """Samples/s from the stage costs on ``cpus`` decode threads, not timed (``why``)."""
        total = self.stages.total if self.stages is not None else 0.0
        self.cpu_per_sample = total
        self.samples_per_s = cpus / total if total > 0 else 0.0
        self.settings, self.estimated = {}, why


class IndexedDataset(PackedDataset):
    """A packed dataset seen through an index list (a sample of it, or one repeated so
    that an epoch is long enough to time: the DataLoader pipeline refills at each epoch)."""

    def __init__(self, path: str | Path, index: np.ndarray, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.index = np.asarray(index, np.int64)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any] | None:
        return super().__getitem__(int(self.index[i]))

    def __getitems__(self, indices: list[int]) -> Any:
        return super().__getitems__([int(self.index[i]) for i in indices])


class FilesDataset(torch.utils.data.Dataset):
    """One file per sample, decoded and resized with packio's decoder: an image
    folder read the straightforward way (the baseline for a folder source)."""

    def __init__(self, paths: list[str], size: int, index: np.ndarray) -> None:
        self.paths, self.size, self.index = paths, size, np.asarray(index, np.int64)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        j = int(self.index[i])
        with open(self.paths[j], "rb") as f:
            img = dec.decode(f.read(), min_size=(self.size, self.size))
        img = dec.resize(img, (self.size, self.size))
        return item(torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1), 0, torch.zeros(0, 4),
                    torch.zeros(0, dtype=torch.int64), str(j), j)


def repeat_index(n: int, batch_size: int, batches: int = 32) -> np.ndarray:
    """0..n-1 repeated until an epoch holds at least ``batches`` batches."""
    reps = max(1, -(-batches * batch_size // max(n, 1)))
    return np.tile(np.arange(n, dtype=np.int64), reps)


def tune_and_measure(ds: Any, batch_size: int, trial_s: float, workers: list[int],
                     threads: tuple[int, ...]) -> tuple[Rate, dict[str, Any]]:
    """``packio.tune`` picks the settings; then they are timed once more on their own
    (the winner of a noisy contest is biased high; a fresh run is not)."""
    best = tune(ds, batch_size=batch_size, seconds=trial_s, workers=workers, prefetch=(2,), threads=threads,
                verbose=False)
    return measure(ds, batch_size, trial_s, best), best


def process_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """DataLoader settings for a loader without decode threads: ``threads=N`` with no
    workers becomes N worker processes (the same CPUs, the only way a plain Dataset can use them)."""
    out = {k: v for k, v in settings.items() if k != "threads"}
    if not out.get("num_workers") and settings.get("threads", 0) > 1:
        out = {"num_workers": settings["threads"], "prefetch_factor": 2, "persistent_workers": True}
    return out


def measure_files(paths: list[str], size: int, batch_size: int, settings: dict[str, Any], seconds: float) -> Rate:
    """Samples/s of the one-file-per-sample baseline with these DataLoader keyword arguments."""
    ds = FilesDataset(paths, size, repeat_index(len(paths), batch_size))
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, collate_fn=collate, **settings)
    try:
        return throughput(loader, seconds)
    finally:
        del loader


def output_name(source_name: str, layout: Layout) -> str:
    return f"{source_name}-{layout.tag}{layout.suffix}"


def convert_line(src: Path, out: str, layout: Layout, csv: str | None, csv_columns: str | None = None) -> str:
    parts = ["packio", "convert", str(src), out, *layout.flags]
    if csv:
        parts += ["--csv", csv] + (["--csv-columns", csv_columns] if csv_columns else [])
    return shlex.join(parts)


def reader_lines(path: str, resize: int | None, batch_size: int, settings: dict[str, Any]) -> list[str]:
    """The Python that reads ``path`` with ``settings`` (as ``packio.tune`` returns them)."""
    ds_args = [repr(path)]
    if resize is not None:
        ds_args.append(f"resize={resize}")
    threads = settings.get("threads")
    if threads or (threads == 0 and not settings.get("num_workers")):  # 0 in this process: not the default
        ds_args.append(f"threads={threads}")
    dl = [f"batch_size={batch_size}", "shuffle=True"]
    dl += [f"{k}={v!r}" for k, v in settings.items() if k != "threads"]
    return [f"ds = packio.open_dataset({', '.join(ds_args)})",
            f"loader = packio.DataLoader(ds, {', '.join(dl)})"]


def pack(src: Path, dst: Path, layout: Layout, workers: int) -> tuple[int, float]:
    """Pack ``src`` (the exported sample, or another layout's pack of it) into
    ``layout`` at ``dst``: (samples packed, seconds)."""
    from packio.pack import convert

    t = time.perf_counter()
    s = convert(src, dst, format=layout.format, resize=layout.resize, workers=workers, progress=False,
                overwrite=True, follow_symlinks=True)  # the exported sample links to the source's files
    return s.packed, time.perf_counter() - t


def enlarged(layout: Layout, sizes: list[tuple[int, int]]) -> int:
    """How many images of (height, width) ``sizes`` the layout's resize enlarges."""
    from packio.pack.prepare import enlarges

    return sum(enlarges(layout.resize, h, w) for h, w in sizes) if layout.resize is not None else 0
