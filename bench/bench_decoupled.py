#!/usr/bin/env python3
"""Coupled vs decoupled training, simulated: how busy the trainer is, how many episodes it gets through, and
how stale (and how biased) the data it trains on is.

    python bench/bench_decoupled.py [--quick] [--steps N] [--seed S] [--out docs/benchmarks.md]

What is REAL: the decoupled machinery itself. `prorl_adapter.service.decoupled.Producer` (admission through
the `prorl_admit_episode` hook, finished trajectories put into the buffer, `take_batch` weighing each trajectory
through `prorl_trajectory_weight` and dropping weight 0), a real `MemoryBuffer` (its newest-version-first
order, pending until acknowledged), and the staleness plugin (`prorl_plugins.staleness.StalenessControl`,
created with its `staleness` section) in a real `PluginSet`, with the Producer registered as a plugin the way
the server registers it, so that a finished job reaches it and a new policy version wakes it.

What is SIMULATED: everything slow.
- `SimulatedPipeline` is the simulation's stand-in for `RolloutPipeline`, which needs vLLM and sandboxes. It
  has the small surface the Producer uses (`submit`, `jobs`, `plugins`, `policy_version` with its hook on
  change, and `prorl_job_finished` when a job ends) and runs each job on one of `slots` generation slots (the
  generation capacity: concurrent episodes the LLM servers and sandboxes sustain), FIFO, for the job's drawn
  duration, then finishes it with a `Trajectory` whose `policy_version_min` is the version when the episode
  got its slot (its first turn). Slots do not slow down when many are busy (no batching effects in the LLM
  server).
- The trainer takes B trajectories (taking more when some are dropped, so every step trains on B), trains
  for T seconds, publishes version + 1, then acknowledges (the order `should_pace` assumes, and the order of
  integration_tests/test_decoupled.py). Its prompt loader (`feed`) keeps (K_max + 1) x B + slots prompts
  upcoming or in flight, from one seeded stream, the same in every mode: in effect an endless supply, so only
  admission control limits how far generation runs ahead (drop and linear have none: their slots never idle).
- Time is virtual. The asyncio loop (`VirtualTimeLoop`) reads a virtual clock, and its selector, instead of
  sleeping until the next timer, advances the clock to it. Every `asyncio.sleep` (episode durations, the
  trainer's step) therefore takes no real time, while the Producer, the buffer and pluggy run their real
  code in their real order. This is exact and deterministic (no real I/O, so a seed fixes the whole run),
  unlike sleeping scaled-down real time, whose scheduling jitter on a noisy 2-core machine would blur the
  short gaps that admission control decides on. A state where nothing is runnable and no timer is set is a
  deadlock: the loop raises instead of hanging.

Episode durations (`draw_episodes`), the skew of agent rollouts: turns ~ lognormal(median 4, sigma 0.8),
1-40 (most tasks take a few turns, a tail of long multi-turn ones); per turn a generation of lognormal(median
5 s, sigma 0.5) (a few hundred tokens at 50-100 tokens/s per sequence on a loaded server, plus prefill of the
growing context) and a tool call of lognormal(median 1.5 s, sigma 1.2) (sub-second shell commands, tens of
seconds for test suites, builds and installs); plus init and eval (sandbox, scoring) of lognormal(median
3 s, sigma 0.5). That gives a mean near 50 s and a p99 several times the median, the long tail that
dominates a lock-step batch. "Tail" episodes are those above the stream's 90th percentile.

Modes, each on the same stream: (a) coupled: each step submits B episodes, waits for all (the slowest
dominates), trains T while generation idles; (b) decoupled, pace by the `any-take` rule, K = 0 (a check: it
must reproduce (a)), K = 1, K = 2, and K = 4, 8 (how much slack pacing needs under this tail); (c) drop K = 2;
(d) linear K = 4 (weights 1, .75, .5, .25, dropped from s = 4); (e) pace with `pace_rule: deadline-take` (the
plugin's default), K = 1, 2, 3, 4: up
to (K + 1) x B pending whatever their age, and the Producer's own deadline take (the plugin answers
`prorl_take_demands`, so `take_batch` serves the oldest version first and waits until the batch holds every
episode at its limit and enough of each level that the later takes can: `deadline_demands`). Every pace run
checks that no trajectory was trained with staleness > K.

Settings: balanced (T = B x mean duration / slots: generation capacity = the trainer's appetite), the main
table; then, trainer busy fraction only: training-bound (2 T), generation-bound (T / 2), and T chosen so that
coupled is exactly at each anchor's starting point (45%, 42%), to compare with the anchors from the same
start.

Reported per mode: trainer busy fraction (steps x T / wall time), generation-slot busy fraction, episodes/s
trained and produced, the staleness histogram of trained trajectories (and its max, and the max of the
dropped ones), mean sample weight, the share of tail episodes among those started vs those trained, dropped
count and the share of generation time they wasted, trajectories left unconsumed in the buffer at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import random
import selectors
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import TargetResult, command_line, machine, replace_section, update_targets, utc_now

from prorl_adapter.hooks import PluginSet, hookimpl
from prorl_adapter.models import JobRequest, Trajectory
from prorl_adapter.service.decoupled import Producer, ProducerConfig
from prorl_adapter.service.storage.coordination import MemoryCoordination
from prorl_adapter.service.storage.memory_buffer import MemoryBuffer
from prorl_adapter.testing import SimJob, SimulatedRunner, sim_trajectory
from prorl_plugins.staleness import StalenessControl

BLOCK_START = "<!-- bench_decoupled:start -->"
BLOCK_END = "<!-- bench_decoupled:end -->"

SLOTS = 64  # concurrent episodes the generation side sustains
BATCH = 64  # trajectories per trainer step (B); coupled runs one batch on all slots at once
TAIL_QUANTILE = 0.9
FEED_EVERY_S = 5.0  # how often (virtual seconds) the trainer's loader tops up the upcoming prompts
ANCHORS = (("the seed article", 0.45, 0.82), ("the paper's ablation", 0.42, 0.78))
ADMISSION_QUEUES = (1_000, 10_000, 40_000)  # prompts handed over at once, for the admission-cost table


# -- virtual time ---------------------------------------------------------------------------------------
class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; where the loop would sleep until its next timer, advances the clock to it."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            raise RuntimeError("simulation deadlock: nothing is runnable and no timer is set")
        self.clock.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(_JumpingSelector(clock))
        self.clock = clock

    def time(self) -> float:
        return self.clock.now


def run_virtual(make_coro: Any) -> Any:
    """Run `make_coro(clock)` to completion on a fresh virtual-time loop."""
    clock = VirtualClock()
    loop = VirtualTimeLoop(clock)
    try:
        return loop.run_until_complete(make_coro(clock))
    finally:
        loop.close()


# -- the episodes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stream:
    durations: list[float]
    tail_threshold: float

    def is_tail(self, index: int) -> bool:
        return self.durations[index] > self.tail_threshold


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(median), sigma)


def draw_episodes(n: int, seed: int) -> Stream:
    """Seeded episode durations in seconds (the model: the module docstring)."""
    rng = random.Random(seed)
    durations = []
    for _ in range(n):
        turns = min(40, max(1, round(_lognormal(rng, 4.0, 0.8))))
        per_turn = sum(_lognormal(rng, 5.0, 0.5) + _lognormal(rng, 1.5, 1.2) for _ in range(turns))
        durations.append(per_turn + _lognormal(rng, 3.0, 0.5))
    return Stream(durations, quantile(durations, TAIL_QUANTILE))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the simulated job runner in place of RolloutPipeline ------------------------------------------------
class SimulatedPipeline(SimulatedRunner):
    """The simulation's job runner (`RolloutPipeline` needs vLLM and sandboxes): `slots` workers run jobs FIFO,
    each for its drawn duration, and finish it with a trajectory tagged with the policy version at which it got
    its slot."""

    def __init__(
        self, plugins: PluginSet, stream: Stream, slots: int, coordination: MemoryCoordination | None = None
    ) -> None:
        super().__init__(plugins, coordination=coordination)
        self.stream = stream
        self._queue: asyncio.Queue[SimJob] = asyncio.Queue()
        self._workers = [asyncio.ensure_future(self._slot()) for _ in range(slots)]
        self.runs: list[tuple[int, float, float]] = []  # (episode index, start, end) of every started episode

    def _started(self, job: SimJob) -> None:
        self._queue.put_nowait(job)

    async def _slot(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            job = await self._queue.get()
            version, start = self.policy_version, loop.time()
            duration = self.stream.durations[episode(job)]
            self.runs.append((episode(job), start, start + duration))
            await asyncio.sleep(duration)
            self.end(job, sim_trajectory(job, version, self.policy_version))

    async def stop(self) -> None:
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)


def episode(job: SimJob) -> int:
    """The episode's index in the stream (its label): the order prompts are admitted in may differ."""
    return int(job.request.labels["episode"])


