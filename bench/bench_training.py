#!/usr/bin/env python3
"""Training end to end: coupled against decoupled rollouts, measured as a team choosing between them would, by
the wall time the same trainer needs to reach a reward.

    python bench/bench_training.py [--seeds 3] [--steps 30] [--workload both] [--quick] [--out docs/benchmarks.md]
                                   [--runs-file runs.jsonl]

Three seeds take about two hours here. With `--runs-file`, each finished run is kept in that file and a later
invocation with the same settings takes it from there instead of running it again (the report says how many
and when they were made), so that a benchmark cut short resumes where it stopped.

The trainer is the CPU trainer (`prorl-train-cpu`: GRPO with verl's core_algos on the tiny model, its weights
pushed to vLLM after every step) on the `relay` task, through a real vLLM server, sandbox runtime and rollout
service. Modes differ only in the staleness plugin's pace K:

- *coupled* (pace K=0): nothing is generated ahead of the version it will be trained at, so generation waits
  for each step's weights and training for each step's batch, as in an in-trainer loop;
- *decoupled, pace K=1* and *K=2*: episodes for the next one or two versions run while the trainer trains,
  admitted by pace's default rule, `deadline-take` (`--pace-rule`). The other, `any-take`, counts the batch
  being trained on as pending at its own version, so at K=1, once the trainer trains on trajectories one
  version old, it admits nothing until that batch is acknowledged: every other step then waits for a whole
  generation.
  `deadline-take` admits up to (K+1)·B pending whatever their age, and the service's take serves deadlines.
  The trainer takes its PPO ratio against the weights each step starts from, with behaviour importance
  weights (`--ppo-anchor proximal`, the decoupled PPO objective); `behaviour` clips around the policy that
  sampled each token, which at K >= 1 spends the clip on how far the policy moved since (docs/cpu-trainer.md).

Workloads: *relay* as it is (two turns of instant shell commands: generation is a small part of a step), and
*slow tools*: the same task with each tool call first sleeping a latency drawn per turn (lognormal about
`--slow-median-s`, relay's `tool_latency_s`), as test suites and builds take time, so that rollouts are at
least half of a coupled step.

Placement (`--placement`), set for every thread of each process tree, on two halves of this process's CPUs:
*trainer-alone* (the default) gives the trainer (this process) one half and vLLM, the sandbox runtime and the
rollout service the other, as when training runs on machines of its own; *llm-alone* gives vLLM one half and
the trainer, the runtime and the service the other. On 2 cores one party must share: with llm-alone, episodes
running during a decoupled step take CPU from the training beside them, which coupled steps never do.
Each run gets a fresh rollout service (its buffer and version start empty) and the same vLLM server and
runtime; the trainer pushes its initial weights first, so no run sees another's. Seeds and modes are
interleaved (seed 1: modes in order, seed 2: reversed, ...), so that the machine's drift spreads over modes.

Reported per workload and mode (over seeds): the wall time to a mean reward of 0.8 (the first step whose
3-step rolling mean reaches it, counted in the steps' own seconds from the first take), steps/s, the
trainer's busy fraction, the final reward (mean of the last 5 steps), and a plot of reward against wall time
for every run. For relay it also gives the overlap bound: with T_train and T_gen a coupled step's training
and waiting parts, no overlap can bring a step below max(T_train, T_gen), so decoupled steps can take at
best max(T_train, T_gen) / (T_train + T_gen) of coupled ones. Nothing is asserted: ratios from one run are the
figures, and docs/benchmarks.md's targets table gets them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import (
    BENCH,
    TargetResult,
    command_line,
    machine,
    pin_tree,
    replace_section,
    split_cpus,
    stop,
    update_targets,
    utc_now,
)

from prorl_adapter.dev import localstack
from prorl_plugins.cpu_trainer.actor import ANCHORS
from prorl_plugins.cpu_trainer.train import CpuTrainer, StepRecord, TrainSettings
from prorl_plugins.staleness import DEFAULT_PACE_RULE, PACE_RULES

BLOCK_START = "<!-- bench_training:start -->"
BLOCK_END = "<!-- bench_training:end -->"
REPO = BENCH.parent
PLOTS = REPO / "docs" / "img"
GOAL = 0.8  # the reward the time is measured to
ROLLING = 3  # steps in the rolling mean that must reach GOAL
FINAL = 5  # steps averaged for the final reward
MODES = {"coupled (pace K=0)": 0, "decoupled, pace K=1": 1, "decoupled, pace K=2": 2}


@dataclass
class Run:
    workload: str
    mode: str
    seed: int
    records: list[StepRecord] = field(default_factory=list)
    earlier: str | None = None  # when an earlier invocation finished it (taken from --runs-file); None: this one

    @property
    def elapsed(self) -> list[float]:
        """Wall time at the end of each step, from the first take."""
        total, out = 0.0, []
        for record in self.records:
            total += record.seconds
            out.append(total)
        return out

    def rolling(self) -> list[float]:
        rewards = [r.reward for r in self.records]
        return [statistics.fmean(rewards[max(0, i + 1 - ROLLING) : i + 1]) for i in range(len(rewards))]

    def time_to_goal(self) -> float:
        """inf where the run never reached it."""
        for seconds, reward in zip(self.elapsed, self.rolling(), strict=True):
            if reward >= GOAL:
                return seconds
        return math.inf

    def steps_to_goal(self) -> float:
        """Steps until the rolling mean reached GOAL (inf: never): learning per step, whatever the machine's speed."""
        for step, reward in enumerate(self.rolling(), start=1):
            if reward >= GOAL:
                return step
        return math.inf

    @property
    def wall_s(self) -> float:
        return sum(r.seconds for r in self.records)

    def steps_per_s(self) -> float:
        return len(self.records) / self.wall_s

    def busy(self) -> float:
        return sum(r.seconds * r.trainer_busy for r in self.records) / self.wall_s

    def final_reward(self) -> float:
        return statistics.fmean(r.reward for r in self.records[-FINAL:])

    def train_s(self) -> float:
        """A step's mean training part (update, weight push, version); the rest is waiting for its batch."""
        return statistics.fmean(r.seconds * r.trainer_busy for r in self.records)

    def wait_s(self) -> float:
        return statistics.fmean(r.seconds * (1 - r.trainer_busy) for r in self.records)

    @property
    def key(self) -> tuple[str, str, int]:
        return self.workload, self.mode, self.seed

    def to_json(self, settings: dict) -> str:
        """One line of a runs file: the run, its step records and the settings it ran with."""
        records = [{**asdict(r), "staleness": {str(k): n for k, n in r.staleness.items()}} for r in self.records]
        return json.dumps({"run": [*self.key], "settings": settings, "finished": utc_now(), "records": records})

    @classmethod
    def from_json(cls, document: dict) -> Run:
        records = [
            StepRecord(**{**r, "staleness": {int(k): n for k, n in r["staleness"].items()}})
            for r in document["records"]
        ]
        workload, mode, seed = document["run"]
        return cls(workload, mode, seed, records, earlier=document["finished"])


