#!/usr/bin/env python3
"""Back-pressure between init and run (prorl_adapter/service/init_gate.py): what it buys with a large backlog.

    python bench/bench_backpressure.py [--jobs 1000] [--quick] [--rounds 2] [--run-workers 8] [--sleep-s 0.2]
                                       [--out docs/benchmarks.md]

Real parts, started as `make test` starts them (`prorl_adapter.dev.localstack`): the sandbox runtime with the bwrap
backend (as root here: a uid of its own per sandbox), two rollout services (`python -m prorl_adapter serve`, one per
mode, `--max-run-workers 8`, the other worker counts at their defaults) and, as the policy, the scripted LLM
stand-in (integration_tests/scripted_llm.py), NOT a model: every episode runs the same two turns, a bash call of
`sleep 0.2` (a tool that takes a little real time) and then `finish`. The model does not matter here: what is
measured is how the service schedules sandboxes, and a real model would only add noise on these two cores.

The workload: a backlog of `--jobs` episodes of the built-in `shell` task (check `true`) submitted at once (in
submissions of up to 250 samples each), waited for to the last one. Two modes, on the same runtime and stand-in, in
alternating order over `--rounds`:

- (a) no back-pressure: `--init-ahead 1000000`, the old behaviour: init makes a sandbox for every queued job as fast
  as its workers can, and they wait in the run queue (measured earlier: 292 of 300 alive 5 s after submission);
- (b) the init gate as it ships: `--init-ahead` left at its default (a quarter of the run limit, at least 1).

Measured per mode, by an asyncio task that polls every 0.2 s the runtime's `prorl_sandbox_active` gauge (GET
/metrics: the sandboxes it holds) and the service's GET /v1/status (`init_gate`: episodes in the run stage and
waiting for an eval worker; `finished`): peak and time-averaged live sandboxes, peak idle sandboxes (live minus
those in the run stage: being set up, waiting for a run slot, waiting for or in eval, being deleted), the live
count 5 s after submission, the run stage's mean occupancy and an episode's time in it, episodes/s over the whole
backlog (submission to the poll that sees the last episode finished), and CPU per episode of the runtime's server
process and of the service. The ratios are (b) ÷ (a), measured in the same run on the same machine:
this 2-core machine is shared and noisy, so compare ratios across runs rather than rates. Nothing is asserted;
tests/test_backpressure.py asserts the bound.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from common import (
    BENCH,
    CPUS_GIVEN,
    busy_cpu_seconds,
    command_line,
    cpu_seconds,
    machine,
    replace_section,
    stop,
    utc_now,
)

from prorl_adapter.dev import localstack
from prorl_adapter.dev.localstack import Service
from prorl_adapter.models import JobRequest
from prorl_adapter.trainer.client import RolloutClient

START, END = "<!-- bench_backpressure:start -->", "<!-- bench_backpressure:end -->"
MODES = ("baseline", "gate")
TITLES = {"baseline": "(a) no back-pressure", "gate": "(b) init gate (default)"}
BASELINE_AHEAD = 1_000_000
POLL_S = 0.2
CHUNK = 250  # samples per submission (num_samples allows 256)
WARM_UP_JOBS = 16
EARLY_S = 5.0  # the live count this long after submission, as the earlier measurement took it


@dataclass
class Sample:
    t: float  # seconds since submission began
    live: int  # sandboxes the runtime holds
    running: int  # episodes in the run stage
    waiting_for_eval: int

    @property
    def idle(self) -> int:
        return max(0, self.live - self.running)


@dataclass
class Run:
    mode: str
    jobs: int
    wall_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    bound: int = 0  # the gate's: run limit + margin
    margin: int = 0
    run_limit: int = 0
    eval_workers: int = 0
    failed: int = 0
    runtime_cpu_s: float = 0.0  # the runtime's server process alone
    service_cpu_s: float = 0.0
    busy_cores: float = 0.0  # the whole machine, mean over the run

    @property
    def episodes_per_s(self) -> float:
        return self.jobs / self.wall_s

    @property
    def peak_live(self) -> int:
        return max(s.live for s in self.samples)

    @property
    def peak_idle(self) -> int:
        return max(s.idle for s in self.samples)

    @property
    def peak_waiting_for_eval(self) -> int:
        return max(s.waiting_for_eval for s in self.samples)

    def time_mean(self, value: str) -> float:
        """A sampled value averaged over the run's wall time (each sample holds until the next)."""
        total = 0.0
        for now, after in zip(self.samples, self.samples[1:], strict=False):
            total += getattr(now, value) * (min(after.t, self.wall_s) - now.t)
        return total / self.wall_s

    @property
    def run_s_per_episode(self) -> float:
        """Mean time an episode spent in the run stage (Little's law: its mean occupancy over the throughput)."""
        return self.time_mean("running") / self.episodes_per_s

    def live_at(self, t: float) -> int:
        return next((s.live for s in self.samples if s.t >= t), self.samples[-1].live)


