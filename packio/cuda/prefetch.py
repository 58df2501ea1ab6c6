"""CUDA prefetcher: batches k+1 .. k+depth copy (and transform) on a side stream while step k runs."""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch

from packio.cuda.boxes import pack_batch
from packio.cuda.device import resolve

__all__ = ["CudaOps", "Prefetcher", "to_device"]

SMALL = 1 << 20  # host tensors up to this many bytes travel together in one staging copy


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in nested dicts / lists / tuples / named tuples."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        mapped = [_map(v, fn) for v in obj]
        return type(obj)(*mapped) if hasattr(obj, "_fields") else type(obj)(mapped)
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map(obj, lambda t: found.append(t) or t)
    return found


class CudaOps:
    """The stream operations the prefetcher uses (tests substitute a recording fake)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device=device)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any) -> ContextManager:
        return torch.cuda.stream(stream)

    def on_device(self, t: torch.Tensor) -> bool:
        return t.device == self.device

    def pinned(self, t: torch.Tensor) -> bool:
        return t.is_pinned()

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def staging(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def record(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def event(self, stream: Any) -> Any:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)


def to_device(batch: Any, ops: CudaOps) -> Any:
    """Every host tensor of ``batch`` on the device with few copies: each large tensor
    one ``non_blocking`` copy (pinned first when pageable); all the small ones (labels,
    indices, packed boxes...) gathered into one pinned staging buffer and sent in
    **one** copy, then viewed back on the device."""
    host = [t for t in _tensors(batch) if not ops.on_device(t)]
    small = [t for t in host if t.numel() * t.element_size() <= SMALL]
    offsets, total = [], 0
    for t in small:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 16) * 16  # 16-byte aligned views for any dtype
    moved: dict[int, torch.Tensor] = {}
    if small:
        buf = ops.staging(max(total, 16))
        for t, off in zip(small, offsets):
            n = t.numel() * t.element_size()
            buf[off:off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        dev_buf = ops.copy(buf)
        for t, off in zip(small, offsets):
            n = t.numel() * t.element_size()
            moved[id(t)] = dev_buf[off:off + n].view(t.dtype).view(t.shape)
    done = set(moved)

    def move(t: torch.Tensor) -> torch.Tensor:
        if id(t) in done:
            return moved[id(t)]
        if ops.on_device(t):
            return t
        return ops.copy(t if ops.pinned(t) else ops.pin(t))

    return _map(batch, move)


class Prefetcher:
    """Wrap any iterable of batches (tensors, dicts, tuples, lists of variable-length
    box tensors) and yield them on ``device``, transformed, ``depth`` batches ahead.

    On CUDA, for each batch, on a side stream: wait for the consumer's stream when the
    batch holds tensors already on the GPU (a GPU-side producer), copy host tensors
    with ``non_blocking`` copies (small ones in one staging copy), pack packio boxes
    into one :class:`PackedBoxes` (``pack_boxes``), run ``transform``; then the
    consumer's stream waits on that batch's event and every tensor handed out is
    ``record_stream``-ed on it, so its memory is not reused while the step runs.
    ``device=None``: this rank's GPU (``LOCAL_RANK``); without CUDA, batches pass
    through on the CPU (transformed; said once); ``device="cuda"`` without CUDA raises.
    """

    def __init__(self, loader: Iterable[Any], device: str | torch.device | None = None,
                 transform: Callable[[Any], Any] | None = None, depth: int = 2, pack_boxes: bool = True) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.loader = loader
        self.device = resolve(device)
        self.transform = transform
        self.depth = depth
        self.pack_boxes = pack_boxes

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _prepare(self, batch: Any) -> Any:
        return pack_batch(batch) if self.pack_boxes and isinstance(batch, dict) else batch

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            for batch in self.loader:
                batch = self._prepare(batch)
                yield self.transform(batch) if self.transform is not None else batch
            return
        yield from self._stream(CudaOps(self.device))

    def _stream(self, ops: CudaOps) -> Iterator[Any]:
        it = iter(self.loader)
        ring: deque[tuple[Any, Any]] = deque()

        def preload() -> bool:
            try:
                batch = self._prepare(next(it))
            except StopIteration:
                return False
            inputs = [t for t in _tensors(batch) if ops.on_device(t)]
            if inputs:  # produced on the consumer's stream: wait for it, and keep the memory alive for us
                ops.wait_stream(ops.side, ops.current())
                for t in inputs:
                    ops.record(t, ops.side)
            with ops.use(ops.side):
                batch = to_device(batch, ops)
                if self.transform is not None:
                    batch = self.transform(batch)
                ready = ops.event(ops.side)
            ring.append((batch, ready))
            return True

        while len(ring) < self.depth and preload():
            pass
        while ring:
            batch, ready = ring.popleft()
            current = ops.current()
            ops.wait_event(current, ready)
            for t in _tensors(batch):
                if ops.on_device(t):
                    ops.record(t, current)
            preload()  # keep the ring full before the step runs
            yield batch
