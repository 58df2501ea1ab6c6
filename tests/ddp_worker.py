"""Run by test_distributed under torchrun (2 ranks, gloo, CPU): records what each
rank reads, with packio's iterable reader or its sampler, and a mid-epoch resume."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

import packio


def indices(loader) -> list[int]:
    return [i for b in loader for i in b["index"].tolist()]


def main() -> None:
    data, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def loader(even=None, **kw):
        if mode == "iterable":
            ds = packio.open_dataset(data, iterable=True, decode=False, shuffle=True, seed=7, even=even)
            return packio.DataLoader(ds, batch_size=2, num_workers=2, **kw)
        ds = packio.open_dataset(data, decode=False)
        sampler = packio.ResumableSampler(len(ds), seed=7, even=even)
        return packio.DataLoader(ds, batch_size=2, sampler=sampler, num_workers=2, **kw)

    rec = {"rank": rank, "world": world, "epoch": indices(loader()), "padded": indices(loader(even="pad"))}
    first = loader()
    before = []
    for k, b in enumerate(first):
        before += b["index"].tolist()
        if k == 1:
            state = first.state_dict()
            break
    dist.barrier()
    resumed = loader()
    resumed.load_state_dict(json.loads(json.dumps(state)))  # the state survives a JSON checkpoint
    rec.update(before=before, after=indices(resumed), epoch_again=indices(loader()))
    (out / f"rank{rank}.json").write_text(json.dumps(rec))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
