"""One leg of a resumed mixed run, run by tests/ddp_worker.py inside the session's shared
torchrun launch (gloo, CPU) for test_mix. Trains on ``packio.mix`` with the loop of
examples/resumable_training.py (checkpoint = the loader's state, saved by rank 0 after
every step) and writes the (source, key) pairs each rank took, per epoch, to
``OUT/NAME.rankR.json``.

The leg: ``{"mix": true, "name", "sources", "weights", "epoch_samples", "seed", "batch_size",
"epochs", "num_workers", "checkpoint", "stop": [epoch, batch] or null}``; ``stop`` ends the
leg (as a crash would) before that batch of that epoch. A source is a path or URL, or a nested
mix: ``{"mix": [sources...], "weights", "epoch_samples", "seed"}`` (see :func:`build`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

import packio


def build(sources: list, weights: list | None, **kwargs: Any) -> packio.MixedDataset:
    """``packio.mix`` over ``sources`` (decode=False), a dict source being a mix of its own."""
    opened = [s if isinstance(s, str) else build(s["mix"], s.get("weights"), epoch_samples=s.get("epoch_samples"),
                                                 seed=s.get("seed", 0)) for s in sources]
    return packio.mix(opened, weights, decode=False, **kwargs)


def leg(plan: dict, out: Path, rank: int) -> None:
    ds = build(plan["sources"], plan["weights"], epoch_samples=plan["epoch_samples"], seed=plan["seed"])
    workers = plan["num_workers"]
    loader = packio.DataLoader(ds, batch_size=plan["batch_size"], num_workers=workers,
                               **({"multiprocessing_context": "fork"} if workers else {}))
    checkpoint = Path(plan["checkpoint"])
    if checkpoint.exists():
        loader.load_state_dict(json.loads(checkpoint.read_text()))
    got: dict[int, list] = {}
    stop = plan.get("stop")
    for epoch in range(loader.epoch, plan["epochs"]):
        loader.set_epoch(epoch)
        for k, batch in enumerate(loader):
            if stop == [epoch, k]:
                break
            got.setdefault(epoch, []).append(list(zip(batch["source"].tolist(), batch["key"])))
            dist.barrier()  # ranks step together, as DDP's all-reduce makes them
            if rank == 0:
                tmp = checkpoint.with_name(checkpoint.name + ".tmp")
                tmp.write_text(json.dumps(loader.state_dict()))
                os.replace(tmp, checkpoint)
        else:
            continue
        break
    (out / f"{plan['name']}.rank{rank}.json").write_text(json.dumps(got))
