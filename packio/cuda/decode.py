"""Batched JPEG decode on the GPU (nvjpeg through torchvision), with a per-image
CPU fallback so that one odd image never fails a batch."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from packio import decode as cpu
from packio.cuda.device import resolve
from packio.errors import PackioError

__all__ = ["decode_batch"]


def _torchvision_io():
    try:
        from torchvision import io as tvio
    except ImportError as exc:
        raise PackioError("GPU JPEG decode needs torchvision: pip install 'packio[gpu]' "
                          f"(a torchvision matching your torch; import failed: {exc})") from None
    return tvio


def _cpu_decode(blob: bytes | memoryview | torch.Tensor) -> torch.Tensor:
    data = blob.numpy().tobytes() if isinstance(blob, torch.Tensor) else blob
    return torch.from_numpy(np.ascontiguousarray(cpu.decode(data))).permute(2, 0, 1)


def decode_batch(blobs: Sequence[bytes | memoryview | torch.Tensor], device: str | torch.device | None = None,
                 ) -> list[torch.Tensor]:
    """Decode encoded images to ``uint8[3, H, W]`` tensors on ``device``.

    On CUDA, all JPEGs go to nvjpeg in **one** batched call (one call per image is
    slower than the CPU); a batch nvjpeg rejects is retried image by image, and an
    image it still rejects (CMYK, odd progressive files, PNG, ...) is decoded on
    the CPU and copied over. On the CPU, packio's CPU decoder is used.
    """
    dev = resolve(device)
    if dev.type != "cuda":
        return [_cpu_decode(b).to(dev) for b in blobs]
    tvio = _torchvision_io()
    tensors = [b if isinstance(b, torch.Tensor) else torch.frombuffer(bytearray(b), dtype=torch.uint8)
               for b in blobs]
    out: list[torch.Tensor | None] = [None] * len(tensors)
    jpeg_idx = [i for i, t in enumerate(tensors) if cpu.sniff(t[:12].numpy().tobytes()) == "jpeg"]
    mode = tvio.ImageReadMode.RGB
    if jpeg_idx:
        try:
            decoded = tvio.decode_jpeg([tensors[i] for i in jpeg_idx], mode=mode, device=dev)
            for i, img in zip(jpeg_idx, decoded):
                out[i] = img
        except RuntimeError:
            for i in jpeg_idx:
                try:
                    out[i] = tvio.decode_jpeg(tensors[i], mode=mode, device=dev)
                except RuntimeError:
                    pass
    for i, img in enumerate(out):
        if img is None:
            out[i] = _cpu_decode(tensors[i]).pin_memory().to(dev, non_blocking=True)
    return out  # type: ignore[return-value]
