"""Would decoding on the GPU (nvjpeg) pay off? Measured when CUDA is here; otherwise
said to be unknown, with what the CPU side alone does tell."""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["GpuVerdict", "measure_gpu_decode", "verdict"]


@dataclass
class GpuVerdict:
    lines: list[str]
    gpu_ms_per_batch: float | None = None
    how: str = ""  # "measured", "declared" or ""


def measure_gpu_decode(blobs: list[bytes], batch_size: int, repeats: int = 5) -> float | None:
    """Milliseconds to decode ``batch_size`` of these JPEGs with one batched nvjpeg
    call (packio.cuda.decode_batch), best of ``repeats``; None without CUDA/torchvision."""
    import torch

    if not torch.cuda.is_available() or not blobs:
        return None
    from packio.cuda import decode_batch
    from packio.errors import PackioError

    batch = [blobs[i % len(blobs)] for i in range(batch_size)]
    try:
        decode_batch(batch, device="cuda")  # warm-up: nvjpeg handles, allocator
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            decode_batch(batch, device="cuda")
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
    except PackioError:  # no torchvision
        return None
    return best * 1e3


def verdict(*, batch_size: int, step_ms: float | None, cpu_rate_original: float, cpu_ceiling_no_decode: float,
            decode_share: float, best_rate: float, best_title: str, gpu_ms: float | None, how: str,
            cuda: bool) -> GpuVerdict:
    """The GPU-decode verdict for original (JPEG) bytes.

    With a GPU figure (measured or declared) and a step time, per batch: CPU decode of
    originals cycles at max(step, B / cpu_rate_original); the best CPU layout at
    max(step, B / best_rate); GPU decode at max(step + gpu_ms, B / ceiling), where the
    ceiling is the CPU rate with decode and resize removed (an upper bound: read,
    collate and hand-over still run on the CPU)."""
    b = batch_size
    known = (f"decode + resize are {decode_share * 100:.0f} % of the CPU cost of an original sample; taking them "
             f"off the CPU raises its ceiling at most to ~{cpu_ceiling_no_decode:.0f} samples/s (estimate: the stages "
             f"left, on every CPU)")
    if gpu_ms is None:
        why = ("torch sees CUDA but nvjpeg could not run (install packio[gpu] for torchvision)" if cuda
               else "no CUDA here")
        lines = [f"GPU decode: cannot tell without a GPU ({why}); run this again with CUDA to measure nvjpeg.", known]
        if step_ms:
            need = b / (step_ms / 1e3)
            if best_rate >= need:
                lines.append(f"not needed for this step either way: {best_title} already feeds {best_rate:.0f} "
                             f"samples/s ≥ the {need:.0f} a {step_ms:g} ms step of {b} takes")
        return GpuVerdict(lines)
    head = f"GPU decode ({how}): {gpu_ms:.1f} ms of GPU time per batch of {b} originals"
    if not step_ms:
        return GpuVerdict([head, known, "give --step-ms to weigh it against the training step"], gpu_ms, how)
    cyc_orig = max(step_ms, 1e3 * b / cpu_rate_original) if cpu_rate_original > 0 else float("inf")
    cyc_best = max(step_ms, 1e3 * b / best_rate) if best_rate > 0 else float("inf")
    cyc_gpu = max(step_ms + gpu_ms, 1e3 * b / cpu_ceiling_no_decode) if cpu_ceiling_no_decode > 0 else float("inf")
    pays = cyc_gpu < min(cyc_orig, cyc_best) * 0.95
    lines = [head, known,
             f"estimated ms per step: GPU decode {cyc_gpu:.1f}, CPU decode of originals {cyc_orig:.1f}, "
             f"{best_title} {cyc_best:.1f} (each = max(step, data time); an estimate from the figures above)",
             "→ GPU decode pays off here" if pays else "→ GPU decode does not pay off here: "
             + ("the CPU feeds the step already" if cyc_best <= step_ms * 1.05 else f"{best_title} is at least as fast")]
    return GpuVerdict(lines, gpu_ms, how)
