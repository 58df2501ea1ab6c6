"""A training loop that resumes exactly: on any number of ranks and DataLoader workers.

    packio convert images/ out.wds          # any format works; tar shards stream best
    torchrun --nproc_per_node=2 examples/resumable_training.py out.wds ckpt.json --epochs 3
    # stop it at any moment, then run it again (with another --nproc_per_node or --workers):
    # it continues where the checkpoint says, with no sample lost or repeated.

``train`` is the loop docs/training.md shows, and the one the tests run under torchrun
(tests/ddp_worker.py): every epoch, every sample exactly once across the ranks,
the interrupted run and the resumed one together.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

import packio


def save_json(path: Path, state: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint whole


def train(path: str, checkpoint: Path, epochs: int, step: Callable[[int, dict], None], *, iterable: bool = True,
          batch_size: int = 64, dataset_args: dict | None = None, **loader_args: Any) -> None:
    if iterable:  # streaming reads (tar shards, LMDB blocks), split over ranks and workers
        dataset = packio.open_dataset(path, iterable=True, shuffle=True, seed=0, **(dataset_args or {}))
        loader = packio.DataLoader(dataset, batch_size=batch_size, **loader_args)
    else:  # random access; the sampler splits each epoch's permutation over the ranks
        dataset = packio.open_dataset(path, **(dataset_args or {}))
        sampler = packio.ResumableSampler(len(dataset), seed=0)
        loader = packio.DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_args)
    if checkpoint.exists():
        loader.load_state_dict(json.loads(checkpoint.read_text()))  # any world size, any num_workers
    rank = dist.get_rank() if dist.is_initialized() else 0
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)  # a resumed epoch keeps its position
        for batch in loader:
            step(epoch, batch)  # forward, backward, optimizer step
            if rank == 0:  # the state is the global position: the same on every rank
                save_json(checkpoint, loader.state_dict())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="a packed dataset (any format)")
    ap.add_argument("checkpoint", type=Path, help="JSON file holding the loader's position")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--map-style", action="store_true", help="random access + packio.ResumableSampler")
    a = ap.parse_args()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    seen: dict[int, int] = {}

    def step(epoch: int, batch: dict) -> None:
        seen[epoch] = seen.get(epoch, 0) + len(batch["key"])

    train(a.data, a.checkpoint, a.epochs, step, iterable=not a.map_style, num_workers=a.workers,
          dataset_args={"decode": False})
    print(f"rank {dist.get_rank() if dist.is_initialized() else 0}: samples per epoch {seen}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
