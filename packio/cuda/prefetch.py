"""CUDA prefetcher: copies batch k+1 to the GPU on a side stream while step k runs."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from packio.cuda.device import resolve

__all__ = ["Prefetcher"]


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        mapped = [_map(v, fn) for v in obj]
        return type(obj)(mapped) if not hasattr(obj, "_fields") else type(obj)(*mapped)
    return obj


class Prefetcher:
    """Wrap any iterable of batches (tensors, dicts, tuples, lists of variable-length
    box tensors) and yield them already on ``device``.

    On CUDA: host tensors are pinned (unless the loader already pinned them, e.g.
    ``pin_memory=True``), copied with ``non_blocking=True`` on a side stream, an
    optional ``transform`` runs there too, and the consumer's stream waits on an
    event; each tensor is ``record_stream``-ed so its memory is not reused before
    the step that uses it is done. Without CUDA (``device=None``) batches pass
    through on the CPU, said once; ``device="cuda"`` without CUDA raises.
    """

    def __init__(self, loader: Iterable[Any], device: str | torch.device | None = None,
                 transform: Callable[[Any], Any] | None = None, pin: bool = True) -> None:
        self.loader = loader
        self.device = resolve(device)
        self.transform = transform
        self.pin = pin

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _copy(self, batch: Any) -> Any:
        def move(t: torch.Tensor) -> torch.Tensor:
            if t.device == self.device:
                return t
            if self.device.type == "cuda" and self.pin and t.device.type == "cpu" and not t.is_pinned():
                t = t.pin_memory()
            return t.to(self.device, non_blocking=True)

        batch = _map(batch, move)
        return self.transform(batch) if self.transform is not None else batch

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            for batch in self.loader:
                yield self._copy(batch)
            return
        stream = torch.cuda.Stream(device=self.device)
        it = iter(self.loader)

        def preload() -> tuple[Any, torch.cuda.Event] | None:
            try:
                batch = next(it)
            except StopIteration:
                return None
            with torch.cuda.stream(stream):
                batch = self._copy(batch)
                ready = torch.cuda.Event()
                ready.record(stream)
            return batch, ready

        nxt = preload()
        while nxt is not None:
            batch, ready = nxt
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)
            _map(batch, lambda t: (t.record_stream(current), t)[1] if t.is_cuda else t)
            nxt = preload()  # start the next copy before handing this batch to the step
            yield batch