# -- the runs ---------------------------------------------------------------------------------------------
def run_one(
    run: Run,
    settings: TrainSettings,
    sandbox_url: str,
    vllm_url: str,
    work: Path,
    service_cpus: frozenset[int] | None,
    *service_args: str,
) -> None:
    """One training run against a fresh rollout service (started with `service_args` beside its plugin config)."""
    config = work / f"{run.workload}-{run.mode}-{run.seed}-plugins.json".replace(" ", "_")
    config.write_text(json.dumps(settings.plugin_config()))
    log = config.with_suffix(".log")
    service = localstack.start_rollout_service(
        [sandbox_url], [vllm_url], "--plugin-config", str(config), *service_args, log=log
    )
    if service_cpus is not None:
        pin_tree(service.process.pid, service_cpus)
    try:
        trainer = CpuTrainer(settings, localstack.TINY_MODEL, service.url, [vllm_url], work / "run")
        asyncio.run(trainer.run(run.records.append))
    finally:
        stop(service, timeout=60)


@contextlib.contextmanager
def training_servers(
    work: Path, placement: str
) -> Iterator[tuple[localstack.Service, localstack.Service, frozenset[int] | None, str]]:
    """vLLM (the tiny model) and a bwrap sandbox runtime, placed on this process's CPUs as `placement` says
    (this process is the trainer): (vllm, runtime, the CPUs for the rollout services or None, where, in words)."""
    split = split_cpus()
    localstack.build_tiny_model()
    print("starting vLLM and the sandbox runtime ...", flush=True)
    vllm = localstack.start_vllm(log=work / "vllm.log")
    try:
        runtime = localstack.start_sandbox_runtime(work / "sandbox-state", "bwrap", log=work / "sandbox.log")
    except BaseException:
        stop(vllm, timeout=30)
        raise
    service_cpus = None
    if split is None:
        where = "one CPU: everything on it"
    elif placement == "trainer-alone":
        servers, trainer = split
        pin_tree(os.getpid(), trainer)  # this process, the trainer ...
        pin_tree(vllm.process.pid, servers)  # ... and not the servers
        pin_tree(runtime.process.pid, servers)
        service_cpus = servers
        where = f"the trainer on CPU {cpus(trainer)}; vLLM, the sandbox runtime and the rollout service on CPU "
        where += f"{cpus(servers)} (trainer-alone)"
    else:
        llm_cpus, others = split
        pin_tree(os.getpid(), others)  # this process (the trainer) and the servers it started ...
        pin_tree(vllm.process.pid, llm_cpus)  # ... but vLLM
        where = f"vLLM on CPU {cpus(llm_cpus)}; the trainer, the sandbox runtime and the rollout service on "
        where += f"CPU {cpus(others)} (llm-alone)"
    try:
        yield vllm, runtime, service_cpus, where
    finally:
        stop(runtime)
        stop(vllm, timeout=30)