def requests(start: int, stop: int) -> list[JobRequest]:
    return [JobRequest(job_id=f"e{i}", task="sim", labels={"episode": str(i)}) for i in range(start, stop)]


def prompts_ahead(setting: Setting) -> int:
    """More than pace with the largest K ever keeps pending ((K + 1) x B), plus a slot's worth of margin."""
    largest_k = max(m.staleness["max_staleness"] for m in MODES if m.staleness)
    return (largest_k + 1) * setting.batch + setting.slots


async def feed(producer: Producer, total: int, ahead: int) -> None:
    """The trainer's prompt loader: every FEED_EVERY_S it tops the prompts up so that at least `ahead` are
    upcoming or in flight. Prompts go in stream order, so every mode sees the same episodes in the same order.

    `ahead` (`prompts_ahead`) is large enough to act as an endless supply: pace never finds the upcoming queue
    empty when it would admit, and with drop or linear (which submit every prompt at once) the pipeline's queue
    never runs dry between two top-ups."""
    sent = 0
    while True:
        stats = await producer.snapshot()
        want = min(total, sent + max(0, ahead - stats.upcoming - stats.in_flight))
        if want > sent:
            await producer.enqueue(requests(sent, want))
            sent = want
        await asyncio.sleep(FEED_EVERY_S)


