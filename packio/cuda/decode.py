"""Batched image decode onto the GPU, with a CPU fallback per image.

All JPEGs a GPU backend can take go to it in **one** batched call (one call per
image is slower than the CPU); only the images it cannot take are decoded by
packio's CPU decoder and copied over: CMYK/YCCK, 12-bit, lossless or arithmetic
JPEGs (screened from the header, never sent), PNG and other formats, and any
image the backend rejects. One odd image never sends the whole batch to the CPU.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np
import torch

from packio import decode as cpu
from packio.cuda.backends import Blob, DecodeBackend, get_backend
from packio.cuda.device import h2d, resolve, warn_once
from packio.errors import PackioError

__all__ = ["BatchDecoder", "JpegHeader", "cpu_decode", "decode_batch", "gpu_decodable", "jpeg_header"]

_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_GPU_SOF = {0xC0, 0xC1, 0xC2}  # baseline, extended sequential, progressive (Huffman)


class JpegHeader(NamedTuple):
    sof: int  # the frame marker: 0xC0 baseline, 0xC2 progressive, ...
    precision: int
    height: int
    width: int
    components: int


def jpeg_header(data: Blob) -> JpegHeader | None:
    """The frame header of a JPEG, or ``None`` when ``data`` is not a readable JPEG
    (the first SOF segment found by :func:`packio.decode.jpeg_segments`)."""
    b = memoryview(data).cast("B")
    for m, i, length in cpu.jpeg_segments(b):
        if m in _SOF:
            if i + 10 > len(b) or length < 8:
                return None
            return JpegHeader(m, b[i + 4], (b[i + 5] << 8) | b[i + 6], (b[i + 7] << 8) | b[i + 8], b[i + 9])
    return None


def gpu_decodable(data: Blob) -> bool:
    """JPEGs the GPU backends take: 8-bit Huffman baseline/progressive, gray or 3-component,
    within packio's pixel limit."""
    h = jpeg_header(data)
    if h is None or h.sof not in _GPU_SOF or h.precision != 8 or h.components not in (1, 3):
        return False
    try:  # empty, or a decompression bomb that would allocate on the GPU: the CPU path refuses it clearly
        cpu.check_pixels(h.width, h.height)
    except ValueError:
        return False
    return True


def _as_blob(x: Blob | torch.Tensor) -> Blob:
    return x.numpy().data if isinstance(x, torch.Tensor) else x


def cpu_decode(blob: Blob) -> torch.Tensor:
    """packio's CPU decoder → contiguous ``uint8[3, H, W]``."""
    return torch.from_numpy(np.ascontiguousarray(cpu.decode(blob).transpose(2, 0, 1)))


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    # simplejpeg and OpenCV release the GIL: CPU fallbacks decode in parallel.
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="packio-decode")


@dataclass
class BatchDecoder:
    """Decode batches of encoded images to ``uint8[3, H, W]`` tensors on ``device``.

    ``backend``: ``"auto"`` (torchvision, else nvImageCodec, else CPU), ``"cpu"``, a
    backend name, or any object with the :class:`DecodeBackend` interface. Counts
    what went where in ``gpu_decoded`` / ``cpu_decoded``.
    """

    device: str | torch.device | None = None
    backend: str | DecodeBackend = "auto"
    gpu_decoded: int = field(default=0, init=False)
    cpu_decoded: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.dev = resolve(self.device)
        if isinstance(self.backend, str):
            self.impl = None if self.dev.type != "cuda" else get_backend(self.backend)
            if self.impl is None and self.dev.type == "cuda" and self.backend == "auto":
                warn_once("no-gpu-decoder", "packio.cuda: no GPU JPEG decoder installed, decoding on the CPU; "
                          "pip install 'packio[nvimgcodec]' (or [nvimgcodec-cu13]) or 'packio[gpu]'")
        else:
            self.impl = self.backend

    def __call__(self, blobs: Sequence[Blob | torch.Tensor], keys: Sequence[str] | None = None,
                 ) -> list[torch.Tensor]:
        data = [_as_blob(b) for b in blobs]
        out: list[torch.Tensor | None] = [None] * len(data)
        if self.impl is not None:
            idx = [i for i, b in enumerate(data) if gpu_decodable(b)]
            if idx:
                for i, img in zip(idx, self.impl.decode([data[i] for i in idx], self.dev)):
                    out[i] = img
        rest = [i for i, img in enumerate(out) if img is None]
        self.gpu_decoded += len(data) - len(rest)
        self.cpu_decoded += len(rest)
        args = (rest, [data[i] for i in rest], [keys[i] if keys else None for i in rest])
        decoded = _pool().map(self._cpu_one, *args) if len(rest) > 1 else map(self._cpu_one, *args)
        for i, img in zip(rest, decoded):
            out[i] = h2d(img, self.dev)
        return out  # type: ignore[return-value]

    @staticmethod
    def _cpu_one(i: int, blob: Blob, key: str | None) -> torch.Tensor:
        try:
            return cpu_decode(blob)
        except ValueError as exc:
            where = f"sample {key!r}" if key is not None else f"image {i} of the batch"
            raise PackioError(f"{where} cannot be decoded ({exc}); re-pack it, or read with on_error='skip'") \
                from None


@functools.lru_cache(maxsize=8)
def _decoder(device: torch.device, backend: str) -> BatchDecoder:
    return BatchDecoder(device, backend)


def decode_batch(blobs: Sequence[Blob | torch.Tensor], device: str | torch.device | None = None,
                 backend: str = "auto") -> list[torch.Tensor]:
    """Decode encoded images to ``uint8[3, H, W]`` tensors on ``device`` (see :class:`BatchDecoder`)."""
    return _decoder(resolve(device), backend)(blobs)
