#!/usr/bin/env python3
"""Learning from a prior: GRPO of the real SmolLM2-135M-Instruct through the rollout service, on CPU, seeds side
by side, against the untrained model's success rate measured in the same invocation (issue 39, part 4).

    python bench/bench_learning_real.py [--seeds 3] [--steps N] [--base-episodes 64] [--runs-dir DIR]
                                        [--out docs/benchmarks.md]

Each seed is one `prorl-train-cpu --workload arithmetic` run with the workload's defaults (`make demo-real`'s
command with `--seed S`), in a process of its own with its own vLLM server, sandbox runtime and rollout service,
timed from its start (building nothing: `make llm` built the model) to its end. The baseline is
`prorl-train-cpu --workload arithmetic --measure-base N`: the untrained weights over N episodes of held-out
questions, through the same service.

A seed's *start* is its mean reward over the first three steps and its *end* over the last three (48
episodes each with the defaults), so that one lucky step moves neither; the target is a rise of at least 0.25
(median over seeds), each run under 40 minutes. With `--runs-dir`, a seed whose run is complete there (its
`steps.jsonl` has the steps asked for, `wall_s` beside it) is read instead of run again, and the report says
so (the baseline likewise). Nothing is asserted: the figures go to docs/benchmarks.md's section and its targets table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import BENCH, TargetResult, command_line, machine, replace_section, update_targets, utc_now

from prorl_plugins.cpu_trainer.train import TrainSettings

BLOCK_START = "<!-- bench_learning_real:start -->"
BLOCK_END = "<!-- bench_learning_real:end -->"
TARGET = "real model learns"
RISE_TARGET = 0.25
WALL_LIMIT_S = 40 * 60
WINDOW = 3  # steps averaged at each end of a run
HEADER = (
    f"| seed | start (steps 0-{WINDOW - 1}) | end (last {WINDOW} steps) | rise | steps | wall time | s/step (median) "
    "| logprob gap (max) | weight probe (max) |\n|---|---|---|---|---|---|---|---|---|"
)
TRAIN_CPU = [sys.executable, "-m", "prorl_plugins.cpu_trainer.cli", "--workload", "arithmetic"]


@dataclass
class SeedRun:
    seed: int
    rewards: list[float]
    outcomes: list[float]
    wall_s: float
    step_s: list[float]
    logprob_gaps: list[float]
    probe_gaps: list[float]
    reused: bool

    @property
    def start(self) -> float:
        return statistics.fmean(self.rewards[:WINDOW])

    @property
    def end(self) -> float:
        return statistics.fmean(self.rewards[-WINDOW:])

    @property
    def rise(self) -> float:
        return self.end - self.start


def run_seed(seed: int, steps: int, out: Path, reuse: bool) -> SeedRun:
    log, wall = out / "steps.jsonl", out / "wall_s"
    complete = reuse and wall.exists() and log.exists() and len(log.read_text().splitlines()) >= steps
    if not complete:
        out.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        argv = [*TRAIN_CPU, "--seed", str(seed), "--steps", str(steps), "--out", str(out)]
        subprocess.run(argv, check=True, stdout=(out / "train.log").open("w"), stderr=subprocess.STDOUT)
        wall.write_text(f"{time.monotonic() - started:.1f}\n")
    records = [json.loads(line) for line in log.read_text().splitlines()][:steps]
    return SeedRun(
        seed=seed,
        rewards=[r["reward"] for r in records],
        outcomes=[r["reward_components"].get("outcome", 0.0) for r in records],
        wall_s=float(wall.read_text()),
        step_s=[r["seconds"] for r in records],
        logprob_gaps=[r["logprob_gap"] for r in records if r["logprob_gap"] is not None],
        probe_gaps=[r["probe_gap"] for r in records],
        reused=complete,
    )


def measure_base(episodes: int, out: Path, reuse: bool) -> dict:
    """The untrained model's success rate (prorl-train-cpu --measure-base), or the one measured before in `out`
    over as many episodes (marked `reused`)."""
    report = out / "base_rate.json"
    if reuse and report.exists() and json.loads(report.read_text())["episodes"] >= episodes:
        return {**json.loads(report.read_text()), "reused": True}
    argv = [*TRAIN_CPU, "--measure-base", str(episodes), "--out", str(out)]
    subprocess.run(argv, check=True, stdout=(out / "base.log").open("w"), stderr=subprocess.STDOUT)
    return {**json.loads(report.read_text()), "reused": False}


def plot(runs: list[SeedRun], base_rate: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no screen: render straight to PNG
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.6), dpi=110)
    for run in runs:
        rolling = [statistics.fmean(run.rewards[max(0, i - WINDOW + 1) : i + 1]) for i in range(len(run.rewards))]
        (line,) = axis.plot(rolling, label=f"seed {run.seed} ({WINDOW}-step mean)")
        axis.plot(run.rewards, color=line.get_color(), alpha=0.25, linewidth=1)
    axis.axhline(base_rate, color="grey", linestyle="--", linewidth=1, label="untrained (held-out episodes)")
    axis.set_xlabel("training step (policy version)")
    axis.set_ylabel("mean reward of the step's episodes")
    axis.set_ylim(-0.05, 1.05)
    axis.grid(alpha=0.3)
    axis.legend(loc="upper left", fontsize=8)
    axis.set_title("GRPO of SmolLM2-135M-Instruct on arithmetic, CPU (bench_learning_real)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def report(runs: list[SeedRun], base: dict, settings: TrainSettings, argv: list[str], image: str) -> str:
    rise = statistics.median(run.rise for run in runs)
    rows = "\n".join(
        f"| {r.seed}{' (earlier)' if r.reused else ''} | {r.start:.2f} | {r.end:.2f} | **{r.rise:+.2f}** | "
        f"{len(r.rewards)} | {r.wall_s / 60:.1f} min | "
        f"{statistics.median(r.step_s):.0f} s | {max(r.logprob_gaps):.1e} | {max(r.probe_gaps):.1e} |"
        for r in runs
    )
    gaps = [g for r in runs for g in r.logprob_gaps]
    t, k = settings.temperature, settings.staleness["max_staleness"]
    setup = "\n".join(
        [
            "- **Each run:** `prorl-train-cpu --workload arithmetic --seed S` (`make demo-real` with a seed): "
            f"{settings.steps} steps of {settings.groups_per_step} x {settings.group_size} episodes, one turn of at "
            f"most {settings.max_tokens_per_turn} tokens ending at the block's closing fence, temperature {t:g} (the "
            f"trainer scores softmax(logits / {t:g}), vLLM reports the same), LoRA rank {settings.lora_rank} at lr "
            f"{settings.learning_rate:.0e}, {settings.ppo_epochs} epoch, pace K={k}; questions of one operator "
            "(+ - *) between 1-digit numbers, graded by running the policy's program again at eval.",
            f"- **Baseline{', earlier' if base.get('reused') else ', this invocation'}:** the untrained weights "
            f"over {base['episodes']} held-out episodes: "
            f"**{base['rate']:.1%}** ({base['successes']}/{base['episodes']}, {base['mixed_groups']} of "
            f"{base['groups']} groups mixed).",
        ]
    )
    return f"""{BLOCK_START}
