#!/usr/bin/env python3
"""Weight-update modes in training: the wall time the CPU trainer needs to reach a reward with each barrier mode.

    python bench/bench_weight_update_training.py [--seeds 2] [--steps 30] [--modes drain,abort,keep]
                                                 [--out docs/benchmarks.md]

bench_weight_update.py measures what a barrier costs generation with a stand-in trainer; this one trains. The
CPU trainer (`prorl-train-cpu`'s trainer: GRPO on the tiny model, its weights pushed to vLLM after every step
inside the service's barrier) learns the `relay` task decoupled (pace K=1, `deadline-take`, the proximal PPO
anchor: bench_training.py's best mode), so episodes for the next version run while it trains and some turns are
in flight at every weight push. Modes differ only in `TrainSettings.weight_update`: `drain`, `abort` (partial
rollouts) or `keep`. The rollout service reads turns as streams (`--llm-stream`, which `keep` needs) in every
mode, so all pay the same. Servers and placement as bench_training.py's (trainer-alone); seeds and modes
interleaved. Reported per mode (over seeds): the wall time to a mean reward of 0.8, steps to it, steps/s, the
trainer's busy share and the final reward, as bench_training.py computes them. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

from bench_training import GOAL, Run, count, median, run_one, seconds, training_servers
from common import command_line, machine, replace_section, utc_now

from prorl_plugins.cpu_trainer.train import TrainSettings

START, END = "<!-- bench_weight_update_training:start -->", "<!-- bench_weight_update_training:end -->"
MODES = ("drain", "abort", "keep")
WORKLOAD = "relay"
STALENESS = {"mode": "pace", "max_staleness": 1, "pace_rule": "deadline-take"}


def train_all(args: argparse.Namespace, work: Path) -> tuple[dict[str, list[Run]], str]:
    runs: dict[str, list[Run]] = {mode: [] for mode in args.modes}
    with training_servers(work, "trainer-alone") as (vllm, runtime, service_cpus, where):
        for seed in range(1, args.seeds + 1):
            for mode in args.modes if seed % 2 else args.modes[::-1]:
                run = Run(WORKLOAD, mode, seed)
                settings = TrainSettings(
                    steps=args.steps, seed=seed, staleness=STALENESS, ppo_anchor="proximal", weight_update=mode
                )
                print(f"{mode}, seed {seed}: {args.steps} steps ...", flush=True)
                run_one(run, settings, runtime.url, vllm.url, work, service_cpus, "--llm-stream")
                print(
                    f"  {run.wall_s:.0f} s, time to {GOAL}: {seconds(run.time_to_goal())}, "
                    f"reward {run.final_reward():.2f} at the end, trainer busy {run.busy():.0%}",
                    flush=True,
                )
                runs[mode].append(run)
    return runs, where


def report(runs: dict[str, list[Run]], args: argparse.Namespace, where: str) -> str:
    base = median([r.time_to_goal() for r in runs.get("drain", [])])
    rows = []
    for mode, group in runs.items():
        goal = median([r.time_to_goal() for r in group])
        versus = "—" if not math.isfinite(goal) or not math.isfinite(base) else f"{goal / base:.2f}x"
        rows.append(
            f"| {mode} | **{seconds(goal)}** | {', '.join(seconds(r.time_to_goal()) for r in group)} | {versus} "
            f"| {', '.join(count(r.steps_to_goal()) for r in group)} "
            f"| {median([r.steps_per_s() for r in group]):.3f} | {median([r.busy() for r in group]):.0%} "
            f"| {median([r.final_reward() for r in group]):.2f} |"
        )
    return (
        f"{START}\n## Weight updates in training: time to reward per barrier mode — {utc_now()}\n\n"
        f"`{command_line(__file__, args.argv)}` on {machine('vLLM (CPU, --enforce-eager, models/tiny-qwen2)')}; "
        f"{where}.\n\n"
        f"The CPU trainer on `{WORKLOAD}`, decoupled (pace K=1, `deadline-take`, proximal PPO anchor), {args.steps} "
        f"steps per run, {args.seeds} seed(s) per mode; modes differ only in the barrier around each weight push. "
        "The service reads turns as streams in every mode.\n\n"
        f"| barrier mode | time to reward {GOAL} (median) | per seed | ÷ drain | steps to {GOAL} per seed | steps/s "
        "| trainer busy | final reward |\n"
        "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n" + how_to_read(runs) + f"{END}\n"
    )


def how_to_read(runs: dict[str, list[Run]]) -> str:
    """What the table says, from its own figures (steps/s against drain where drain ran)."""
    speed = {mode: median([r.steps_per_s() for r in group]) for mode, group in runs.items()}
    versus = ""
    if "drain" in speed:
        others = [m for m in speed if m != "drain"]
        versus = "Steps/s against `drain`: " + ", ".join(f"`{m}` {speed[m] / speed['drain']:.2f}x" for m in others)
        fastest = max(speed, key=speed.get)
        versus += f"; here `{fastest}` made the most steps per second. "
    return (
        "**How to read this.** Relay's turns are a few tokens long and held to a grammar, and its tools answer at "
        "once: at a weight push few turns are in flight and each is short, so a `drain` pause waits little, while "
        "`abort` samples an interrupted grammar-held turn again whole (a turn under a regex cannot go on from a "
        "part: docs/rollout.md), and `abort` and `keep` add a round of vLLM's `/pause` and `/resume` to every step. "
        f"{versus}*Trainer busy* counts the barrier as the trainer's own time (a `drain` pause's wait included), so "
        "compare steps/s and time to reward. Partial rollouts pay where turns are long (bench_weight_update's table "
        "above); a learnable long-turn workload (the real model's, bench_learning_real) would take hours per mode "
        "here. One run's curve is noise (seeds differ by tens of seconds): compare medians.\n"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--modes", default=",".join(MODES), help="barrier modes, of %(default)s")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.argv = argv
    args.modes = [m for m in MODES if m in args.modes.split(",")]
    if not args.modes:
        parser.error(f"--modes: at least one of {', '.join(MODES)}")
    with tempfile.TemporaryDirectory(prefix="bench-wu-training-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        work.chmod(0o711)  # a root runtime's sandbox uids must traverse to its state dir inside
        try:
            runs, where = train_all(args, work)
        except RuntimeError as exc:  # a server that would not start (localstack)
            print(f"bench_weight_update_training: {exc}", file=sys.stderr)
            return 1
    block = report(runs, args, where)
    print(block)
    if args.out is not None:
        replace_section(args.out, START, END, block)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