class RecordingBuffer(MemoryBuffer):
    """The real MemoryBuffer, noting which episodes went into it (to tell which ones expired there)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.episodes_put: list[int] = []

    async def put(self, trajectory: Trajectory) -> str:
        entry_id = await super().put(trajectory)
        self.episodes_put.append(int(trajectory.labels["episode"]))
        return entry_id


class WeighObserver:
    """A plugin with no opinion that records every weighing: (episode index, staleness)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    @hookimpl
    def prorl_trajectory_weight(self, trajectory: Trajectory, current_version: int) -> None:
        self.seen.append((int(trajectory.labels["episode"]), current_version - trajectory.policy_version_min))


# -- the runs ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    name: str
    train_s: float  # T
    steps: int
    batch: int = BATCH
    slots: int = SLOTS


@dataclass(frozen=True)
class Mode:
    name: str
    staleness: dict[str, Any] | None  # None: coupled


ANY_TAKE = {"mode": "pace", "pace_rule": "any-take"}
MODES = [
    Mode("coupled (lock-step)", None),
    # "pace" is the any-take rule, named: deadline-take is the plugin's default and has rows of its own below.
    *(
        Mode(f"pace K={k}" + (" (check: = coupled)" if k == 0 else ""), {**ANY_TAKE, "max_staleness": k})
        for k in (0, 1, 2, 4, 8)
    ),
    Mode("drop K=2", {"mode": "drop", "max_staleness": 2}),
    Mode("linear K=4", {"mode": "linear", "max_staleness": 4}),
    *(
        Mode(f"pace deadline K={k}", {"mode": "pace", "max_staleness": k, "pace_rule": "deadline-take"})
        for k in (1, 2, 3, 4)
    ),
]


@dataclass
class RunResult:
    mode: str
    setting: Setting
    wall_s: float = 0.0
    trained: list[tuple[int, int, float]] = field(default_factory=list)  # (episode, staleness, weight)
    dropped: list[tuple[int, int]] = field(default_factory=list)  # (episode, staleness)
    produced: int = 0
    expired: int = 0  # too stale to weigh above 0: removed before a take
    expired_episodes: list[int] = field(default_factory=list)
    runs: list[tuple[int, float, float]] = field(default_factory=list)
    left_in_buffer: int = 0
    left_oldest_s: int = 0  # staleness of the oldest trajectory left in the buffer at the end
    real_s: float = 0.0

    @property
    def busy(self) -> float:
        return self.setting.steps * self.setting.train_s / self.wall_s

    def slot_busy(self) -> float:
        used = sum(max(0.0, min(end, self.wall_s) - start) for _, start, end in self.runs)
        return used / (self.setting.slots * self.wall_s)

    def wasted(self) -> float:
        """Share of generation time (within the run) spent on episodes that were dropped or expired."""
        ends = {i: (start, end) for i, start, end in self.runs}
        lost = sum(ends[i][1] - ends[i][0] for i in [*(i for i, _ in self.dropped), *self.expired_episodes])
        used = sum(max(0.0, min(end, self.wall_s) - start) for _, start, end in self.runs)
        return lost / used if used else 0.0


def pace_target(balanced: list[RunResult]) -> dict[str, TargetResult]:
    """The pace K=2 target, from the balanced setting: the better of pace's two rules, neither trained above K."""
    by = {r.mode: r for r in balanced}
    paces = [by[name] for name in ("pace K=2", "pace deadline K=2") if name in by]
    best = max(paces, key=lambda r: r.busy)
    oldest = max((s for r in paces for _, s, _ in r.trained), default=0)
    note = ", ".join(f"{r.mode} {pct(r.busy)}" for r in paces) + f"; oldest trained s = {oldest}"
    if best.busy < 0.6:
        note += f"; {100 * (0.6 - best.busy):.0f} points short of the target"
        note += (
            ": no rule that never drops can admit more than (K + 1) x B pending in any state, and the take waits "
            "only for what no later one may hold (proof: `staleness.deadline_demands`); what is left is the slowest "
            "episode of each version, which no rule that does not know durations can shorten"
        )
        if "pace deadline K=3" in by:
            note += f"; pace deadline K=3 {pct(by['pace deadline K=3'].busy)}"
    return {"pace K=2": TargetResult(pct(best.busy), best.busy >= 0.6 and oldest <= 2, note + "; bench_decoupled")}


