"""Device resolution shared by the GPU stages."""

from __future__ import annotations

import warnings

import torch

from packio.errors import PackioError

__all__ = ["resolve"]

_warned: set[str] = set()


def resolve(device: str | torch.device | None) -> torch.device:
    """``None`` → CUDA when present, else CPU (said once). An explicit CUDA device
    without CUDA is an error, never a silent fallback."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        if "cpu" not in _warned:
            _warned.add("cpu")
            warnings.warn("packio.cuda: CUDA is not available; batches stay on the CPU", RuntimeWarning,
                          stacklevel=3)
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PackioError(f"device {str(dev)!r} was asked for, but this torch ({torch.__version__}) sees no CUDA "
                          f"GPU; install a CUDA build of torch on a GPU machine, or pass device='cpu'")
    return dev