def run_all(args: argparse.Namespace, work: Path) -> tuple[list[Run], str]:
    with training_servers(work, args.placement) as (vllm, runtime, service_cpus, where):
        return run_modes(args, work, vllm, runtime, service_cpus), where


def run_modes(
    args: argparse.Namespace,
    work: Path,
    vllm: localstack.Service,
    runtime: localstack.Service,
    service_cpus: frozenset[int] | None,
) -> list[Run]:
    workloads = {"relay": 0.0, "slow tools": args.slow_median_s}
    chosen = [name for name in workloads if args.workload in ("both", name.split()[0])]
    runs: list[Run] = []
    earlier = earlier_runs(args)
    for seed in range(1, args.seeds + 1):
        modes = args.modes if seed % 2 else args.modes[::-1]
        for workload in chosen:
            for mode in modes:
                run = Run(workload, mode, seed)
                if run.key in earlier:
                    print(f"{workload}, {mode}, seed {seed}: from {args.runs_file}", flush=True)
                    runs.append(earlier[run.key])
                    continue
                staleness = {"mode": "pace", "max_staleness": MODES[mode], "pace_rule": pace_rule(mode, args)}
                settings = TrainSettings(
                    steps=args.steps,
                    seed=seed,
                    staleness=staleness,
                    tool_latency_median_s=workloads[workload],
                    ppo_anchor=args.ppo_anchor,
                )
                print(f"{workload}, {mode}, seed {seed}: {args.steps} steps ...", flush=True)
                run_one(run, settings, runtime.url, vllm.url, work, service_cpus)
                if args.runs_file:
                    args.runs_file.parent.mkdir(parents=True, exist_ok=True)
                    with args.runs_file.open("a") as out:
                        print(run.to_json(run_settings(args, mode)), file=out)
                print(
                    f"  {run.wall_s:.0f} s, reward {run.final_reward():.2f} at the end, "
                    f"time to {GOAL}: {run.time_to_goal():.0f} s, trainer busy {run.busy():.0%}",
                    flush=True,
                )
                runs.append(run)
    return runs