async def run_coupled(clock: VirtualClock, stream: Stream, setting: Setting) -> RunResult:
    pipeline = SimulatedPipeline(PluginSet.load(entry_points=False), stream, setting.slots)
    result = RunResult("coupled", setting)
    pending = deque(requests(0, setting.steps * setting.batch))
    for step in range(setting.steps):
        jobs = [pipeline.submit(pending.popleft())[0] for _ in range(setting.batch)]
        await asyncio.gather(*(job.finished.wait() for job in jobs))
        result.trained += [(episode(job), 0, 1.0) for job in jobs]
        await asyncio.sleep(setting.train_s)
        await pipeline.new_version(step + 1)
    result.wall_s, result.produced, result.runs = clock(), len(result.trained), pipeline.runs
    await pipeline.stop()
    return result


async def run_decoupled(clock: VirtualClock, stream: Stream, setting: Setting, mode: Mode) -> RunResult:
    section = dict(mode.staleness or {}, batch_size=setting.batch)
    observer = WeighObserver()
    control = StalenessControl(section)
    plugins = PluginSet.load(objects=[control, observer], entry_points=False)
    pipeline = SimulatedPipeline(plugins, stream, setting.slots)
    buffer = RecordingBuffer(clock=clock)
    producer = Producer(pipeline, buffer, coordination=pipeline.coordination)
    plugins.register(producer, name="decoupled-producer")
    producer.start()
    loader = asyncio.ensure_future(feed(producer, len(stream.durations), prompts_ahead(setting)))
    result = RunResult(mode.name, setting)
    for step in range(setting.steps):
        batch = []
        while len(batch) < setting.batch:
            batch += await producer.take_batch(setting.batch - len(batch), timeout=None)
        result.trained += [
            (int(w.trajectory.labels["episode"]), step - w.trajectory.policy_version_min, w.weight.sample)
            for w in batch
        ]
        await asyncio.sleep(setting.train_s)
        await pipeline.new_version(step + 1)
        await producer.ack([w.id for w in batch])
    result.wall_s, result.runs = clock(), pipeline.runs
    kept = {i for i, _, _ in result.trained}
    result.dropped = [(i, s) for i, s in observer.seen if i not in kept]
    stats = await producer.snapshot()
    result.produced = stats.produced
    result.expired = stats.expired
    result.left_in_buffer = (await producer.buffer.stats()).ready
    result.left_oldest_s = setting.steps - min(await producer.buffer.buffered_versions(), default=setting.steps)
    assert stats.dropped == len(result.dropped), (stats.dropped, len(result.dropped))
    if section.get("mode") == "pace":  # pace's guarantee, checked on every trained trajectory
        worst = max(s for _, s, _ in result.trained)
        assert worst <= section["max_staleness"], f"{mode.name}: a trajectory trained with staleness {worst}"
    # Which episodes expired: delivered to the buffer, yet neither trained, dropped nor left in it at the end.
    left = {int(e.trajectory.labels["episode"]) for e in await producer.buffer.take(10**9, timeout=0)}
    delivered = set(producer.buffer.episodes_put)
    result.expired_episodes = sorted(delivered - kept - {i for i, _ in result.dropped} - left)
    assert len(result.expired_episodes) == stats.expired, (len(result.expired_episodes), stats.expired)
    loader.cancel()
    await producer.stop()
    await pipeline.stop()
    return result


def run_mode(stream: Stream, setting: Setting, mode: Mode) -> RunResult:
    started = time.perf_counter()
    if mode.staleness is None:
        result = run_virtual(lambda clock: run_coupled(clock, stream, setting))
    else:
        result = run_virtual(lambda clock: run_decoupled(clock, stream, setting, mode))
    result.mode = mode.name
    result.real_s = time.perf_counter() - started
    return result


def run_setting(stream: Stream, setting: Setting) -> list[RunResult]:
    results = []
    for mode in MODES:
        results.append(run_mode(stream, setting, mode))
        r = results[-1]
        print(f"  {setting.name:<22} {mode.name:<28} busy {r.busy:6.1%}  ({r.real_s:.1f} s real)", file=sys.stderr)
    return results


# -- the report -------------------------------------------------------------------------------------------
def pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.1 or x == 0 else f"{100 * x:.1f}%"


