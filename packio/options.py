"""Option objects: what shapes a packed output (:class:`PackOptions`) and what shapes
the samples a dataset hands out (:class:`DecodeOptions`).

Each checks its fields once, when made; ``convert`` and the dataset classes take
one as ``options=`` and also every field as a keyword (a keyword wins over the
field of ``options``; a name that is no field is a ``TypeError``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from packio import geometry as geo
from packio.decode import ResizeSpec
from packio.errors import PackioError

__all__ = ["PackOptions", "DecodeOptions", "ENCODE_CHOICES", "CHECKS", "RANGES", "GEOMETRY_FIELDS", "merge_options",
           "check_int"]

ENCODE_CHOICES = ("keep", "jpeg", "png", "bmp")
CHECKS = ("auto", "header", "decode")
ON_ERROR = ("raise", "skip")
# Accepted ranges of the packing numbers (the CLI's argument types use the same).
RANGES = {"quality": (1, 100), "shards": (1, 10**7), "shard_samples": (1, 10**9), "shard_bytes": (1, 1 << 50),
          "max_pixels": (1, 1 << 40)}

T = TypeVar("T", "PackOptions", "DecodeOptions")


def check_int(name: str, value: Any, low: int | None = None) -> int:
    """``value`` as an int (bools refused), at least ``low``; a clear error otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, not {value}")
    return int(value)


def _in_range(name: str, v: Any) -> None:
    lo, hi = RANGES[name]
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not lo <= v <= hi:
        raise PackioError(f"{name} must be an integer from {lo} to {hi}, got {v!r}")


@dataclass(frozen=True)
class PackOptions:
    """What shapes the packed output of :func:`packio.convert`.

    ``format``: a registered format's name (default: from the output's suffix).
    ``resize``: pre-resize geometry (:class:`packio.ResizeSpec`). ``encode``:
    ``"keep"`` stores each image's bytes as found where the format can hold them;
    ``"jpeg"`` (at ``quality``), ``"png"`` or ``"bmp"`` re-encode. ``check``: how
    strictly images are decoded (``"auto"``, ``"header"``, ``"decode"``; see
    ``convert``). ``max_pixels``: the decompression-bomb guard (default
    ``packio.limits.MAX_PIXELS``). Tar: ``shards`` or ``shard_samples`` per shard,
    and a shard ends at ``shard_bytes``.
    """

    format: str | None = None
    resize: ResizeSpec = field(default_factory=ResizeSpec)
    encode: str = "keep"
    quality: int = 90
    check: str = "auto"
    max_pixels: int | None = None
    shards: int | None = None
    shard_samples: int | None = None
    shard_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.resize is None:  # convert(resize=None) has always meant "no resize"
            object.__setattr__(self, "resize", ResizeSpec())
        if not isinstance(self.resize, ResizeSpec):
            raise TypeError(f"resize must be a packio.ResizeSpec, not {type(self.resize).__name__}")
        if self.format is not None and not isinstance(self.format, str):
            raise TypeError(f"format must be a format name, not {type(self.format).__name__}")
        if self.encode not in ENCODE_CHOICES:
            raise PackioError(f"encode must be one of {', '.join(ENCODE_CHOICES)}, got {self.encode!r}")
        if self.check not in CHECKS:
            raise PackioError(f"check must be one of {', '.join(CHECKS)}, got {self.check!r}")
        for name in ("quality", "shard_bytes", "shards", "shard_samples", "max_pixels"):
            if getattr(self, name) is not None:
                _in_range(name, getattr(self, name))
        if self.shards is not None and self.shard_samples is not None:
            raise PackioError("give the number of shards or the samples per shard, not both")


