"""bench/bench_learning_real.py's accounting, without a server: a seed's start and end are the means of its first
and last steps, a complete run in --runs-dir is read rather than run again, and the report and the targets row
carry every seed and the baseline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))

pytest.importorskip("verl", reason="the CPU trainer's settings import verl's core_algos: the [train] extra")

import bench_learning_real as bench  # noqa: E402

from prorl_plugins.cpu_trainer.train import TrainSettings  # noqa: E402


def write_run(folder: Path, rewards: list[float], wall_s: float = 600.0) -> None:
    folder.mkdir(parents=True)
    records = [
        {
            "reward": r,
            "reward_components": {"outcome": r + 0.01},
            "seconds": 30.0 + i,
            "logprob_gap": 1e-4 if i == 0 else None,
            "probe_gap": 3e-5,
        }
        for i, r in enumerate(rewards)
    ]
    (folder / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "wall_s").write_text(f"{wall_s}\n")


def test_a_complete_run_is_read_and_its_start_and_end_average_the_first_and_last_steps(tmp_path, monkeypatch):
    write_run(tmp_path / "seed-0", [0.0, 0.1, 0.2, 0.5, 0.6, 0.7, 0.8])
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: pytest.fail("a complete run was run again"))
    run = bench.run_seed(0, 7, tmp_path / "seed-0", reuse=True)
    assert run.reused and run.start == pytest.approx(0.1) and run.end == pytest.approx(0.7)
    assert run.rise == pytest.approx(0.6) and run.wall_s == 600.0 and run.logprob_gaps == [1e-4]


def test_a_run_shorter_than_asked_for_or_fresh_is_run_again(tmp_path, monkeypatch):
    write_run(tmp_path / "seed-1", [0.0, 0.5])
    ran = []

    def train(argv, **_):
        ran.append(argv)
        (tmp_path / "seed-1" / "steps.jsonl").write_text(
            "".join(
                json.dumps(
                    {"reward": 0.5, "reward_components": {}, "seconds": 1.0, "logprob_gap": None, "probe_gap": 0.0}
                )
                + "\n"
                for _ in range(3)
            )
        )

    monkeypatch.setattr(bench.subprocess, "run", train)
    run = bench.run_seed(1, 3, tmp_path / "seed-1", reuse=True)
    assert not run.reused and len(run.rewards) == 3 and ran[0][ran[0].index("--seed") + 1] == "1"
    assert ran[0][ran[0].index("--steps") + 1] == "3"


def test_the_report_and_the_target_carry_every_seed_and_the_baseline(tmp_path):
    runs = []
    for seed, rewards in enumerate(([0.1, 0.1, 0.1, 0.5, 0.6, 0.7], [0.2, 0.2, 0.2, 0.3, 0.3, 0.3])):
        write_run(tmp_path / f"seed-{seed}", rewards)
        runs.append(bench.run_seed(seed, 6, tmp_path / f"seed-{seed}", reuse=True))
    base = {"episodes": 64, "successes": 13, "rate": 13 / 64, "mixed_groups": 7, "groups": 8}
    text = bench.report(runs, base, TrainSettings.for_workload("arithmetic", steps=6), ["--seeds", "2"], "img/x.png")
    assert text.startswith(bench.BLOCK_START) and text.rstrip().endswith(bench.BLOCK_END)
    assert "**+0.50**" in text and "**+0.10**" in text and "20.3%" in text and "Median rise **+0.30**" in text