def histogram(values: list[int]) -> str:
    if not values:
        return "—"
    counts = Counter(values)
    return " · ".join(f"{s}: {pct(counts[s] / len(values))}" for s in range(max(values) + 1) if counts[s])


def tail_share(stream: Stream, episodes: list[int]) -> float:
    return sum(stream.is_tail(i) for i in episodes) / len(episodes) if episodes else 0.0


def main_table(stream: Stream, results: list[RunResult]) -> str:
    head = (
        "| Mode | Trainer busy | Gen. slots busy | Trained ep/s | Produced ep/s | Staleness of trained (s: share) "
        "| Max s trained / dropped | Mean weight | Tail share started → trained | Dropped + expired (gen. time wasted) "
        "| Left in buffer |\n|" + "---|" * 11
    )
    rows = []
    for r in results:
        stale = [s for _, s, _ in r.trained]
        max_dropped = max((s for _, s in r.dropped), default=None)
        started = [i for i, start, _ in r.runs if start < r.wall_s]
        rows.append(
            f"| {r.mode} | **{pct(r.busy)}** | {pct(r.slot_busy())} | {len(r.trained) / r.wall_s:.3f} "
            f"| {r.produced / r.wall_s:.3f} | {histogram(stale)} | {max(stale)} / "
            f"{'—' if max_dropped is None else max_dropped} | {sum(w for *_, w in r.trained) / len(r.trained):.2f} "
            f"| {pct(tail_share(stream, started))} → {pct(tail_share(stream, [i for i, *_ in r.trained]))} "
            f"| {len(r.dropped)} + {r.expired} ({pct(r.wasted())}) | {r.left_in_buffer} (oldest s {r.left_oldest_s}) |"
        )
    return head + "\n" + "\n".join(rows)


def sweep_table(sweeps: list[list[RunResult]]) -> str:
    """Busy fraction per setting and mode. Where generation outruns the trainer, drop and linear overproduce;
    what grows too stale to weigh above 0 is expired before each take."""
    names = [r.mode for r in sweeps[0]]
    head = "| Setting | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 1)
    rows = []
    for results in sweeps:
        s = results[0].setting
        cells = []
        for r in results:
            stale = max(x for _, x, _ in r.trained)
            extra = f", {len(r.dropped)} dropped" if r.dropped else ""
            extra += f", {r.expired:,} expired" if r.expired else ""
            if r.left_oldest_s > stale:  # left behind, staler than anything trained: starved, not in progress
                extra += f", {r.left_in_buffer:,} never taken, oldest s {r.left_oldest_s}"
            cells.append(f"{pct(r.busy)} (max s {stale}{extra})")
        rows.append(f"| {s.name}, T = {s.train_s:.0f} s | " + " | ".join(cells) + " |")
    return head + "\n" + "\n".join(rows)


def stream_summary(stream: Stream) -> str:
    d = stream.durations
    return (
        f"{len(d):,} episodes, mean {sum(d) / len(d):.1f} s, median {quantile(d, 0.5):.1f} s, "
        f"p90 {stream.tail_threshold:.1f} s (the tail threshold), p99 {quantile(d, 0.99):.1f} s, max {max(d):.0f} s"
    )


def _against(results: list[RunResult], after: float) -> str:
    coupled = results[0].busy
    beat = [f"{r.mode} {pct(r.busy)} ({r.busy / coupled:.1f}x)" for r in results[2:] if r.busy > after]
    below = [f"{r.mode} {pct(r.busy)}" for r in results[2:] if r.busy <= after]
    return (
        f"coupled {pct(coupled)}; above {pct(after)}: {', '.join(beat) or 'none'}; "
        f"not above: {', '.join(below) or 'none'}"
    )


def verdict(sweeps: list[list[RunResult]]) -> list[str]:
    """Per anchor: the setting whose coupled busy fraction equals the anchor's, and the balanced setting."""
    lines = []
    for name, before, after in ANCHORS:
        matched = next(r for r in sweeps if r[0].setting.name.startswith(f"coupled at {pct(before)}"))
        t, balanced_t = matched[0].setting.train_s, sweeps[0][0].setting.train_s
        lines.append(
            f"**{name[0].upper() + name[1:]}, {pct(before)} → {pct(after)}.** T = {t:.0f} s, where coupled is "
            f"{pct(before)} here too (so generation capacity is {t / balanced_t:.1f}x the trainer's appetite): "
            f"{_against(matched, after)}. Balanced (T = {balanced_t:.0f} s): {_against(sweeps[0], after)}."
        )
    return lines


