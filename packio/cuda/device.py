"""Device resolution and host-to-device copies shared by the GPU stages."""

from __future__ import annotations

import os
import warnings

import torch

from packio.errors import PackioError

__all__ = ["h2d", "resolve", "warn_once"]

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """A RuntimeWarning said once per process for each ``key``."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _cuda_index() -> int:
    """This process's GPU: ``LOCAL_RANK`` under torchrun/DDP (one GPU per rank) when
    that GPU exists, else the current device (``torch.cuda.set_device``, or 0; with
    ``CUDA_VISIBLE_DEVICES`` narrowed to one GPU per rank that is the rank's GPU)."""
    local = os.environ.get("LOCAL_RANK")
    count = torch.cuda.device_count()
    if local is not None and local.strip().isdigit() and int(local) < count:
        return int(local)
    return torch.cuda.current_device()


def resolve(device: str | torch.device | None) -> torch.device:
    """``None`` → this rank's CUDA device when CUDA is present, else the CPU (said
    once). A bare ``"cuda"`` gets this rank's index too. An explicit CUDA device
    without CUDA is an error, never a silent fallback."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", _cuda_index())
        warn_once("cpu", "packio.cuda: CUDA is not available; batches stay on the CPU")
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PackioError(f"device {str(dev)!r} was asked for, but this torch ({torch.__version__}) sees no CUDA "
                          f"GPU; install a CUDA build of torch on a GPU machine, or pass device='cpu'")
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", _cuda_index())
    return dev


def h2d(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without blocking the host: pinned, then a
    ``non_blocking`` copy (the caching host allocator keeps the pinned block until
    the copy is done). A no-op for tensors already there."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
