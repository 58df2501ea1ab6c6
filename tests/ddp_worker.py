"""Run under torchrun (gloo, CPU) by the session's shared launches (tests/launches.py):
runs the training loop (examples/resumable_training.py) once per scenario of a JSON plan,
and writes the keys each rank trained on, per epoch and batch, to ``OUT/NAME.rankR.json``.
A scenario with ``"mix": true`` is one leg of test_mix's resumed run (tests/mix_worker.py).
The plan's ``"alone": {"scenarios", "out"}``: scenarios rank 0 runs last, in a process group
of world size 1 of its own (the 1-rank legs, without a launch of their own).

A scenario: ``{"name", "path", "iterable", "epochs", "batch_size", "checkpoint",
"loader_args", "dataset_args", "stop": [epoch, batches] or null}``; ``stop`` ends
the run (as a crash would) before the step of that batch of that epoch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from resumable_training import train  # noqa: E402

import packio  # noqa: E402
from mix_worker import leg  # noqa: E402


class Interrupted(Exception):
    pass


def run(sc: dict, out: Path, rank: int) -> None:
    got: dict[int, list[list[str]]] = {}
    stop = sc.get("stop")

    def step(epoch: int, batch: dict) -> None:
        taken = len(got.get(epoch, []))
        if stop is not None and [epoch, taken] == stop:
            raise Interrupted
        got.setdefault(epoch, []).append(list(batch["key"]))
        dist.barrier()  # ranks step together, as DDP's all-reduce makes them

    loader_args = dict(sc.get("loader_args", {}))
    ctx = loader_args.get("multiprocessing_context")
    if ctx == "forkserver":
        mp.set_forkserver_preload(["torch", "packio.read.datasets", "packio.read.loader"])
    try:
        train(sc["path"], Path(sc["checkpoint"]), sc["epochs"], step, iterable=sc["iterable"],
              batch_size=sc["batch_size"], dataset_args=sc.get("dataset_args"), **loader_args)
    except Interrupted:
        pass
    (out / f"{sc['name']}.rank{rank}.json").write_text(json.dumps(got))


def state_check(path: str, out: Path, rank: int) -> None:
    """The state after a few batches, on every rank (it must be the same)."""
    for iterable in (True, False):
        if iterable:
            ds = packio.open_dataset(path, iterable=True, decode=False, shuffle=True)
            loader = packio.DataLoader(ds, batch_size=4)
        else:
            ds = packio.open_dataset(path, decode=False)
            loader = packio.DataLoader(ds, batch_size=4, sampler=packio.ResumableSampler(len(ds)))
        for k, _ in enumerate(loader):
            if k == 2:
                break
        states: list = [None] * dist.get_world_size()
        dist.all_gather_object(states, loader.state_dict())
        if rank == 0:
            (out / f"states-{'iterable' if iterable else 'map'}.json").write_text(json.dumps(states))


def main() -> None:
    plan, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    early = packio.ResumableSampler(10)  # built before init_process_group(): it would read everything
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        early.set_epoch(1)
        caught = ""
    except packio.PackioError as exc:
        caught = str(exc)
    (out / f"early.rank{rank}.txt").write_text(caught)
    for sc in plan["scenarios"]:
        (leg if sc.get("mix") else run)(sc, out, rank)
        dist.barrier()
    if plan.get("state_check"):
        state_check(plan["state_check"], out, rank)
    dist.barrier()
    dist.destroy_process_group()
    alone = plan.get("alone")
    if alone and rank == 0:  # a world of one: every dataset, sampler and loader made anew, from the checkpoints
        dist.init_process_group("gloo", init_method=f"file://{out / 'alone.store'}", rank=0, world_size=1)
        for sc in alone["scenarios"]:
            (leg if sc.get("mix") else run)(sc, Path(alone["out"]), 0)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