def takeaways(stream: Stream, main: list[RunResult], bound: list[RunResult]) -> list[str]:
    """A few computed sentences; `bound` is the training-bound setting's results."""
    by = {r.mode.split(" (")[0]: r for r in main}
    coupled, check, drop, linear = by["coupled"], by["pace K=0"], by["drop K=2"], by["linear K=4"]
    paces = [r for r in main if r.mode.startswith("pace K=") and r is not check]

    def tails(r: RunResult) -> str:
        started = [i for i, start, _ in r.runs if start < r.wall_s]
        return f"{pct(tail_share(stream, started))} → {pct(tail_share(stream, [i for i, *_ in r.trained]))}"

    wait = lockstep_s(stream, coupled.setting.steps)
    same = "matches" if abs(check.busy - coupled.busy) < 0.005 else "does NOT match"
    return [
        f"Self-check: pace K=0 ({pct(check.busy)}) {same} coupled ({pct(coupled.busy)}).",
        f"Drop and linear keep the trainer busy ({pct(drop.busy)}, {pct(linear.busy)}) because their slots never "
        f"idle, but drop trains on the tail episodes at a fraction of their share (started → trained "
        f"{tails(drop)}) and throws away {pct(drop.wasted())} of the generation time; linear keeps more of the "
        f"tail ({tails(linear)}) at a mean weight of {sum(w for *_, w in linear.trained) / len(linear.trained):.2f}.",
        "Pace keeps every trajectory and the tail's share, but its busy fraction grows only slowly with K ("
        + ", ".join(f"{r.mode.removeprefix('pace ')} {pct(r.busy)}" for r in paces)
        + "): while an episode admitted at version v is running, the rule allows only (v + K - c + 1) x B "
        "pending episodes (a taken batch counts until acknowledged), so as the trainer's version c nears v + K, "
        "new episodes wait and generation slots idle (busy "
        + ", ".join(f"{pct(r.slot_busy())}" for r in paces)
        + ") and the next batch starts almost lock-step. It catches up when K x T nears the time "
        f"a lock-step batch waits for its slowest episode ({wait:.0f} s here vs T = {coupled.setting.train_s:.0f} "
        "s): see the training-bound and anchor-matched rows.",
        _deadline(stream, main),
        _starvation(next(r for r in bound if r.mode == drop.mode)),
    ]


def _deadline(stream: Stream, main: list[RunResult]) -> str:
    by = {r.mode: r for r in main}
    runs = [(k, by[f"pace K={k}"], by[f"pace deadline K={k}"]) for k in (1, 2, 4)]

    def worst(r: RunResult) -> int:
        return max(s for _, s, _ in r.trained)

    def tails(r: RunResult) -> str:
        started = [i for i, start, _ in r.runs if start < r.wall_s]
        return f"{pct(tail_share(stream, started))} → {pct(tail_share(stream, [i for i, *_ in r.trained]))}"

    return (
        "Pace by the `deadline-take` rule (up to (K + 1) x B pending whatever their age; the take serves the "
        "oldest version first and waits only for what the later takes could not hold), against `any-take`: "
        "trainer busy "
        + ", ".join(f"K={k} {pct(new.busy)} (was {pct(old.busy)})" for k, old, new in runs)
        + "; generation slots busy "
        + ", ".join(f"{pct(new.slot_busy())} (was {pct(old.slot_busy())})" for _, old, new in runs)
        + "; max staleness trained "
        + ", ".join(str(worst(new)) for *_, new in runs)
        + " (each pace run checks that none exceeds K), the price of the oldest first: trained at s = K "
        + ", ".join(pct(sum(s == k for _, s, _ in new.trained) / len(new.trained)) for k, _, new in runs)
        + " (with `any-take` "
        + ", ".join(pct(sum(s == k for _, s, _ in old.trained) / len(old.trained)) for k, old, _ in runs)
        + "); tail share started → trained "
        + ", ".join(tails(new) for *_, new in runs)
        + ". It needs a take that serves deadlines: the service's take does so when the plugin demands it "
        "(`prorl_take_demands`); with `any-take` it serves the newest version first and waits for "
        "nothing. " + _pace_limit(stream, by)
    )


def _pace_limit(stream: Stream, by: dict[str, RunResult]) -> str:
    """Why pace stops where it does (the proof: `prorl_plugins.staleness.deadline_demands`)."""
    k3 = by.get("pace deadline K=3")
    mean = sum(stream.durations) / len(stream.durations)
    return (
        "No rule that never drops can admit more: every pending episode must fit one of the next K + 1 takes, "
        "so (K + 1) x B pending is the limit in every state, not only in a worst case, and the take waits only "
        "for what no later take may hold. What is left is the slowest episode admitted at c - K, which the take "
        f"at c waits for: of the B = {BATCH} admitted at a version, the slowest is typically beyond the "
        f"stream's p98 ({quantile(stream.durations, 0.98):.0f} s), against 2 x T = {2 * BATCH * mean / SLOTS:.0f} s "
        "of training between an admission and its limit at K = 2"
        + (f"; with one more version of slack, pace deadline K=3 is at {pct(k3.busy)}." if k3 else ".")
    )


