"""``packio bench``'s orchestration without timing anything: runs and limits come from the
same interleaved passes, a run above its limit has the limit measured again and is reported
as a measurement error (never as a ratio), and the user is told up front how many runs
there are and roughly how long they take."""

from __future__ import annotations

import ast
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