def pace_rule(mode: str, args: argparse.Namespace) -> str:
    """Coupled runs use `any-take`: at K=0 both rules admit the same (B pending, none ahead of the version)."""
    return args.pace_rule if MODES[mode] > 0 else "any-take"


def run_settings(args: argparse.Namespace, mode: str) -> dict:
    """What must match for a run in --runs-file to stand in for one of `mode` this invocation would make. The
    PPO anchor does not, for coupled runs: at K=0 the anchors differ only by the trainer's and the server's
    disagreement on a token (`logprob_gap`, at most 3e-5 in these runs)."""
    settings = {
        "steps": args.steps,
        "slow_median_s": args.slow_median_s,
        "placement": args.placement,
        "pace_rule": pace_rule(mode, args),
    }
    if MODES[mode] > 0:
        settings["ppo_anchor"] = args.ppo_anchor
    return settings


def recorded_settings(document: dict) -> dict:
    """A runs-file line's settings; decoupled runs recorded before --ppo-anchor existed used the behaviour one."""
    settings = dict(document["settings"])
    if MODES.get(document["run"][1], 0) > 0:
        settings.setdefault("ppo_anchor", "behaviour")
    return settings


def earlier_runs(args: argparse.Namespace) -> dict[tuple[str, str, int], Run]:
    """The runs --runs-file holds that were made with this invocation's settings (the others are ignored)."""
    if args.runs_file is None or not args.runs_file.exists():
        return {}
    found: dict[tuple[str, str, int], Run] = {}
    for line in args.runs_file.read_text().splitlines():
        document = json.loads(line)
        run = Run.from_json(document)
        if run.mode in MODES and recorded_settings(document) == run_settings(args, run.mode):
            found[run.key] = run
    return found


def cpus(ids: frozenset[int]) -> str:
    return ",".join(str(i) for i in sorted(ids))


# -- the report -------------------------------------------------------------------------------------------
def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def seconds(value: float) -> str:
    return "not reached" if math.isinf(value) else f"{value:.0f} s"


def by_mode(runs: list[Run], workload: str) -> dict[str, list[Run]]:
    return {mode: [r for r in runs if r.workload == workload and r.mode == mode] for mode in MODES}


def overlap_bound(coupled: list[Run]) -> tuple[float, float, float]:
    """(T_train, T_gen, bound) from the coupled runs' steps."""
    train, wait = median([r.train_s() for r in coupled]), median([r.wait_s() for r in coupled])
    return train, wait, max(train, wait) / (train + wait)