def _starvation(drop: RunResult) -> str:
    trained_max = max(s for _, s, _ in drop.trained)
    return (
        f"When training is the bottleneck ({drop.setting.name}), drop trained at most s = {trained_max}, dropped "
        f"{len(drop.dropped)} when taken and removed {drop.expired:,} before a take: the buffer serves the newest "
        "version first, so the surplus of a producer that nothing paces would pile up untaken; entries too stale "
        f"to weigh above 0 are expired instead. {drop.left_in_buffer:,} were left at the end, the oldest "
        f"{drop.left_oldest_s} versions old: the newest surplus, which the last takes did not need."
    )


HOW_TO_READ = """\
**How to read this.** *Trainer busy* is the share of (virtual) wall time the trainer spends in its T-second
steps; the rest it waits for a batch. *Gen. slots busy* is the share of slot-time running an episode. *Trained
ep/s* counts trajectories that reached the loss (weight > 0); *produced* counts every finished one (the
difference is dropped, or still in the buffer). *Staleness* s = the trainer's version when it took the
trajectory minus the version of the episode's first turn. *Tail share* compares the slowest 10% of the stream
among episodes started with their share among those trained: equal means no bias by length; lower means the
long (often the hard, multi-turn) tasks are under-represented in training. *Left in buffer* are finished
trajectories never taken when the run ends (and how stale the oldest is): the buffer serves the newest version
first, so stale ones wait behind fresh ones.

What the simulation captures: the real Producer, MemoryBuffer and staleness plugin (admission, ordering,
weighing, dropping, the wake-ups) under skewed episode durations on a fixed number of generation slots, and a
trainer whose step costs T regardless of the batch. What it does not: LLM-server batching (a slot here runs
at the same speed whether 1 or 64 are busy, so lock-step's idle slots cost nothing extra and decoupled
generation gets no speed-up from fuller batches), weight-sync time, GPU sharing between trainer and
generator (here they are separate resources), failures and retries, and the effect of staleness on learning
(linear's weights and drop's bias are reported, not their consequence). The anchors are measured on real
clusters with their own durations, T and B; the coupled figure here is set by E[slowest of B] / T, so the
comparison is of shape and direction, not a reproduction. Pace K=0 is a self-check: the decoupled machinery
with zero staleness must behave like lock-step (the same busy fraction).\
"""


async def admission_cost(queued: int) -> float:
    """Real seconds per admission when `queued` prompts are handed over at once and every one is admitted
    (staleness off): what the Producer pays per admission while the queue and the in-flight set are that long."""
    # Its jobs never finish: what admission alone costs, with nothing else running.
    pipeline = SimulatedRunner(PluginSet.load(objects=[StalenessControl({"mode": "off"})], entry_points=False))
    config = ProducerConfig(max_buffered=10 * queued)
    producer = Producer(pipeline, MemoryBuffer(), config=config, coordination=pipeline.coordination)
    await producer.enqueue(requests(0, queued))
    started = time.perf_counter()
    producer.start()
    while len(pipeline.jobs) < queued:
        await asyncio.sleep(0.001)
    seconds = time.perf_counter() - started
    await producer.stop()
    return seconds / queued


def admission_table() -> str:
    """Per-admission cost by queue length, with Python's cyclic garbage collector on (as the service runs) and
    off (the Producer's own work alone: the collector walks every live request, so it grows with the queue).
    The best of three runs each: the machine is shared and noisy."""
    costs = {n: min(asyncio.run(admission_cost(n)) for _ in range(3)) for n in ADMISSION_QUEUES}
    gc.disable()
    try:
        bare = {n: min(asyncio.run(admission_cost(n)) for _ in range(3)) for n in ADMISSION_QUEUES}
    finally:
        gc.enable()
    first = ADMISSION_QUEUES[0]
    rows = [
        f"| {n:,} | {costs[n] * 1e6:.1f} µs ({costs[n] / costs[first]:.2f}x) "
        f"| {bare[n] * 1e6:.1f} µs ({bare[n] / bare[first]:.2f}x) |"
        for n in ADMISSION_QUEUES
    ]
    head = "| Prompts queued (all admitted) | Per admission | The same, garbage collector off |\n|---|---|---|"
    return head + "\n" + "\n".join(rows)


