"""``packio bench``'s orchestration without timing anything: runs and limits come from the
same interleaved passes, a run above its limit has the limit measured again and is reported
as a measurement error (never as a ratio), and the user is told up front how many runs
there are and roughly how long they take."""

from __future__ import annotations

import ast
import time
from pathlib import Path

from packio.bench.runner import Progress, limit_key, measure, render, summarise

ROOT = Path(__file__).resolve().parent.parent


def test_no_function_over_60_lines_in_the_benchmarks():
    long = []
    for path in [*(ROOT / "packio" / "bench").glob("*.py"), *(ROOT / "tools").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.name}:{node.name} {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


class Fake:
    """A child runner: limits at 100/s except when scripted, loader runs as scripted."""

    def __init__(self, rates: dict[str, list[float]]) -> None:
        self.rates, self.calls = rates, []

    def __call__(self, cfg: dict) -> dict:
        name = cfg.get("name", cfg["kind"])
        self.calls.append(name)
        queue = self.rates.get(name)
        return {"rate": queue.pop(0) if queue else 100.0, "samples": 10, "expected": 10}


def _plan() -> tuple[list, list]:
    limits = [("L1_1proc", {"kind": "L1", "procs": 1, "path": "x", "name": "L1"}),
              ("L2", {"kind": "none"})]
    runs = [{"label": n, "name": n, "kind": "packio", "path": "x", "workload": "W1", "workers": 0, "cold": False,
             "data": "original"} for n in ("a", "b")]
    for cfg in runs:
        cfg["limit_key"] = limit_key(cfg, 2)
    return limits, runs


def test_passes_interleave_limits_and_runs(capsys):
    limits, runs = _plan()
    fake = Fake({"a": [50.0, 60.0, 70.0], "b": [80.0, 80.0, 80.0]})
    limit_runs, results = measure(limits, runs, 3, Progress(3 * 3, 3, runner=fake))
    assert fake.calls == ["L1", "a", "b", "b", "a", "L1", "L1", "a", "b"]  # reversed every other pass
    rows = summarise(runs, results, limit_runs, {})
    assert [r["x_limit_paired"] for r in rows] == [0.6, 0.8]
    out = capsys.readouterr().out
    assert out.startswith("9 measured runs") and "roughly" in out
    assert "[9/9] b W1 num_workers=0, warm: 80/s" in out and out.count("pass ") == 3


def test_a_run_above_its_limit_has_the_limit_measured_again(capsys):
    limits, runs = _plan()
    # pass 1: 'a' runs at 150/s against a limit of 100/s; measured again the limit is 200/s
    fake = Fake({"L1": [100.0, 200.0], "a": [150.0], "b": [90.0]})
    limit_runs, results = measure(limits, runs, 1, Progress(3, 1, runner=fake))
    assert fake.calls == ["L1", "a", "b", "L1"]
    assert [r["rate"] for r in limit_runs["L1_1proc"]] == [200.0]
    rows = summarise(runs, results, limit_runs, {})
    assert rows[0]["x_limit_paired"] == 0.75
    assert "[4/4] limit L1_1proc again: a ran above it (150/s > 100/s)" in capsys.readouterr().out


def _report(rows: list[dict]) -> dict:
    return {"source": "s", "cpus": 2, "repeats": 1, "memory_kind": "PSS", "opens_method": "strace",
            "limits": {"L1_1proc": 100.0, "L1_2proc": 180.0, "L1_pre256": float("nan"),
                       "L1_pre256_1proc": float("nan"), "L2_per_sample": float("nan"), "L2_batched": float("nan")},
            "pack": {"bare_lmdb_write_s": 1.0}, "runs": rows, "random": []}


def test_a_run_still_above_its_limit_is_a_measurement_error_not_a_ratio():
    limits, runs = _plan()
    fake = Fake({"L1": [100.0, 90.0], "a": [150.0], "b": [90.0]})  # measured again: still below the run
    limit_runs, results = measure(limits, runs, 1, Progress(3, 1, runner=lambda cfg: fake(cfg)))
    rows = summarise(runs, results, limit_runs, {})
    for row in rows:
        row.update(opens_per_sample=0.0, peak_mb=1.0, first_batch_s=0.1)
    md = render(_report(rows))
    line_a = next(x for x in md.splitlines() if x.startswith("| a |"))
    line_b = next(x for x in md.splitlines() if x.startswith("| b |"))
    assert "measurement error" in line_a and "1.50" not in line_a
    assert "0.90 (L1·1)" in line_b
    assert "**Measurement error:** a (num_workers=0, warm)" in md


class FakeChild:
    """A child runner for a whole bench run: every run and limit at a figure, random access too."""

    def __init__(self) -> None:
        self.cfgs: list[dict] = []

    def __call__(self, cfg: dict) -> dict:
        self.cfgs.append(cfg)
        if cfg["workload"] == "random":
            return {"p50_us": 30.0, "p99_us": 90.0, "opens_per_sample": 0.01}
        return {"rate": {"L1": 500.0, "L2": 90000.0}.get(cfg["kind"], 300.0), "batched": 60000.0, "samples": 200,
                "expected": 200, "opens_per_sample": 0.01, "peak_mb": 200.0, "first_batch_s": 0.1, "cpu_us": 900.0}


def test_quick_run_times_each_format_at_its_default_and_prints_no_nan(tmp_path, capsys):
    """``packio bench --quick``: every packio variant is timed as the README advises, with
    num_workers=0 and a thread per CPU (arrays were timed at num_workers=1); only the limits a
    run is compared with are measured, so the report and the chart's legend hold no nan (the
    chart said 'L1 decode+resize limit, 1 process: nan/s') and no cold-cache entry (none ran)."""
    from packio.bench.runner import QUICK_FORMATS, Setup, legend, limit_lines, plan, run_all, variants

    packed = {name: {"path": str(tmp_path / name), "format": fmt, "payload": "raw" if "size" in kw.get("resize", {})
                     else "encoded", "fixed": "size" in kw.get("resize", {}),
                     "data": "arrays" if "size" in kw.get("resize", {}) else "original", "pack_s": 0.1,
                     "bytes": 1000, "count": 200}
              for name, (fmt, kw) in variants(QUICK_FORMATS).items()}
    setup = Setup(tmp_path / "src", None, "synthetic", [], 1, False, True, 2)
    limits, runs = plan(packed, setup.workers, True, False, setup.src, None, 2)
    packio_runs = [c for c in runs if c["kind"] == "packio"]
    assert {c["path"] for c in packio_runs} == {p["path"] for p in packed.values()}
    assert all((c["workers"], c.get("threads")) == (0, 2) for c in packio_runs), packio_runs
    assert [c["workload"] for c in packio_runs if c["path"].endswith("arrays-224")] == ["W2"]
    child = FakeChild()
    report = run_all(packed, setup, 0.1, runner=child)
    measured = {c["kind"] + str(c.get("procs", "")) for c in child.cfgs if c["workload"] == "limit"}
    assert measured == {"L12", "L2"}  # L1 in 1 process: no run is compared with it, so not measured
    md = render(report)
    assert "nan" not in md.lower() and "| arrays-224 + 2 copy threads | W2 | arrays | 0 |" in md, md
    for data in ("original", "arrays"):
        sel = [x for x in report["runs"] if x.get("data") == data]
        labels = [label for label, _ in legend(sel, report, data)]
        assert labels and not [x for x in labels if "nan" in x or "cold" in x], labels
        assert all(v == v for _, v, _ in limit_lines(report, data))
    assert [label for label, _ in legend(sel, report, "arrays")][0] == "num_workers=0, 2 threads in 1 process"


def test_other_processes_load_is_measured_and_said():
    """CPU time another process spends on the machine counts as other load (a child of this
    process counts as its own once waited for); the report says the machine was busy."""
    import os
    import subprocess
    import sys

    from packio.measure import OtherLoad

    load = OtherLoad()
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        tick, used = os.sysconf("SC_CLK_TCK"), 0.0
        while used < 0.5:  # until it has burnt half a CPU-second, however busy the machine
            with open(f"/proc/{burner.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            used = (int(fields[11]) + int(fields[12])) / tick
        assert load.cores() * (time.perf_counter() - load.t0) >= 0.45
    finally:
        burner.kill()
        burner.wait()
    md = render({**_report([]), "busy": "other processes kept 1.5 of the machine's 2 CPUs busy"})
    assert "**Busy machine:** other processes kept 1.5 of the machine's 2 CPUs busy while this ran" in md
