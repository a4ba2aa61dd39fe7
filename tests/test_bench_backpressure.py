"""bench/bench_backpressure.py's accounting, without a server: the live count read from the runtime's /metrics, the
time-weighted means over a run's polls, and the report's ratios and its check against the promised bound."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))

import bench_backpressure  # noqa: E402
from bench_backpressure import Run, Sample  # noqa: E402


def run(mode: str, lives: list[int], running: int, wall_s: float, jobs: int = 100) -> Run:
    """A run polled once a second, `running` episodes in the run stage at every poll."""
    samples = [Sample(float(t), live, min(live, running), 0) for t, live in enumerate(lives)]
    return Run(mode, jobs, wall_s, samples, bound=10, margin=2, run_limit=8, eval_workers=32)


def test_the_live_count_is_the_runtime_gauge():
    metrics = "# HELP prorl_sandbox_active Sandboxes alive now\n# TYPE prorl_sandbox_active gauge\n"
    assert bench_backpressure.live_sandboxes(metrics + "prorl_sandbox_active 37.0\n") == 37
    with pytest.raises(RuntimeError):
        bench_backpressure.live_sandboxes(metrics)


def test_means_weigh_each_poll_by_the_time_it_holds():
    done = run("gate", [0, 10, 10, 4], running=8, wall_s=3.0)
    assert done.time_mean("live") == pytest.approx((0 + 10 + 10) / 3)
    assert (done.peak_live, done.peak_idle) == (10, 2)
    assert done.time_mean("running") == pytest.approx((0 + 8 + 8) / 3)
    assert done.run_s_per_episode == pytest.approx(done.time_mean("running") / done.episodes_per_s)
    assert done.live_at(1.5) == 10 and done.live_at(99) == 4
    assert done.episodes_per_s == pytest.approx(100 / 3)


def test_the_report_gives_gate_over_baseline_and_checks_the_bound():
    runs = {
        "baseline": [run("baseline", [0, 100, 50, 0], running=8, wall_s=3.0)],
        "gate": [run("gate", [0, 12, 12, 0], running=8, wall_s=4.0)],
    }
    args = argparse.Namespace(jobs=100, sleep_s=0.2, run_workers=8, rounds=1)
    text = bench_backpressure.report(runs, args, ["--jobs", "100"])
    assert text.startswith(bench_backpressure.START) and text.rstrip().endswith(bench_backpressure.END)
    assert "| (b) ÷ (a) | | 0.120x |" in text  # peak live 12 against 100
    assert "**0.750x**" in text  # 25 against 33.3 episodes/s
    assert "within the promised run limit + `--init-ahead` + eval workers (8 + 2 + 32 = 42)" in text
    runs["gate"] = [run("gate", [0, 50, 0], running=8, wall_s=2.0)]
    assert "**over** the promised" in bench_backpressure.report(runs, args, [])
