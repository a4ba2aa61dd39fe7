#!/usr/bin/env python3
"""Decoupled training with hundreds of rollout workers and a shared coordinator, simulated: what coordination
costs the trainer when every episode has to pass through one serial server, as it does through Redis.

    python bench/bench_scale_out_sim.py [--quick] [--steps N] [--redis-ms X] [--lock-ms Y] [--latency-ms Z]

bench/bench_scale_out.py runs this with the figures it measured (part (a), decoupled mode) and writes it in its
own section of docs/benchmarks.md; run alone, it uses the flags (or their defaults) and only prints. It builds
on bench/bench_decoupled.py (whose section it leaves alone) and reuses its parts: the virtual clock, the
episode durations, the stand-in pipeline and the trainer's prompt loader; what is REAL is the same: the
`Producer`, the `MemoryBuffer` and the staleness plugin, in their real order.

What is added: the coordination, as two serial servers (one request at a time, FIFO, as Redis runs commands
one at a time and as the admission lock admits one replica at a time):
- the *admission lock*: the Producer takes it (its real `coordination.admission_lock()` call) to admit, and
  each prompt it pops under it takes `lock` seconds, the time one admission takes under the shared lock on
  Redis (measured: the real Producer admitting into held jobs with its state in Redis, in
  bench_scale_out.py; it admits up to 32 per hold, so that figure includes a share of taking the lock);
- *Redis*: every finished episode, when the Producer puts its trajectory into the buffer, occupies it for
  `redis` seconds, Redis's own CPU per episode (measured: redis-server's CPU over a decoupled run divided by its
  episodes; it includes the admission's, put's, take's and ack's commands, so the lock's commands count twice:
  a conservative model);
- a *latency* per episode, not serial: the round trips on each episode's own path (measured: the difference of
  the latency p50 between the Redis and the memory arm, episodes run one at a time), added to every episode's
  duration.
Replicas do not appear: however many there are, they share the same lock and the same Redis, so one Producer
holding both models all of them; rollout workers are the stand-in pipeline's slots.

Settings: 100, 300 and 1,000 workers, B = workers trajectories per step, T balanced (B x mean episode / workers:
generation capacity = the trainer's appetite), modes pace K=2 and linear K=4 (as in bench_decoupled's table);
for each, the costs at 0 (the baseline), at the measured figures, and at 10x and 100x them (a stress, not a
prediction: Redis on another node behind a busy network, much larger trajectories, a slower client).

Reported: trainer busy fraction and episodes/s produced against the baseline with no coordination, each
coordinator's utilisation, and the coordination overhead per episode (time waiting for and held at the lock
and at Redis, plus the latency) as a fraction of the mean episode time, against the seeds' claim that
coordination overhead stays under 8%.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from bench_decoupled import (
    RecordingBuffer,
    Setting,
    SimulatedPipeline,
    Stream,
    VirtualClock,
    draw_episodes,
    feed,
    prompts_ahead,
    run_virtual,
)

from prorl_adapter.hooks import PluginSet
from prorl_adapter.service.decoupled import Producer
from prorl_adapter.service.storage.coordination import MemoryCoordination
from prorl_adapter.service.storage.prompts import MemoryPromptQueue
from prorl_plugins.staleness import StalenessControl

WORKERS = (100, 300, 1000)
MODES = (("pace K=2", {"mode": "pace", "max_staleness": 2}), ("linear K=4", {"mode": "linear", "max_staleness": 4}))
MULTIPLIERS = (0.0, 1.0, 10.0, 100.0)
SEED = 20240611
CLAIM = 0.08  # the seeds' claim: coordination overhead under 8%


@dataclass(frozen=True)
class SimInputs:
    """The coordination's costs per episode, in seconds (defaults: round figures of a loopback Redis)."""

    redis_s: float = 0.0005  # Redis's own time per episode (serial)
    lock_s: float = 0.002  # one admission under the shared lock (serial)
    latency_s: float = 0.005  # added to each episode's own time (not serial)
    measured: bool = False  # whether these are figures bench_scale_out.py measured in this run

    def times(self, k: float) -> SimInputs:
        return SimInputs(self.redis_s * k, self.lock_s * k, self.latency_s * k, self.measured)