def episode() -> JobRequest:
    # A one-command policy: turn 1 is the script's bash call, turn 2 (past the script's end) a call of finish.
    instance = {"goal": "Run the command. [script:sleep]", "check": "true"}
    return JobRequest(task="shell", instance=instance, max_turns=2)


def live_sandboxes(metrics: str) -> int:
    for line in metrics.splitlines():
        if line.startswith("prorl_sandbox_active "):
            return int(float(line.split()[1]))
    raise RuntimeError("the runtime's /metrics has no prorl_sandbox_active")


async def settle(http: httpx.AsyncClient, runtime_url: str, timeout: float = 120.0) -> None:
    """Until the runtime holds no sandbox (the last run's deletes done)."""
    deadline = time.monotonic() + timeout
    while live_sandboxes((await http.get(runtime_url + "/metrics")).text) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)


async def measure(mode: str, tag: str, jobs: int, service: Service, runtime: Service) -> Run:
    run = Run(mode, jobs)
    async with httpx.AsyncClient(timeout=60) as http, RolloutClient(service.url, timeout=120) as client:
        await settle(http, runtime.url)
        status = await client.status()
        finished_before = sum(status.finished.values())
        gate = status.init_gate
        run.bound, run.margin, run.run_limit = gate.bound, gate.margin, status.run_concurrency.limit
        run.eval_workers = status.workers["eval"]
        started = time.monotonic()

        async def sampler() -> None:
            while True:
                metrics, answer = await asyncio.gather(http.get(runtime.url + "/metrics"), client.status())
                now = time.monotonic() - started
                state = answer.init_gate
                sample = Sample(now, live_sandboxes(metrics.text), state.running, state.waiting_for_eval)
                run.samples.append(sample)
                if sum(answer.finished.values()) - finished_before >= jobs:
                    run.wall_s = now
                    return
                await asyncio.sleep(POLL_S)

        own = cpu_seconds([runtime.process.pid]), cpu_seconds([service.process.pid])
        busy = busy_cpu_seconds()
        polling = asyncio.ensure_future(sampler())
        ids = []
        for first in range(0, jobs, CHUNK):
            count = min(CHUNK, jobs - first)
            request = episode().model_copy(update={"job_id": f"{tag}-{first}", "num_samples": count})
            submitted = await client.submit(request)
            ids += submitted.samples or [submitted.job_id]
        await polling  # until it sees the last episode finished
        run.runtime_cpu_s = cpu_seconds([runtime.process.pid]) - own[0]
        run.service_cpu_s = cpu_seconds([service.process.pid]) - own[1]
        run.busy_cores = (busy_cpu_seconds() - busy) / run.wall_s
        limit = asyncio.Semaphore(16)

        async def failed(job_id: str) -> bool:
            async with limit:
                trajectory = await client.result(job_id, wait=60)
            return trajectory.error is not None or trajectory.reward != 1.0

        run.failed = sum(await asyncio.gather(*(failed(job_id) for job_id in ids)))
    return run


def mean(runs: list[Run], value: str) -> float:
    return statistics.fmean(getattr(r, value) for r in runs)


