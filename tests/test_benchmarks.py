"""The developer benchmarks under tools/: every script answers --help, shares the one
timing module, runs end to end on tiny data, and says so (non-zero exit) when it has no data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "tools"
sys.path.insert(0, str(BENCH))

SCRIPTS = {"loader.py": ["w1", "w1cpu", "w2", "w2cpu", "levers", "memory"], "convert.py": ["workers", "check", "dask"],
           "remote.py": [None], "gpu_run.py": [None], "peers_dali.py": [None], "ab.py": [None],
           "read_cpu.py": [None], "cache_peak.py": [None], "w3.py": ["table", "decode"]}
PEERS = ROOT.parent / "shared" / "peers" / "bench.py"


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_every_script_is_listed_and_documented():
    scripts = {p.name for p in BENCH.glob("*.py")} - {"common.py", "scale.py"}
    assert scripts == set(SCRIPTS)
    readme = (BENCH / "README.md").read_text()
    for name in scripts:
        assert f"tools/{name}" in readme, name
        assert "from common import" in (BENCH / name).read_text(), f"{name} does not share common.py"
    assert not (ROOT / "benchmarks").exists(), "the developer benchmarks live in tools/, as the design card names it"


@pytest.mark.parametrize("script,command", [(s, c) for s, cs in SCRIPTS.items() for c in cs])
def test_help(script, command):
    if script == "peers_dali.py" and not PEERS.is_file():
        pytest.skip("the peers harness (../shared/peers) is absent")
    r = run(str(BENCH / script), *([command] if command else []), "--help")
    assert r.returncode == 0, r.stderr
    assert "--rounds" in r.stdout or "--allow-cpu" in r.stdout or "dali-cpu" in r.stdout


def test_unknown_command_exits_non_zero():
    r = run(str(BENCH / "loader.py"), "nope")
    assert r.returncode == 2 and "w1, w1cpu, w2, w2cpu, levers, memory" in r.stderr


def test_workers_without_data_exits_non_zero(tmp_path):
    r = run(str(BENCH / "convert.py"), "workers", "--src", str(tmp_path / "absent"), "--rounds", "1")
    assert r.returncode != 0
    assert "no image folder" in r.stderr and "--src" in r.stderr
    assert "| source |" not in r.stdout  # no empty table


def test_interleaved_alternates_order_and_medians_skip_failures(capsys):
    from common import interleaved, median

    calls: list[str] = []
    got = interleaved({"a": lambda: calls.append("a") or 1.0, "b": lambda: calls.append("b") or 2.0}, 3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert got == {"a": [1.0] * 3, "b": [2.0] * 3}
    assert capsys.readouterr().out.count("round ") == 3
    assert median([3.0, float("nan"), 1.0]) == 2.0
    assert median([float("nan")]) != median([float("nan")])  # nan: nothing measured


@pytest.fixture
def tiny_arrays(gen_folder, tmp_path):
    """The generated folder packed as a 32x32 ``.arrays`` dataset."""
    import packio

    src, csv = gen_folder
    dst = tmp_path / "d.arrays"
    packio.convert(src, dst, csv=csv, resize=packio.ResizeSpec(size=(32, 32)), progress=False)
    return dst


def test_w2_runs_end_to_end_on_tiny_data(tiny_arrays):
    r = run(str(BENCH / "loader.py"), "w2", "--path", str(tiny_arrays), "--rounds", "1", "--seconds", "0.01")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| packio nw=")]
    assert len(rows) == 4 and all(float(line.split("|")[2]) > 0 for line in rows), r.stdout


def test_read_cpu_runs_end_to_end_on_tiny_data(tmp_path):
    r = run(str(BENCH / "read_cpu.py"), "--cases", "lmdb-64", "arrays-64", "--n", "16", "--calls", "64",
            "--rounds", "1", "--work", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = [line.split("|") for line in r.stdout.splitlines() if line.startswith(("| lmdb-64", "| arrays-64"))]
    assert len(rows) == 2 and all(float(row[3]) > 0 and float(row[5]) > 0 for row in rows), r.stdout


def test_w3_runs_end_to_end_on_tiny_data(gen_folder, tmp_path):
    src, _ = gen_folder
    rows = ["packio nw=0", "L3 full decode, 2 procs", "packio eval nw=0", "eval limit, 2 procs"]
    r = run(str(BENCH / "w3.py"), "table", "--data", str(src), "--work", str(tmp_path / "w"), "--n", "16",
            "--rounds", "1", "--seconds", "0", "--rows", *rows, timeout=300)
    assert r.returncode == 0, r.stderr
    got = {line.split("|")[1].strip(): line.split("|")[2:] for line in r.stdout.splitlines() if line.startswith("| ")}
    assert all(float(got[n][0].replace(",", "")) > 0 for n in rows), r.stdout
    assert float(got["packio nw=0"][1]) > 0 and float(got["packio eval nw=0"][1]) > 0  # × its limit
    r = run(str(BENCH / "w3.py"), "decode", "--data", str(src), "--n", "8", "--rounds", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("| train |") >= 3 and r.stdout.count("| eval |") >= 3, r.stdout


def _has(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def test_gpu_run_dry_run_on_tiny_data(tmp_path):
    """Issue 40's GPU run, every step on the CPU: step 1 reads pass, failure and skip from pytest; what
    cannot run here is said, not measured; the JSON and the Markdown table are written."""
    (tmp_path / "test_three.py").write_text("import pytest\ndef test_ok(): pass\ndef test_bad(): assert 0, 'no'\n"
                                           "@pytest.mark.skip(reason='not here')\ndef test_skip(): pass\n")
    out = tmp_path / "out"
    r = run(str(BENCH / "gpu_run.py"), "--allow-cpu", "--tiny", "--out", str(out), "--tests",
            str(tmp_path / "test_three.py"), timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads((out / "gpu-run.json").read_text())
    tests = got["steps"]["tests"]
    assert tests["status"] == "FAIL" and tests["counts"] == {"passed": 1, "FAILED": 1, "skipped": 1}
    assert tests["tests"]["test_three::test_bad"].startswith("FAILED") and "not here" in tests["tests"][
        "test_three::test_skip"]
    decode, train = got["steps"]["decode"], got["steps"]["train"]["rows"]
    assert decode["rows"]["packio CPU decode, 0 workers"]["img_s"] > 0
    assert decode["rows"]["packio GPU cpu stand-in (no CUDA)"]["img_s"] > 0  # the GPU code, run on the CPU
    assert decode["unavailable"]["torchvision GPU (decode_jpeg + v2)"] == "unavailable: no CUDA here"
    for name, row in train.items():
        if name.startswith("(b)") and not _has("torchvision"):
            assert "torchvision not installed" in row["unavailable"]
        else:
            assert row["img_s"] > 0 and 0 <= row["gpu_wait"] <= 1 and row["steps"] == 2, (name, row)
    assert [g["met"] for g in got["goals"]][0] is False and "profile" not in got["steps"]  # profiled on CUDA only
    md = (out / "gpu-run.md").read_text()
    heads = [md.index(h) for h in ("# Issue 40", "## 1.", "## 2.", "## 3.", "## Goals", "## Timings")]
    assert heads == sorted(heads)
    assert "| (b) torch DataLoader" in md and "unavailable" in md


def test_gpu_run_plan_fits_and_says_what_travels():
    import gpu_run

    assert sum(secs for *_, secs in gpu_run.PLAN) <= 8 * 60  # the ceiling for one run
    carried = sum(size for *_, size in gpu_run.WHEELS)
    tree = sum((ROOT / p).stat().st_size for p in subprocess.run(
        ["git", "ls-files"], capture_output=True, text=True, cwd=ROOT).stdout.split() if (ROOT / p).is_file())
    assert carried + tree < gpu_run.TRAVEL_LIMIT
    assert gpu_run.DEVICE_TIMEOUT >= sum(secs for *_, secs in gpu_run.PLAN) + 60 and gpu_run.DEVICE_TIMEOUT <= 600
    readme = (BENCH / "README.md").read_text()
    assert gpu_run.DEVICE_COMMAND in readme and f"timeout_s={gpu_run.DEVICE_TIMEOUT}" in readme
    assert len(gpu_run.DEVICE_COMMAND) <= 2000 and "carry=['.whl']" in gpu_run.plan_text()
    assert "/.whl/" in (ROOT / ".gitignore").read_text().split()  # the wheels travel as carried, never committed


def test_gpu_run_needs_cuda_unless_allowed_and_checks_arguments(monkeypatch, capsys, tmp_path):
    import gpu_run
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_run.main(["--out", str(tmp_path / "out")]) == 2
    assert "--allow-cpu" in capsys.readouterr().err and not (tmp_path / "out").exists()
    for bad in (["--batch", "0"], ["--images", "4", "--batch", "8"], ["--model", "vgg"]):
        with pytest.raises(SystemExit) as e:
            gpu_run.parse(bad)
        assert e.value.code == 2


def test_gpu_run_resnet50_is_torchvisions_shape():
    """The GPU run trains this torch-only ResNet-50 (no torchvision weights there): same parameter count as
    torchvision's resnet50 (25,557,032) and a 1000-way output."""
    import gpu_run
    import torch

    model = gpu_run.resnet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
    with torch.no_grad():
        assert model.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, 1000)