## Learning from a prior: the real model, GRPO on CPU — {utc_now()}

- **Machine:** {machine("vLLM (CPU, --enforce-eager, models/smollm2-135m-instruct)", bubblewrap=True)}
- **Command:** `{command_line(__file__, argv)}`
{setup}

{HEADER}
{rows}

Median rise **{rise:+.2f}** (target ≥ +{RISE_TARGET:.2f}, each run under {WALL_LIMIT_S // 60} minutes). The logprob
gap is max |trainer - vLLM| over the tokens sampled at the version being trained ({len(gaps)} steps had such
tokens: with pace K=1 most batches were sampled one version back); the probe scores a fixed text after every push.

![reward per step, 3 seeds]({image})

**How to read this.** A seed or baseline marked *earlier* was read from `--runs-dir`, made by an earlier
invocation with the same settings, not run again. The reward is the trainer's mean over each step's episodes
(outcome 1 for a right answer, less 0.01 per turn). Start and end average {WINDOW} steps,
{WINDOW * settings.batch_size} episodes each.
The baseline is measured on questions no run trains on first, with the weights as built; a run's start is its
first steps' own episodes, so the two differ by sampling noise.
{BLOCK_END}
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    defaults = TrainSettings.for_workload("arithmetic")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--base-episodes", type=int, default=64)
    parser.add_argument("--runs-dir", type=Path, default=BENCH / "results" / "learning-real")
    parser.add_argument("--fresh", action="store_true", help="run every seed, even one complete in --runs-dir")
    parser.add_argument("--out", type=Path, default=BENCH.parent / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    settings = TrainSettings.for_workload("arithmetic", steps=args.steps)
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    base = measure_base(args.base_episodes, args.runs_dir, reuse=not args.fresh)
    runs = []
    for seed in range(args.seeds):
        runs.append(run_seed(seed, args.steps, args.runs_dir / f"seed-{seed}", reuse=not args.fresh))
        print(f"seed {seed}: {runs[-1].start:.2f} -> {runs[-1].end:.2f} in {runs[-1].wall_s / 60:.1f} min", flush=True)
    image = args.out.parent / "img" / "learning-real.png"
    plot(runs, base["rate"], image)
    replace_section(args.out, BLOCK_START, BLOCK_END, report(runs, base, settings, argv, f"img/{image.name}"))
    rise = statistics.median(run.rise for run in runs)
    slowest = max(run.wall_s for run in runs)
    met = rise >= RISE_TARGET and slowest <= WALL_LIMIT_S
    note = (
        f"per seed {', '.join(f'{r.rise:+.2f}' for r in runs)}; untrained {base['rate']:.1%} over "
        f"{base['episodes']} held-out episodes; slowest run {slowest / 60:.1f} min; bench_learning_real"
    )
    update_targets(args.out, {TARGET: TargetResult(f"{rise:+.2f} (median of {len(runs)})", met, note)})
    print(f"median rise {rise:+.2f}; report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