def report(runs: dict[str, list[Run]], args: argparse.Namespace, argv: list[str]) -> str:
    base, gate = runs["baseline"], runs["gate"]
    figures = {
        mode: {
            "peak_live": max(r.peak_live for r in done),
            "mean_live": statistics.fmean(r.time_mean("live") for r in done),
            "peak_idle": max(r.peak_idle for r in done),
            "early": statistics.fmean(r.live_at(EARLY_S) for r in done),
            "running": statistics.fmean(r.time_mean("running") for r in done),
            "eps": mean(done, "episodes_per_s"),
            "runtime_ms": 1000 * statistics.fmean(r.runtime_cpu_s / r.jobs for r in done),
            "service_ms": 1000 * statistics.fmean(r.service_cpu_s / r.jobs for r in done),
            "run_s": statistics.fmean(r.run_s_per_episode for r in done),
        }
        for mode, done in runs.items()
    }
    a, b = figures["baseline"], figures["gate"]
    g = gate[0]
    promised = g.run_limit + g.margin + g.eval_workers

    def row(mode: str, ahead: str) -> str:
        f = figures[mode]
        return (
            f"| {TITLES[mode]} | {ahead} | {f['peak_live']:,} | {f['mean_live']:,.1f} | {f['peak_idle']:,} | "
            f"{f['early']:,.0f} | {f['running']:.1f} of {g.run_limit} | {f['run_s']:.3f} | {f['eps']:.2f} | "
            f"{f['runtime_ms']:.1f} | {f['service_ms']:.1f} | {sum(r.failed for r in runs[mode])} |"
        )

    def ratio(key: str) -> str:
        return f"{b[key] / a[key]:.3f}x" if a[key] else "—"

    per_round = "; ".join(
        f"{TITLES[mode]}: " + ", ".join(f"{r.episodes_per_s:.2f}" for r in runs[mode]) for mode in MODES
    )
    busy = "; ".join(f"{TITLES[mode]}: " + ", ".join(f"{r.busy_cores:.2f}" for r in runs[mode]) for mode in MODES)
    peaks = (
        f"Episodes run and waiting for an eval worker (holding their sandboxes) at most "
        f"{max(r.peak_waiting_for_eval for r in base):,} without the gate, {max(r.peak_waiting_for_eval for r in gate)}"
        " with it"
    )
    within = "within" if b["peak_live"] <= promised else "**over**"
    return (
        f"{START}\n## Back-pressure: a backlog with and without the init gate — {utc_now()}\n\n"
        f"`{command_line(__file__, argv)}` on {machine(bubblewrap=True)}; the sandbox runtime (bwrap, as root), "
        "two rollout services (one per mode), and the scripted LLM stand-in as the policy (not a model: the "
        "question is scheduling).\n\n"
        f"A backlog of {args.jobs:,} `shell` episodes submitted at once, each two turns (a bash call of "
        f"`sleep {args.sleep_s:g}`, then `finish`); `--max-run-workers {args.run_workers}`, init and eval workers "
        f"{g.eval_workers} each (the defaults); {args.rounds} round(s) in alternating order. Peaks are the highest of "
        "the rounds, the rest means of the rounds; live sandboxes are the runtime's own count, polled every "
        f"{POLL_S:g} s.\n\n"
        "| mode | --init-ahead | peak live sandboxes | mean live | peak idle | live 5 s after submission | "
        "run stage occupied (mean) | s in the run stage per episode | episodes/s | runtime CPU ms/episode | "
        "service CPU ms/episode | failed |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        + row("baseline", f"{BASELINE_AHEAD:,}")
        + "\n"
        + row("gate", f"{g.margin} (default; bound {g.bound})")
        + "\n"
        + f"| (b) ÷ (a) | | {ratio('peak_live')} | {ratio('mean_live')} | {ratio('peak_idle')} | {ratio('early')} | "
        f"{ratio('running')} | "
        f"{ratio('run_s')} | **{ratio('eps')}** | {ratio('runtime_ms')} | {ratio('service_ms')} | |\n\n"
        f"With the gate the runtime held at most **{b['peak_live']:,}** sandboxes against **{a['peak_live']:,}** "
        f"without it, {within} the promised run limit + `--init-ahead` + eval workers ({g.run_limit} + {g.margin} "
        f"+ {g.eval_workers} = {promised}), at **{b['eps'] / a['eps']:.2f}x** the episodes/s. {peaks}. Episodes/s "
        f"per round: {per_round}. Machine busy (cores of {CPUS_GIVEN}, everything on it, other tenants "
        f"included): {busy}.\n\n"
        "**How to read this.** *Idle* is live minus the episodes in the run stage, sampled together: sandboxes being "
        "set up, waiting for a run slot, waiting for or in eval, or being deleted. *Run stage occupied* is the mean "
        "of the episodes in it over the run: below the limit, the run stage waited for init; *s in the run stage per "
        "episode* is that occupancy over the episodes/s (Little's law): the episode's own two LLM calls and its "
        f"`sleep {args.sleep_s:g}`, plus whatever slowed the parts serving them. Episodes/s counts the whole backlog, "
        "from the first submission to the first poll that saw the last episode finished. CPU per episode is the "
        "runtime's server process alone (creating, exec, deleting: a delete scans every process on the host for the "
        "sandbox's uid, so it costs more the more sandboxes are alive) and the service's, from /proc.\n"
        f"{END}\n"
    )


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1000, help="the backlog, submitted at once (default 1000)")
    parser.add_argument("--quick", action="store_true", help="a backlog of 200 (unless --jobs says otherwise)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--run-workers", type=int, default=8, help="the services' --max-run-workers")
    parser.add_argument("--sleep-s", type=float, default=0.2, help="what the episode's bash call sleeps")
    parser.add_argument("--out", type=Path, help="write the section into this file (e.g. docs/benchmarks.md)")
    args = parser.parse_args(argv)
    if args.quick and "--jobs" not in argv:
        args.jobs = 200
    # The stand-in runs as `python -m integration_tests.scripted_llm`: the checkout must be importable from it.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH.parent), os.environ.get("PYTHONPATH")]))
    from integration_tests import scripted_llm

    runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
    started: list[Service] = []
    with tempfile.TemporaryDirectory(prefix="bench-backpressure-") as work_dir:
        work = Path(work_dir)
        work.chmod(0o711)  # the sandboxes' uids must traverse it to their state dir (the runtime checks)
        try:
            started.append(scripted_llm.start({"sleep": [scripted_llm.bash_call(f"sleep {args.sleep_s:g}")]}, work))
            llm = started[-1]
            runtime = localstack.start_sandbox_runtime(
                work / "sandbox-state",
                "bwrap",
                "--max-sandboxes",
                str(args.jobs + 256),
                *localstack.agent_env_args(),
                log=work / "sandbox.log",
            )
            started.append(runtime)
            services = {}
            for mode in MODES:
                extra = ("--init-ahead", str(BASELINE_AHEAD)) if mode == "baseline" else ()
                services[mode] = localstack.start_rollout_service(
                    [runtime.url],
                    [llm.url],
                    "--max-run-workers",
                    str(args.run_workers),
                    *extra,
                    log=work / f"{mode}-service.log",
                )
                started.append(services[mode])
            for mode in MODES:  # each service's first episodes (tokenizer, connections) untimed
                await measure(mode, f"warm-{mode}", WARM_UP_JOBS, services[mode], runtime)
            for round_ in range(args.rounds):
                for mode in MODES if round_ % 2 == 0 else tuple(reversed(MODES)):
                    run = await measure(mode, f"{mode}-{round_}", args.jobs, services[mode], runtime)
                    runs[mode].append(run)
                    print(
                        f"round {round_ + 1} {mode}: {run.episodes_per_s:.2f} episodes/s, peak live {run.peak_live}, "
                        f"mean live {run.time_mean('live'):.1f}, peak idle {run.peak_idle}, {run.failed} failed",
                        flush=True,
                    )
        finally:
            for service in reversed(started):
                stop(service, timeout=60)
    block = report(runs, args, argv)
    print(block)
    if args.out is not None:
        replace_section(args.out, START, END, block)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