def workload_table(runs: list[Run], workload: str) -> str:
    modes = by_mode(runs, workload)
    coupled = modes[next(iter(MODES))]
    base_goal = median([r.time_to_goal() for r in coupled])
    base_step = median([r.wall_s / len(r.records) for r in coupled])
    lines = [
        f"| Mode | time to reward {GOAL} (median) | per seed | ÷ coupled | steps to {GOAL} per seed | steps/s "
        f"| s per step ÷ coupled | trainer busy | final reward |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, group in modes.items():
        if not group:
            continue
        goal = median([r.time_to_goal() for r in group])
        step = median([r.wall_s / len(r.records) for r in group])
        versus = "—" if math.isinf(goal) or math.isinf(base_goal) else f"{goal / base_goal:.2f}x"
        lines.append(
            f"| {mode} | **{seconds(goal)}** | {', '.join(seconds(r.time_to_goal()) for r in group)} | {versus} "
            f"| {', '.join(count(r.steps_to_goal()) for r in group)} "
            f"| {median([r.steps_per_s() for r in group]):.3f} | {step / base_step:.2f}x "
            f"| {median([r.busy() for r in group]):.0%} | {median([r.final_reward() for r in group]):.2f} |"
        )
    return "\n".join(lines)


def mixed_invocations(modes: dict[str, list[Run]]) -> str:
    """A note when some of a workload's runs came from earlier invocations (which may be several: a runs file
    keeps no invocation's name): their seconds compare the machine's states as much as the modes."""
    runs = [r for group in modes.values() for r in group]
    taken = sum(1 for r in runs if r.earlier)
    if not taken:
        return ""
    return (
        f"; {taken} of these {len(runs)} runs came from an earlier invocation (`--runs-file`), not side by side "
        "with the others: rerun without it to compare the modes"
    )


def targets(runs: list[Run]) -> dict[str, TargetResult]:
    found: dict[str, TargetResult] = {}
    coupled_mode, *decoupled_modes = MODES
    slow = by_mode(runs, "slow tools")
    if slow[coupled_mode]:
        base = median([r.time_to_goal() for r in slow[coupled_mode]])
        ratios = {m: median([r.time_to_goal() for r in slow[m]]) / base for m in decoupled_modes if slow[m]}
        if ratios and not math.isinf(base) and not math.isnan(base):
            best = min(ratios.values())
            note = ", ".join(f"{m.split(', ')[-1]} {times(v)}" for m, v in ratios.items())
            note += f" of coupled's {base:.0f} s (median of {len(slow[coupled_mode])} seed(s))"
            note += f"; {best / 0.7 - 1:.0%} over the target" if best > 0.7 else ""
            note += mixed_invocations(slow)
            found["time to reward, slow tools"] = TargetResult(f"{best:.2f}x", best <= 0.7, note + "; bench_training")
    relay = by_mode(runs, "relay")
    if relay[coupled_mode]:
        found["time to reward, relay"] = relay_target(relay, coupled_mode, decoupled_modes)
    return found


def relay_target(relay: dict[str, list[Run]], coupled_mode: str, decoupled_modes: list[str]) -> TargetResult:
    """Decoupled time to reward within 10% of the overlap bound, on relay as it is. The bound holds for seconds
    per step; time to reward also counts the steps each mode needs, so both ratios are given, and a miss is
    put down to the one that misses."""
    coupled = relay[coupled_mode]
    base_goal = median([r.time_to_goal() for r in coupled])
    modes = [m for m in decoupled_modes if relay[m]]
    if not modes or math.isinf(base_goal):
        return TargetResult("—", False, "coupled never reached the reward, or no decoupled mode ran; bench_training")
    train, wait, bound = overlap_bound(coupled)
    base_step = median([r.wall_s / len(r.records) for r in coupled])
    goal = {m: median([r.time_to_goal() for r in relay[m]]) / base_goal for m in modes}
    step = {m: median([r.wall_s / len(r.records) for r in relay[m]]) / base_step for m in modes}
    best = min(modes, key=goal.get)
    met = goal[best] <= 1.1 * bound
    name = best.split(", ")[-1]
    note = "time to reward: " + ", ".join(f"{m.split(', ')[-1]} {times(goal[m])}" for m in modes)
    note += f" of coupled's {base_goal:.0f} s; s/step: " + ", ".join(
        f"{m.split(', ')[-1]} {step[m]:.2f}x" for m in modes
    )
    note += f"; bound {bound:.2f}x (T_train {train:.1f} s, T_gen {wait:.1f} s); median of {len(coupled)} seed(s)"
    steps = {m: median([r.steps_to_goal() for r in group]) for m, group in relay.items() if group}
    if goal[best] < bound:
        note += (
            f"; below the bound, which holds for seconds per step, because {name} reached {GOAL} in "
            f"{count(steps[best])} steps (median) against coupled's {count(steps[coupled_mode])}"
        )
    if not met:
        note += f"; {goal[best] / bound - 1:.0%} over the bound"
        if step[best] <= 1.1 * bound:
            note += (
                f": its steps are as fast as the bound allows ({step[best]:.2f}x), but it needed "
                f"{count(steps[best])} steps to {GOAL} (median) against coupled's {count(steps[coupled_mode])}"
            )
        else:
            beside, waits = median([r.train_s() for r in relay[best]]), median([r.wait_s() for r in relay[best]])
            if beside > train:
                note += (
                    f", and its steps are slower than the bound ({step[best]:.2f}x) because training beside "
                    f"generation is slower than alone: {name} trains {beside:.1f} s per step against {train:.1f} s "
                    f"(with that the bound is {max(beside, wait) / (train + wait):.2f}x)"
                )
            else:
                note += f", and its steps are slower than the bound ({step[best]:.2f}x): it still waits {waits:.2f} s"
    note += mixed_invocations(relay)
    return TargetResult(f"{times(goal[best])} vs bound {bound:.2f}x", met, note + "; bench_training")


def count(steps: float) -> str:
    return "not reached" if math.isinf(steps) else f"{steps:.0f}"


def times(ratio: float) -> str:
    return "not reached" if math.isinf(ratio) else f"{ratio:.2f}x"


def plot(runs: list[Run], workload: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no screen: straight to PNG
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.6), dpi=110)
    for color, (mode, group) in zip(
        ("tab:red", "tab:blue", "tab:green"), by_mode(runs, workload).items(), strict=False
    ):
        for index, run in enumerate(group):
            axis.plot(
                run.elapsed, run.rolling(), color=color, alpha=0.8, linewidth=1.2, label=mode if index == 0 else None
            )
    axis.axhline(GOAL, color="grey", linestyle=":", linewidth=1)
    axis.set_xlabel("wall time (s, from the first take)")
    axis.set_ylabel(f"reward ({ROLLING}-step rolling mean)")
    axis.set_ylim(-0.05, 1.05)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right", fontsize=8)
    axis.set_title(f"CPU trainer on {workload}: reward against wall time, one line per seed", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def plot_path(workload: str) -> Path:
    return PLOTS / f"training-{workload.replace(' ', '-')}.png"


def render(runs: list[Run], args: argparse.Namespace, where: str) -> str:
    sections = []
    for workload in dict.fromkeys(r.workload for r in runs):
        extra = ""
        if workload == "relay":
            train, wait, bound = overlap_bound(by_mode(runs, workload)[next(iter(MODES))])
            extra = (
                f"\n\nOverlap bound: a coupled step trains for {train:.1f} s and waits {wait:.1f} s for its batch "
                f"(medians), so decoupled steps take at best {bound:.2f}x as long as coupled ones."
            )
        else:
            extra = f"\n\nTool latency per call: lognormal about {args.slow_median_s:g} s (sigma 0.5, at most 4x)."
        image = plot_path(workload).relative_to(REPO / "docs")
        sections.append(
            f"### {workload}\n\n{workload_table(runs, workload)}{extra}\n\n![reward against wall time]({image})\n"
        )
    body = "\n".join(sections)
    return f"""{BLOCK_START}
## Training: coupled vs decoupled, time to reward — {utc_now()}

- **Machine:** {machine("vLLM (CPU, --enforce-eager, models/tiny-qwen2)", bubblewrap=True)}
- **Where the processes ran:** {where}
- **Command:** `{command_line(__file__, args.argv)}`
- **Runs:** {args.seeds} seed(s) x {len(args.modes)} modes per workload, {args.steps} steps each (the CPU trainer's
  defaults otherwise: {TrainSettings().batch_size} episodes per step, groups of {TrainSettings().group_size});
  the decoupled modes admit by pace's `{args.pace_rule}` rule and train with the `{args.ppo_anchor}` PPO anchor.
  {resumed(runs)}

{body}
**How to read this.** Time to reward is wall time, counted in the trainer's own step times from its first
take; a run that never reaches {GOAL} shows as not reached, and a median over seeds with one such run is the
middle run's. One run's learning curve is noise (the seeds differ by minutes): compare medians, and the plots.
*Trainer busy* is the share of a step spent training and pushing weights rather than waiting for its batch.
Decoupled modes train on trajectories up to K versions old (the staleness plugin's pace; nothing is dropped),
which can slow learning per step while it speeds each step: time to reward measures both at once, and *steps to
{GOAL}* the learning per step alone. Runs taken from `--runs-file` ran in an earlier invocation, on the machine
as it was then: where their modes' seconds per step differ from this invocation's, the seconds mix two
machines and the steps do not.
{BLOCK_END}
"""


def resumed(runs: list[Run]) -> str:
    earlier = sorted(r.earlier for r in runs if r.earlier)
    if not earlier:
        return "All made by this invocation."
    return (
        f"{len(earlier)} of the {len(runs)} runs were made by an earlier invocation (`--runs-file`), finished "
        f"{earlier[0]} to {earlier[-1]}."
    )


# -- main -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=None, help="runs of each mode (default 3; --quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 30; --quick 6)")
    parser.add_argument("--workload", choices=("relay", "slow", "both"), default="both")
    parser.add_argument("--slow-median-s", type=float, default=2.0, help="median tool latency of the slow workload")
    parser.add_argument("--placement", choices=("trainer-alone", "llm-alone"), default="trainer-alone")
    parser.add_argument(
        "--pace-rule",
        choices=PACE_RULES,
        default=DEFAULT_PACE_RULE,
        help="the staleness plugin's pace rule in the decoupled modes (default %(default)s: see below)",
    )
    parser.add_argument(
        "--ppo-anchor",
        choices=ANCHORS,
        default="proximal",
        help="the CPU trainer's PPO anchor (default %(default)s: decoupled PPO; behaviour: clip around the policy "
        "that sampled each token)",
    )
    parser.add_argument(
        "--modes", default="0,1,2", help="the pace K of the modes to run, of 0 (coupled), 1, 2 (default %(default)s)"
    )
    parser.add_argument("--quick", action="store_true", help="1 seed, 6 steps: that it runs, not what it shows")
    parser.add_argument("--out", type=Path, default=None, help="write the results into this markdown file")
    parser.add_argument(
        "--runs-file",
        type=Path,
        default=None,
        help="append each finished run to this JSON-lines file, and take the runs it already holds (same steps, "
        "latency and placement) instead of running them again: an interrupted benchmark resumes",
    )
    args = parser.parse_args(argv)
    args.argv = argv
    chosen = {int(k) for k in args.modes.split(",")}
    args.modes = [mode for mode, k in MODES.items() if k in chosen]
    if not args.modes or chosen - set(MODES.values()):
        parser.error(f"--modes {','.join(map(str, sorted(chosen)))}: each of 0, 1, 2, at least one")
    args.seeds = args.seeds or (1 if args.quick else 3)
    args.steps = args.steps or (6 if args.quick else 30)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="bench-training-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        work.chmod(0o711)  # a root runtime's sandbox uids must traverse to its state dir inside
        try:
            runs, where = run_all(args, work)
        except RuntimeError as exc:  # a server that would not start (localstack)
            print(f"bench_training: {exc}", file=sys.stderr)
            return 1
    for workload in dict.fromkeys(r.workload for r in runs):
        print(f"\n{workload}\n{workload_table(runs, workload)}")
    if args.out:
        for workload in dict.fromkeys(r.workload for r in runs):
            plot(runs, workload, plot_path(workload))
        replace_section(args.out, BLOCK_START, BLOCK_END, render(runs, args, where))
        update_targets(args.out, targets(runs))
        print(f"\nwrote {args.out} and the plots in {PLOTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
