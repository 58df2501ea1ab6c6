"""The session's torchrun launches, shared by every test that needs real DDP ranks: two
launches (2 ranks, then 3) for three world sizes (2, 3, then 1), running the scenarios that
test_ddp.py and test_mix.py hand it (``plans(work)`` in each), in order. A launch costs a
torchrun agent plus one interpreter importing torch per rank, so the tests ride together:
the 1-rank legs run at the end of the 3-rank launch, on its rank 0 in a process group of
its own (world size 1; the other ranks have left), resuming from the checkpoint files
as a fresh launch would (~6 s, a third launch, saved)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORLDS = (2, 3, 1)  # the resumed legs run in this order: a checkpoint written on 2 ranks, read on 3, then 1
ALONE = 1  # the world size whose legs run after the 3-rank launch's, in a process group of its own


def torchrun(nproc: int, plan: dict, work: Path, tag: str) -> Path:
    """Runs tests/ddp_worker.py on ``nproc`` ranks over ``plan``; returns the folder of its outputs."""
    out = work / f"out-{tag}"
    out.mkdir()
    (work / f"plan-{tag}.json").write_text(json.dumps(plan))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "tests" / "ddp_worker.py"), str(work / f"plan-{tag}.json"), str(out)]
    # the ranks find the S3 server through the AWS_* variables the s3_server fixture set; a cache of their own
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PACKIO_CACHE_DIR": str(work / "cache")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return out


def run_all(work: Path, servers: dict) -> dict:
    """Builds each module's data and plans, then launches once per world size but the last
    (whose legs the launch before runs, see the module):
    ``{"ddp": ..., "mix": ..., "outs": {world: folder}}`` (each module's own return of ``plans``).
    ``servers``: the HTTP and S3 servers test_mix's sources live on (``{"http", "s3"}``,
    or ``{"skip": why}`` where they could not start)."""
    from test_ddp import plans as ddp_plans
    from test_mix import plans as mix_plans

    ddp, mix = ddp_plans(work / "ddp"), mix_plans(work / "mix", servers)
    outs = {ALONE: work / f"out-{ALONE}"}
    outs[ALONE].mkdir()
    for world in WORLDS[:-1]:
        plan: dict = {"scenarios": ddp["plans"][world] + mix["plans"][world]}
        if world == 2:
            plan["state_check"] = ddp["state_check"]
        if world == WORLDS[-2]:
            plan["alone"] = {"scenarios": ddp["plans"][ALONE] + mix["plans"][ALONE], "out": str(outs[ALONE])}
        outs[world] = torchrun(world, plan, work, str(world))
    return {"ddp": ddp, "mix": mix, "outs": outs}