def test_peers_dali_without_dali_says_how_to_install():
    if _has("nvidia.dali"):
        pytest.skip("DALI is installed")
    r = run(str(BENCH / "peers_dali.py"), "--data", "x")
    assert r.returncode != 0 and "pip install nvidia-dali-cuda130" in r.stderr


def test_w2cpu_runs_end_to_end_on_tiny_data(tiny_arrays):
    r = run(str(BENCH / "loader.py"), "w2cpu", "--path", str(tiny_arrays), "--rounds", "1", "--seconds", "0.01")
    assert r.returncode == 0, r.stderr
    rows = [line.split("|") for line in r.stdout.splitlines() if line.startswith(("| L2", "| packio nw=0"))]
    assert len(rows) == 3 and all(float(row[2]) > 0 and float(row[5]) > 0 for row in rows), r.stdout


def test_w1cpu_runs_end_to_end_on_tiny_data():
    r = run(str(BENCH / "loader.py"), "w1cpu", "--count", "8", "--rounds", "1", "--seconds", "0.01")
    assert r.returncode == 0, r.stderr
    rows = [line.split("|") for line in r.stdout.splitlines() if line.startswith(("| L1", "| packio nw=0"))]
    assert len(rows) == 3 and all(float(row[2]) > 0 and float(row[5]) > 0 for row in rows), r.stdout