def render_block(stream: Stream, main: list[RunResult], sweeps: list[list[RunResult]], args: Any) -> str:
    command = command_line(__file__, args.argv)
    s = main[0].setting
    verdicts = "\n".join(f"- {line}" for line in verdict(sweeps))
    takeaway_lines = "\n".join(f"- {line}" for line in takeaways(stream, main, sweeps[1]))
    admission = admission_table()
    return f"""{BLOCK_START}
## Decoupled training: coupled vs decoupled, simulated — {utc_now()}

- **Machine:** {machine()} (the results are virtual time: the machine only sets how long the run takes)
- **Command:** `{command}`
- **Parameters:** {s.slots} generation slots, B = {s.batch} trajectories per step, {s.steps} trainer steps
  per mode in the balanced setting and {sweeps[1][0].setting.steps} in the others, seed {args.seed}.
- **Episodes:** {stream_summary(stream)}. Turns lognormal (median 4, sigma 0.8, 1-40); per turn a
  generation lognormal (5 s, 0.5) and a tool call lognormal (1.5 s, 1.2); init + eval lognormal (3 s, 0.5).
- **Balanced setting:** T = B x mean duration / slots = {s.train_s:.0f} s, so the generation capacity
  (slots / mean duration) equals the trainer's appetite (B / T).
- **Modes:** coupled = each step submits B episodes, waits for the slowest, trains T while generation idles;
  decoupled = the real `Producer` + `MemoryBuffer` + staleness plugin (pace, drop, linear) over a stand-in
  pipeline on a virtual clock (the benchmark's docstring says what is real and what is simulated);
  pace = pace with `pace_rule: any-take` (admits against the finished trajectories whichever the trainer
  takes); pace deadline = pace with `pace_rule: deadline-take` (the plugin's default), through the Producer's
  own deadline take (the oldest version first, waiting until the batch meets `deadline_demands`), as the
  service runs it.

### Balanced setting (T = {s.train_s:.0f} s)

{main_table(stream, main)}

### Other settings: trainer busy fraction (max staleness trained, dropped)

{sweep_table(sweeps)}

### What it shows

{takeaway_lines}

### Admission cost against the queue's length

Admission control sees counts by policy version, so the Producer's own work per admission does not grow with
the queue (garbage collector off); with the collector on it grows slowly, since Python's collector walks every
live request. Measured in real time, the best of three runs. It used to sort every queued version per
admission: 6 s for 40,000, 150 µs each.

{admission}

### Against the anchors (trainer utilisation)

{verdicts}

{HOW_TO_READ}
{BLOCK_END}
"""


# -- main -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer trainer steps (40 instead of 300)")
    parser.add_argument("--steps", type=int, default=None, help="trainer steps per mode in the balanced setting")
    parser.add_argument("--seed", type=int, default=20240611, help="seed of the episode durations")
    parser.add_argument("--out", type=Path, default=None, help="write the results into this markdown file")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.steps is None:
        args.steps = 40 if args.quick else 300
    return args


def lockstep_s(stream: Stream, steps: int) -> float:
    """Mean time a lock-step batch waits for its slowest episode (B = slots, so all start at once)."""
    blocks = [stream.durations[i * BATCH : (i + 1) * BATCH] for i in range(steps)]
    return sum(max(block) for block in blocks) / steps


def settings(stream: Stream, steps: int) -> tuple[Setting, list[Setting]]:
    """The balanced setting, then the others: training-bound, generation-bound, and T chosen so that coupled
    starts where each anchor starts (busy = T / (lock-step wait + T))."""
    mean = sum(stream.durations) / len(stream.durations)
    balanced = round(BATCH * mean / SLOTS)
    sweep_steps = max(20, steps // 4)  # drop and linear get slow when they overproduce (see `sweep_table`)
    wait = lockstep_s(stream, sweep_steps)
    sweeps = [
        Setting("training-bound (2x T)", 2 * balanced, sweep_steps),
        Setting("generation-bound (T / 2)", balanced / 2, sweep_steps),
    ]
    for name, before, _ in ANCHORS:
        sweeps.append(Setting(f"coupled at {pct(before)} ({name})", before / (1 - before) * wait, sweep_steps))
    return Setting("balanced", balanced, steps), sweeps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # Enough prompts that no mode runs out: drop and linear start every prompt they are given.
    stream = draw_episodes(args.steps * BATCH * 4, args.seed)
    balanced, others = settings(stream, args.steps)
    print(f"episodes: {stream_summary(stream)}", file=sys.stderr)
    main_results = run_setting(stream, balanced)
    sweeps = [main_results, *(run_setting(stream, s) for s in others)]
    print(main_table(stream, main_results))
    print()
    print(sweep_table(sweeps))
    print()
    print("\n".join(verdict(sweeps)))
    print()
    print("\n".join(takeaways(stream, main_results, sweeps[1])))
    print()
    print(admission_table())
    if args.out is not None:
        replace_section(args.out, BLOCK_START, BLOCK_END, render_block(stream, main_results, sweeps, args))
        update_targets(args.out, pace_target(main_results))
        print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