class SerialServer:
    """One request at a time, FIFO (asyncio.Lock wakes its waiters in order), on the virtual clock."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.lock = asyncio.Lock()
        self.busy_s = 0.0
        self.waited_s = 0.0
        self.visits = 0

    @contextlib.asynccontextmanager
    async def hold(self, seconds: float) -> AsyncIterator[None]:
        asked = self.clock()
        async with self.lock:
            self.waited_s += self.clock() - asked
            if seconds > 0:
                await asyncio.sleep(seconds)
            yield
            self.busy_s += seconds
            self.visits += 1


class SerialAdmission(MemoryCoordination):
    """The one-process coordination with its admission lock a `SerialServer` (its waits are counted)."""

    def __init__(self, server: SerialServer) -> None:
        super().__init__("sim")
        self.server = server

    @contextlib.asynccontextmanager
    async def admission_lock(self) -> AsyncIterator[None]:
        async with self.server.hold(0.0):
            yield


class SlowPrompts(MemoryPromptQueue):
    """The real in-memory prompt queue; each pop (made under the admission lock) takes `lock_s`, so the lock is
    held that long per admission, however many one hold admits."""

    def __init__(self, server: SerialServer, lock_s: float) -> None:
        super().__init__()
        self.server, self.lock_s = server, lock_s
        self.admitted = 0

    async def pop(self, version: int, fence: Any = None) -> Any:
        if self.lock_s > 0:
            await asyncio.sleep(self.lock_s)
            self.server.busy_s += self.lock_s
        request = await super().pop(version, fence)
        self.admitted += request is not None
        return request


class CoordinatedBuffer(RecordingBuffer):
    """The real MemoryBuffer; each put first occupies Redis for `redis_s`."""

    def __init__(self, server: SerialServer, redis_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.server, self.redis_s = server, redis_s

    async def put(self, trajectory: Any) -> str:
        async with self.server.hold(self.redis_s):
            pass
        return await super().put(trajectory)


@dataclass
class SimResult:
    workers: int
    mode: str
    multiplier: float
    costs: SimInputs
    setting: Setting
    wall_s: float = 0.0
    trained: int = 0
    produced: int = 0
    lock_busy_s: float = 0.0
    lock_wait_s: float = 0.0
    admitted: int = 0
    redis_busy_s: float = 0.0
    redis_wait_s: float = 0.0
    redis_visits: int = 0
    mean_episode_s: float = 0.0
    real_s: float = 0.0

    @property
    def busy(self) -> float:
        return self.setting.steps * self.setting.train_s / self.wall_s

    @property
    def produced_per_s(self) -> float:
        return self.produced / self.wall_s

    def coordination_per_episode_s(self) -> float:
        """Lock (wait + hold) per admission + Redis (wait + service) per delivery + the latency."""
        lock = (self.lock_wait_s + self.lock_busy_s) / max(self.admitted, 1)
        redis = (self.redis_wait_s + self.redis_busy_s) / max(self.redis_visits, 1)
        return lock + redis + self.costs.latency_s

    def overhead(self) -> float:
        return self.coordination_per_episode_s() / self.mean_episode_s


async def run_one(
    clock: VirtualClock, stream: Stream, setting: Setting, staleness: dict, costs: SimInputs
) -> SimResult:
    section = dict(staleness, batch_size=setting.batch)
    plugins = PluginSet.load(objects=[StalenessControl(section)], entry_points=False)
    if costs.latency_s:
        stream = Stream([d + costs.latency_s for d in stream.durations], stream.tail_threshold + costs.latency_s)
    lock, redis = SerialServer(clock), SerialServer(clock)
    admission = SerialAdmission(lock)
    pipeline = SimulatedPipeline(plugins, stream, setting.slots, admission)
    buffer = CoordinatedBuffer(redis, costs.redis_s, clock=clock)
    prompts = SlowPrompts(lock, costs.lock_s)
    producer = Producer(pipeline, buffer, prompts=prompts, coordination=admission)
    plugins.register(producer, name="decoupled-producer")
    producer.start()
    loader = asyncio.ensure_future(feed(producer, len(stream.durations), prompts_ahead(setting)))
    result = SimResult(0, "", 0.0, costs, setting)
    for step in range(setting.steps):
        batch: list[Any] = []
        while len(batch) < setting.batch:
            batch += await producer.take_batch(setting.batch - len(batch), timeout=None)
        result.trained += sum(1 for item in batch if item.weight.sample > 0)
        await asyncio.sleep(setting.train_s)
        await pipeline.new_version(step + 1)
        await producer.ack([item.id for item in batch])
    result.wall_s = clock()
    result.produced = (await producer.snapshot()).produced
    result.lock_busy_s, result.lock_wait_s, result.admitted = lock.busy_s, lock.waited_s, prompts.admitted
    result.redis_busy_s, result.redis_wait_s, result.redis_visits = redis.busy_s, redis.waited_s, redis.visits
    durations = [end - start for _, start, end in pipeline.runs if end <= result.wall_s]
    result.mean_episode_s = sum(durations) / len(durations)
    loader.cancel()
    await producer.stop()
    await pipeline.stop()
    return result


@dataclass
class SimReport:
    inputs: SimInputs
    results: list[SimResult] = field(default_factory=list)
    stream_mean_s: float = 0.0
    steps: dict[int, int] = field(default_factory=dict)


def steps_for(workers: int, steps: int | None, quick: bool) -> int:
    """Trainer steps per run: fewer for more workers (each step is B = workers episodes)."""
    if steps is not None:
        return steps
    base = {100: 60, 300: 30, 1000: 20}.get(workers, 20)
    return max(8, base // 4) if quick else base


def run_sim(inputs: SimInputs, steps: int | None = None, quick: bool = False) -> SimReport:
    report = SimReport(inputs)
    for workers in WORKERS:
        n_steps = steps_for(workers, steps, quick)
        report.steps[workers] = n_steps
        stream = draw_episodes(n_steps * workers * 4, SEED)
        mean = sum(stream.durations) / len(stream.durations)
        report.stream_mean_s = mean
        setting = Setting(f"{workers} workers", round(mean), n_steps, batch=workers, slots=workers)
        for mode, staleness in MODES:
            for k in MULTIPLIERS:
                started = time.perf_counter()
                costs = inputs.times(k)
                r = run_virtual(lambda clock, s=setting, st=staleness, c=costs, e=stream: run_one(clock, e, s, st, c))
                r.workers, r.mode, r.multiplier, r.real_s = workers, mode, k, time.perf_counter() - started
                report.results.append(r)
                print(
                    f"  {workers:>5} workers {mode:<10} costs x{k:<5g} trainer busy {r.busy:6.1%}, produced "
                    f"{r.produced_per_s:7.2f} ep/s, overhead {r.overhead():7.3%} ({r.real_s:.1f} s real)",
                    file=sys.stderr,
                    flush=True,
                )
    return report


def pct(x: float) -> str:
    if x != x:  # nan
        return "—"
    return f"{100 * x:.0f}%" if abs(x) >= 0.1 else f"{100 * x:.1f}%" if abs(x) >= 0.001 else f"{100 * x:.3f}%"


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def sim_table(report: SimReport) -> str:
    head = (
        "| Workers (= B) | Mode | Costs | Trainer busy (÷ baseline) | Produced ep/s (÷ baseline) | Admission lock busy "
        "| Redis busy | Coordination per episode (wait + held + latency) | Share of the episode time "
        "| Trainer time lost |\n|" + "---|" * 10
    )
    rows = []
    for r in report.results:
        b = _base(report, r)
        costs = "none (baseline)" if r.multiplier == 0 else f"measured x{r.multiplier:g}"
        share, lost = r.overhead(), 1 - r.busy / b.busy
        rows.append(
            f"| {r.workers:,} | {r.mode} | {costs} | {pct(r.busy)} ({r.busy / b.busy:.3f}x) "
            f"| {r.produced_per_s:.2f} ({r.produced_per_s / b.produced_per_s:.3f}x) "
            f"| {pct(r.lock_busy_s / r.wall_s)} | {pct(r.redis_busy_s / r.wall_s)} "
            f"| {fmt_s(r.coordination_per_episode_s())} | **{pct(share)}** | **{pct(max(lost, 0.0))}** |"
        )
    return head + "\n" + "\n".join(rows)


def verdict(report: SimReport) -> list[str]:
    lines = []
    for k in MULTIPLIERS[1:]:
        rows = [r for r in report.results if r.multiplier == k]
        share = max(rows, key=lambda r: r.overhead())
        lost = max(rows, key=lambda r: 1 - r.busy / _base(report, r).busy)
        loss = max(0.0, 1 - lost.busy / _base(report, lost).busy)
        busiest = max(rows, key=lambda r: max(r.lock_busy_s, r.redis_busy_s) / r.wall_s)
        worst = max(share.overhead(), loss)
        head = "At the measured costs" if k == 1 else f"At {k:g}x the measured costs"
        lines.append(
            f"{head}: coordination takes at most {pct(share.overhead())} of an episode's time ({share.workers:,} "
            f"workers, {share.mode}) and costs the trainer at most {pct(loss)} of its busy time ({lost.workers:,} "
            f"workers, {lost.mode}), {'under' if worst < CLAIM else 'NOT under'} the seeds' {pct(CLAIM)}; the "
            f"busiest coordinator is {pct(max(busiest.lock_busy_s, busiest.redis_busy_s) / busiest.wall_s)} "
            f"utilised ({busiest.workers:,} workers, {busiest.mode})."
        )
    inputs = report.inputs
    admissions_per_s = 1 / inputs.lock_s if inputs.lock_s else float("inf")
    episodes_per_s = 1 / inputs.redis_s if inputs.redis_s else float("inf")
    lines.append(
        f"Where it would bind: one admission lock admits at most {admissions_per_s:,.0f} episodes/s and one Redis "
        f"serves at most {episodes_per_s:,.0f} episodes/s at these costs, against "
        f"{max(r.produced_per_s for r in report.results):.1f} episodes/s produced by the largest setting here "
        f"(1,000 workers, episodes of {report.stream_mean_s:.0f} s on average): the first to saturate would do so "
        f"at about {min(admissions_per_s, episodes_per_s) * report.stream_mean_s:,.0f} such workers."
    )
    return lines


def _base(report: SimReport, r: SimResult) -> SimResult:
    return next(b for b in report.results if (b.workers, b.mode, b.multiplier) == (r.workers, r.mode, 0.0))


def render_sim(report: SimReport) -> str:
    inputs = report.inputs
    where = "measured in (a) of this run" if inputs.measured else "defaults of bench_scale_out_sim.py (not measured)"
    steps = ", ".join(f"{w:,} workers {s}" for w, s in report.steps.items())
    verdicts = "\n".join(f"- {line}" for line in verdict(report))
    return f"""### (c) Hundreds of rollout workers, simulated: the coordination's share