@dataclass(frozen=True)
class DecodeOptions:
    """What shapes the samples a packed dataset hands out.

    ``decode=False`` hands out the stored bytes (pre-resized raw formats: their
    pixels as a CHW tensor). ``resize=224`` or ``(h, w)`` resizes after decoding
    by *squashing* to 224x224 / (h, w): the aspect ratio is not kept (torchvision's
    ``Resize(224)`` sets the short side instead; for that, pack with
    ``ResizeSpec(short_side=...)``). Boxes follow; it is kept as ``(h, w)``. ``transform`` is called on each CHW
    ``uint8`` image. ``backend``: ``"auto"`` or one of
    ``packio.decode.available_backends()``. ``on_error="skip"`` hands out ``None``
    for a corrupt sample. ``verify`` checks each sample's checksum (and decodes
    JPEGs strictly). ``threads=N`` decodes each batch with N threads; the default
    (``None``) uses as many as torch's own CPU threads (``torch.get_num_threads()``:
    the cores in a training process, 1 in a DataLoader worker), or 1 with a
    ``transform`` (which then sees the samples in order, on one thread).

    Read-time geometry, decoded on the decode threads into the one batch buffer
    (torchvision's names and rules; see :class:`packio.geometry.Recipe`; boxes follow):
    ``random_resized_crop=224`` (with ``crop_scale``, ``crop_ratio``) for training;
    ``short_side=256, center_crop=224`` for evaluation; ``flip_p=0.5`` mirrors
    left-right with that chance; ``min_visible``: a box with less of its area inside
    the crop is dropped. Crops and flips are a pure function of ``(crop_seed, epoch,
    sample index)``: no global RNG, the same on any threads, workers, ranks or resume.
    """

    decode: bool = True
    resize: tuple[int, int] | None = None
    transform: Callable[[Any], Any] | None = None
    backend: str = "auto"
    on_error: str = "raise"
    verify: bool = False
    threads: int | None = None
    random_resized_crop: tuple[int, int] | None = None
    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.0
    short_side: int | None = None
    center_crop: tuple[int, int] | None = None
    min_visible: float = 0.0
    crop_seed: int = 0

    def __post_init__(self) -> None:
        from packio import decode as dec

        if not isinstance(self.decode, bool) or not isinstance(self.verify, bool):
            raise TypeError("decode and verify must be True or False")
        if self.transform is not None and not callable(self.transform):
            raise TypeError(f"transform must be callable, not {type(self.transform).__name__}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be 'raise' or 'skip', not {self.on_error!r}")
        if self.backend != "auto" and self.backend not in dec.available_backends():
            # checked here: at decode time it would read as a corrupt sample, every sample
            raise ValueError(f"backend must be 'auto' or one of {dec.available_backends()}, not {self.backend!r}")
        if self.threads is not None:
            object.__setattr__(self, "threads", check_int("threads", self.threads, 0))
        size = _output_size(self.resize)
        if size is not None:
            dec.check_pixels(size[1], size[0])  # ValueError: the resize target is the user's
        if size is not None and not self.decode:
            raise ValueError(f"resize={self.resize!r} needs decode=True: with decode=False the stored bytes are "
                             f"handed out as they are; resize after your own decode, or drop resize=")
        object.__setattr__(self, "resize", size)
        self._check_geometry()

    def _check_geometry(self) -> None:
        """The read-time geometry fields, checked and stored normalised (sizes as (h, w))."""
        object.__setattr__(self, "crop_seed", check_int("crop_seed", self.crop_seed, 0))
        recipe = geo.Recipe(**{f: getattr(self, f) for f in GEOMETRY_FIELDS})  # ValueError: the user's values
        for name in GEOMETRY_FIELDS:
            object.__setattr__(self, name, getattr(recipe, name))
        if recipe.size is not None:
            from packio import decode as dec

            dec.check_pixels(recipe.size[1], recipe.size[0])
        if recipe.active and not self.decode:
            raise ValueError("random_resized_crop, short_side, center_crop and flip_p need decode=True: with "
                             "decode=False the stored bytes are handed out as they are")

    @functools.cached_property
    def recipe(self) -> geo.Recipe | None:
        """The read-time geometry (:class:`packio.geometry.Recipe`) when there is any
        besides a plain squash ``resize``; None otherwise."""
        recipe = geo.Recipe(**{f: getattr(self, f) for f in GEOMETRY_FIELDS})
        return recipe if recipe.active else None

    @property
    def out_size(self) -> tuple[int, int] | None:
        """(h, w) of every decoded image when the options fix it (the geometry's output, else
        ``resize``); None when it follows each image's size."""
        return self.recipe.size if self.recipe is not None else self.resize


# The DecodeOptions fields that are a packio.geometry.Recipe's, by the same names.
GEOMETRY_FIELDS = ("resize", "random_resized_crop", "crop_scale", "crop_ratio", "flip_p", "short_side",
                   "center_crop", "min_visible")


def _output_size(resize: Any) -> tuple[int, int] | None:
    """``resize`` as (h, w): an int is a square; sizes are positive ints."""
    if resize is None:
        return None
    hw = (resize, resize) if isinstance(resize, (int, np.integer)) else tuple(resize)
    if len(hw) != 2 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in hw):
        raise ValueError(f"resize must be a positive int or (height, width), not {resize!r}")
    return int(hw[0]), int(hw[1])


def merge_options(cls: type[T], options: T | None, overrides: Mapping[str, Any], caller: str) -> T:
    """``options`` (default: ``cls()``) with the fields in ``overrides`` replaced; a key
    that names no field is a TypeError, as an unknown keyword argument would be."""
    if options is not None and not isinstance(options, cls):
        raise TypeError(f"{caller}(): options must be a packio.{cls.__name__}, not {type(options).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in overrides if k not in names]
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    base = cls() if options is None else options
    return dataclasses.replace(base, **overrides) if overrides else base