The decoupled simulation of bench/bench_decoupled.py (real Producer, MemoryBuffer and staleness plugin on a
virtual clock) with a serial coordinator (bench/bench_scale_out_sim.py: its docstring says what is modelled).
Costs per episode ({where}): Redis {fmt_s(inputs.redis_s)} of serial time, the admission lock held
{fmt_s(inputs.lock_s)} per admission, {fmt_s(inputs.latency_s)} of latency on the episode's own path. Episodes
as in bench_decoupled (mean {report.stream_mean_s:.0f} s); B = workers, T balanced; trainer steps per run:
{steps}.

{sim_table(report)}

{verdicts}

*Share of the episode time* is the time one episode spends on coordination (waiting for and holding the
admission lock, waiting for and being served by Redis, and the added latency) divided by the mean episode
time; *trainer time lost* is 1 - the trainer's busy fraction ÷ the baseline's (no coordination at all): the
two ways coordination overhead can be read, each stated against the seeds' 8%. Both are small while the costs
are milliseconds against episodes of tens of seconds and the coordinators are far from saturation (their
utilisation columns), so there is almost no waiting; once a coordinator saturates (100x, 1,000 workers), the
episodes queue for it and the trainer starves, which the time share alone does not show (the wait for
admission is spent in the prompt queue).
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer trainer steps")
    parser.add_argument("--steps", type=int, default=None, help="trainer steps per run (default: by workers)")
    defaults = SimInputs()
    parser.add_argument("--redis-ms", type=float, default=defaults.redis_s * 1000, help="Redis time per episode")
    parser.add_argument("--lock-ms", type=float, default=defaults.lock_s * 1000, help="one admission under the lock")
    parser.add_argument("--latency-ms", type=float, default=defaults.latency_s * 1000, help="latency per episode")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    inputs = SimInputs(args.redis_ms / 1000, args.lock_ms / 1000, args.latency_ms / 1000)
    print(render_sim(run_sim(inputs, args.steps, args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
