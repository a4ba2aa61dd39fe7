#!/usr/bin/env python3
"""The cost of coordination: what the shared state in Redis adds to each episode, against the one-process
service (`memory://`), and how throughput behaves with 1 or 2 replicas and 1 or 2 registered runtimes.

    python bench/bench_scale_out.py [--quick] [--episodes 200] [--rounds 2] [--out docs/benchmarks.md]

Real processes, started the way integration_tests/test_scale_out.py starts them: redis-server (no
persistence), the rollout service (`python -m prorl_adapter serve`, no --sandbox-url: the runtimes register),
bwrap sandbox runtimes (`python -m sandbox_runtime serve --register URL`), and an LLM.

The LLM is a STAND-IN, not a model: an OpenAI-compatible /v1/completions server in this file
(`--_stand-in-llm`) whose every answer is the same tool call, `bash` with `pwd`, tokenised once with the tiny
model's tokenizer and returned with its token ids and zero logprobs, after an optional delay (set per phase
through its `PUT /_delay`). It is the same process for every arm, so what differs between arms is only the
service's state; it keeps the LLM's own CPU (vLLM on these 2 cores would dominate every figure) out of the
comparison. `--llm-url` uses a real OpenAI-compatible server instead (vLLM from scripts/serve-vllm.sh: the
requests carry the regex that makes the tiny model emit exactly that call); then the delay phases are skipped.

The episode: the built-in `shell` task, one turn (`pwd`), check `true`: create a sandbox, one generation, one
exec, one check, delete the sandbox. Short on purpose, so that coordination is as large a share of the episode
as it can be.

(a) Per-episode overhead of the shared state. Two services side by side, one with `--buffer memory://`, one
    with `--buffer redis://...` (its own Redis), one runtime registered with both, the same stand-in LLM. In
    each mode the same number of episodes run through each, alternating (memory, redis, redis, memory, ...):
    - coupled: a closed loop of C clients, each `POST /v1/jobs` then `GET /v1/jobs/{id}/result` (long-poll),
      then the next; latency = submit to result at the client;
    - decoupled: the trainer keeps C prompts outstanding (`POST /v1/prompts`), takes batches of B
      (`POST /v1/batches`), acknowledges each at once (`POST /v1/batches/ack`) and queues as many new prompts;
      latency = from its prompt's enqueue to the take that returned it;
    - both again one episode at a time (C = B = 1): the latency the shared state adds with no queueing.
    Reported: episodes/s, latency p50/p99, the service's CPU per episode and Redis's CPU per episode
    (schedstat of every thread of the process, ns; /proc/PID/stat utime+stime where the kernel lacks it), the
    commands Redis ran per episode (INFO commandstats, with Redis's own time in each), and the ratio
    redis ÷ memory. Idle CPU (what each process burns per second with nothing to do: heartbeats, BLMOVE
    timeouts) is measured before, for both, and is included in the per-episode figures; so is the CPU of
    other tenants in the whole-machine figure, whose share outside the benchmark's processes is shown.
    Also: the admission under the shared lock, timed alone (the Producer admitting prompts into a pipeline
    that holds them), memory vs Redis: the part of decoupled mode that every replica serialises on.
(b) Replicas and runtimes on one Redis: 1 or 2 replicas (all submitting and polling spread over them) and 1 or
    2 registered runtimes, in two regimes: *CPU-bound* (the stand-in answers at once: the 2 cores are the
    limit, so no configuration can be faster; what this shows is that adding a replica or a runtime costs
    little and does not serialise) and *latency-bound* (the stand-in answers after `--latency-ms`, and each
    replica has only `--bound-workers` workers per stage: a replica's pools are the limit, not the CPU, so a
    second replica should double throughput if the coordination does not serialise the work). Configurations
    are visited in a snake (1x1, 1x2, 2x2, 2x1, then back) so that each is measured early and late; the table
    gives the best pass's episodes/s (other tenants only slow a run down) and the mean of the rest. Each
    replica's share of the replicas' CPU says which of them did the work.
(c) The decoupled simulation extended to hundreds of rollout workers with a serial coordinator whose costs
    are the figures measured in (a): bench/bench_scale_out_sim.py (the real Producer, buffer and staleness
    plugin on a virtual clock, as bench/bench_decoupled.py; its section there is left as it is).

Nothing is asserted: the machine is shared and noisy, so the ratios from the same run are the figures to
compare across runs, not the absolute rates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
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
from bench_scale_out_sim import SimInputs, render_sim, run_sim
from common import (
    BenchError,
    busy_cpu_seconds,
    command_line,
    cpu_seconds,
    machine,
    replace_section,
    stop,
    tree_cpu_seconds,
    utc_now,
)

from prorl_adapter.dev import localstack

BLOCK_START = "<!-- bench_scale_out:start -->"
BLOCK_END = "<!-- bench_scale_out:end -->"
COMMAND = "pwd"
HEARTBEAT_S = "1"  # the runtimes' heartbeat (default 2 s): a new runtime is seen sooner
IDLE_S = 5.0  # how long the idle CPU of each process is measured


# -- the LLM stand-in ------------------------------------------------------------------------------------
def stand_in_main(listen_fd: int, tokenizer_path: str) -> None:
    """A separate process, on the socket start_stand_in hands it: the same tool call for every completion, after
    the delay `PUT /_delay` set."""
    from aiohttp import web
    from transformers import AutoTokenizer

    from prorl_adapter.service.chat import tool_call_texts
    from server_kit.webapp import inherited_socket

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    text = tool_call_texts("bash", "command", [COMMAND])[0]
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    body = json.dumps(
        {
            "choices": [
                {
                    "text": text,
                    "token_ids": ids,
                    "logprobs": {"token_logprobs": [0.0] * len(ids)},
                    "finish_reason": "stop",
                }
            ]
        }
    ).encode()
    delay = {"s": 0.0}

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "stand-in"}]})

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        if delay["s"]:
            await asyncio.sleep(delay["s"])
        return web.Response(body=body, content_type="application/json")

    async def set_delay(request: web.Request) -> web.Response:
        delay["s"] = float((await request.json())["ms"]) / 1000
        return web.json_response(delay)

    app = web.Application()
    app.router.add_routes(
        [web.get("/v1/models", models), web.post("/v1/completions", completions), web.put("/_delay", set_delay)]
    )
    web.run_app(app, sock=inherited_socket(listen_fd), print=None, access_log=None)


def start_stand_in(log: Path) -> localstack.Service:
    localstack.build_tiny_model()
    argv = [sys.executable, __file__, "--_stand-in-llm", "{listen_fd}", str(localstack.TINY_MODEL)]
    return localstack.start_service("LLM stand-in", argv, "/v1/models", 60, log)


def set_llm_delay(url: str, ms: float) -> None:
    httpx.put(url + "/_delay", json={"ms": ms}, timeout=10).raise_for_status()


# -- Redis ------------------------------------------------------------------------------------------------
@dataclass
class Redis:
    """A redis-server of our own, as integration_tests/redis_server.py starts one (no persistence)."""

    process: subprocess.Popen
    port: int
    workdir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_redis(workdir: Path) -> Redis:
    server = shutil.which("redis-server")
    if server is None:
        raise BenchError("redis-server is not installed (apt-get install redis-server; make bench does)")
    import redis

    workdir.mkdir(parents=True, exist_ok=True)
    port = localstack.free_port()
    argv = [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", ""]
    argv += ["--appendonly", "no", "--logfile", str(workdir / "redis.log")]
    process = subprocess.Popen(
        argv, cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
    )
    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + 20
    try:
        while True:
            if process.poll() is not None:
                raise BenchError(f"redis-server exited with status {process.returncode} (log: {workdir})")
            try:
                if client.ping():
                    return Redis(process, port, workdir)
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            if time.monotonic() > deadline:
                process.kill()
                raise BenchError("redis-server did not answer PING within 20 s")
            time.sleep(0.05)
    finally:
        client.close()


# -- the episodes -----------------------------------------------------------------------------------------
def make_requests(n: int, tag: str) -> list[Any]:
    from prorl_adapter.models import JobRequest, SamplingParams
    from prorl_adapter.service.chat import tool_call_regex

    regex = tool_call_regex("bash", "command", [COMMAND])
    instance = {"goal": "Print the working directory.", "check": "true"}
    return [
        JobRequest(
            job_id=f"{tag}-{i}",
            task="shell",
            instance={**instance, "id": f"{tag}-{i}"},
            sampling=SamplingParams(max_tokens=64, temperature=1.0, regex=regex),
            max_turns=1,
        )
        for i in range(n)
    ]


@dataclass
class RunResult:
    """One measured run: a batch of episodes through one configuration in one mode."""

    arm: str
    mode: str  # coupled | decoupled
    episodes: int = 0
    failed: int = 0
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # component -> CPU seconds over the run
    stages: dict[str, float] = field(default_factory=dict)  # mean stage timings (service side)
    first_error: str | None = None
    round: int = 0
    clients: int = 0  # closed-loop clients (decoupled: prompts outstanding)
    commands: dict[str, tuple[int, int]] = field(default_factory=dict)  # Redis: command -> (calls, usec)

    def commands_per_episode(self) -> float:
        return sum(calls for calls, _ in self.commands.values()) / max(self.episodes, 1)

    @property
    def per_s(self) -> float:
        return self.episodes / self.wall_s if self.wall_s else float("nan")

    def p(self, q: float) -> float:
        return quantile(self.latencies, q)

    def cores(self) -> float:
        """Cores the whole machine was busy on average over the run (other tenants included)."""
        return self.cpu.get("whole machine", float("nan")) / self.wall_s if self.wall_s else float("nan")

    def outside_cores(self) -> float:
        """Of those, the cores busy outside the benchmark's processes (other tenants, kernel threads)."""
        ours = sum(v for k, v in self.cpu.items() if k in OURS)
        return (self.cpu.get("whole machine", float("nan")) - ours) / self.wall_s if self.wall_s else float("nan")

    def cpu_ms(self, component: str) -> float:
        return 1000 * self.cpu.get(component, float("nan")) / max(self.episodes, 1)


def quantile(values: list[float], q: float) -> float:
    """Nearest rank."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.fmean(values) if values else float("nan")


def _note(result: RunResult, trajectory: Any) -> None:
    if trajectory.error is not None:
        result.failed += 1
        result.first_error = result.first_error or f"{trajectory.error.error_class}: {trajectory.error.message}"[:300]


def _stage_means(trajectories: list[Any]) -> dict[str, float]:
    names = ("queued_s", "init_s", "run_s", "eval_s", "generate_s", "tools_s")
    return {name: mean([getattr(t.timings, name) for t in trajectories]) for name in names}


async def run_coupled(urls: list[str], requests: list[Any], concurrency: int, result: RunResult) -> None:
    """A closed loop of `concurrency` clients; request i goes to (and is polled at) replica i mod len(urls)."""
    from prorl_adapter.trainer.client import RolloutClient

    clients = [RolloutClient(url, timeout=60) for url in urls]
    todo = list(enumerate(requests))
    trajectories: list[Any] = []

    async def client_loop() -> None:
        while todo:
            index, request = todo.pop(0)
            client = clients[index % len(clients)]
            started = time.monotonic()
            job = await client.submit(request)
            trajectory = await client.result(job.job_id, wait=600)
            result.latencies.append(time.monotonic() - started)
            trajectories.append(trajectory)
            _note(result, trajectory)

    try:
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    finally:
        for client in clients:
            await client.aclose()
    result.episodes = len(trajectories)
    result.stages = _stage_means(trajectories)


async def run_decoupled(url: str, requests: list[Any], concurrency: int, batch: int, result: RunResult) -> None:
    """The trainer keeps `concurrency` prompts outstanding, takes batches of `batch`, acknowledges each at once
    and queues as many new prompts as it took."""
    from prorl_adapter.trainer.client import RolloutClient

    queued: dict[str, float] = {}
    pending = list(requests)
    trajectories: list[Any] = []
    async with RolloutClient(url, timeout=60) as client:

        async def enqueue(n: int) -> None:
            chunk, pending[:n] = pending[:n], []
            if chunk:
                now = time.monotonic()
                for request in chunk:
                    queued[request.job_id] = now
                await client.enqueue_prompts(chunk)

        await enqueue(concurrency)
        while len(trajectories) < len(requests):
            want = min(batch, len(requests) - len(trajectories))
            taken = await client.take_batch(want, timeout=30)
            now = time.monotonic()
            if not taken.items:
                raise BenchError(f"no trajectory within 30 s ({len(trajectories)} of {len(requests)} taken)")
            await client.ack([item.id for item in taken.items])
            for item in taken.items:
                trajectory = item.trajectory
                prompt = trajectory.retry_of or trajectory.job_id
                result.latencies.append(now - queued.get(prompt, queued.get(trajectory.job_id, now)))
                trajectories.append(trajectory)
                _note(result, trajectory)
            await enqueue(len(taken.items))
    result.episodes = len(trajectories)
    result.stages = _stage_means(trajectories)


class Meter:
    """CPU seconds of named components, as deltas over one run."""

    def __init__(self, components: dict[str, Any]) -> None:
        self.components = components

    def snapshot(self) -> dict[str, float]:
        return {name: read() for name, read in self.components.items()}

    @staticmethod
    def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {name: after[name] - before[name] for name in before}


def measure(
    arm: str,
    mode: str,
    urls: list[str],
    meter: Meter,
    n: int,
    concurrency: int,
    batch: int,
    tag: str,
    redis_url: str | None = None,
) -> RunResult:
    """One run; with `redis_url`, also the commands Redis ran meanwhile (INFO commandstats)."""
    result = RunResult(arm, mode)
    requests = make_requests(n, tag)
    commands = command_stats(redis_url) if redis_url else {}
    before = meter.snapshot()
    started = time.monotonic()
    if mode == "coupled":
        asyncio.run(run_coupled(urls, requests, concurrency, result))
    else:
        asyncio.run(run_decoupled(urls[0], requests, concurrency, batch, result))
    result.wall_s = time.monotonic() - started
    result.cpu = Meter.delta(before, meter.snapshot())
    if redis_url:
        after = command_stats(redis_url)
        result.commands = {
            name: (calls - commands.get(name, (0, 0))[0], usec - commands.get(name, (0, 0))[1])
            for name, (calls, usec) in after.items()
            if calls > commands.get(name, (0, 0))[0]
        }
    return result


def command_stats(redis_url: str) -> dict[str, tuple[int, int]]:
    """Redis's own count of each command it ran, and the microseconds it spent in them, since it started
    (Lua scripts count as EVALSHA, and the commands they call count too)."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for name, v in stats.items()}


def idle_rates(meter: Meter, seconds: float = IDLE_S) -> dict[str, float]:
    """CPU seconds per second of each component with nothing to do."""
    before = meter.snapshot()
    time.sleep(seconds)
    return {name: value / seconds for name, value in Meter.delta(before, meter.snapshot()).items()}


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise BenchError(f"{what} did not happen within {timeout:g} s")
        time.sleep(0.2)


def alive_runtimes(url: str) -> int:
    runtimes = httpx.get(url + "/v1/runtimes", timeout=10).json()["runtimes"]
    return sum(1 for r in runtimes if r["alive"])


def alive_replicas(url: str) -> int:
    replicas = httpx.get(url + "/v1/status", timeout=10).json()["replicas"]
    return sum(1 for r in replicas if r["alive"])


def sandboxes_created(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("prorl_sandbox_created_total")
    )


# -- (a) memory vs redis --------------------------------------------------------------------------------
@dataclass
class PartA:
    runs: list[RunResult]
    idle: dict[str, float]
    admission: dict[str, float]  # arm -> seconds per admission
    admission_rtt: float  # one PING round trip to Redis, seconds


SERVICE = {"memory": "service (memory://)", "redis": "service (redis://)"}
REDIS_CPU = "redis-server"
RUNTIME_CPU = "runtime (server, bwrap, bash)"
LLM_CPU = "LLM stand-in"
OURS = (
    SERVICE["memory"],
    SERVICE["redis"],
    REDIS_CPU,
    RUNTIME_CPU,
    "benchmark client",
    LLM_CPU,
    "replicas",
    "runtimes",
)
REDIS_COMMANDS = "Redis commands"  # in PartA.idle: commands per second with nothing running


def part_a(args: argparse.Namespace, work: Path, llm_url: str, started: list[Any]) -> PartA:
    redis = start_redis(work / "redis-a")
    started.append(redis)
    common_args = ["--max-run-workers", str(args.workers), "--max-init-workers", str(args.workers)]
    memory = localstack.start_rollout_service(
        [], [llm_url], "--buffer", "memory://", "--service-id", "mem", *common_args, log=work / "service-memory.log"
    )
    started.append(memory)
    shared = localstack.start_rollout_service(
        [], [llm_url], "--buffer", redis.url, "--service-id", "r0", *common_args, log=work / "service-redis.log"
    )
    started.append(shared)
    runtime = localstack.start_sandbox_runtime(
        reachable_dir(work / "runtime-a"),
        "bwrap",
        *("--register", memory.url, "--register", shared.url, "--heartbeat-s", HEARTBEAT_S),
        *("--max-sandboxes", "2048"),
        log=work / "runtime-a.log",
    )
    started.append(runtime)
    for service in (memory, shared):
        wait_until(lambda s=service: alive_runtimes(s.url) == 1, 30, f"the runtime registering with {service.url}")
    meter = Meter(
        {
            SERVICE["memory"]: lambda: cpu_seconds([memory.process.pid]),
            SERVICE["redis"]: lambda: cpu_seconds([shared.process.pid]),
            REDIS_CPU: lambda: cpu_seconds([redis.pid]),
            RUNTIME_CPU: lambda: tree_cpu_seconds(runtime.process.pid),
            "benchmark client": time.process_time,
            LLM_CPU: lambda: cpu_seconds([args.llm_pid]) if args.llm_pid else 0.0,
            "whole machine": busy_cpu_seconds,
        }
    )
    urls = {"memory": [memory.url], "redis": [shared.url]}
    print("warm-up: a few episodes through each service in each mode ...", flush=True)
    for arm in ("memory", "redis"):
        for mode in ("coupled", "decoupled"):
            measure(arm, mode, urls[arm], meter, 16, 8, 4, f"warm-{arm}-{mode}")
    print(f"idle CPU over {IDLE_S:g} s ...", flush=True)
    idle_commands = command_stats(redis.url)
    idle = idle_rates(meter)
    idle_after = command_stats(redis.url)
    idle[REDIS_COMMANDS] = sum(c - idle_commands.get(n, (0, 0))[0] for n, (c, _) in idle_after.items()) / IDLE_S
    runs = []
    # Loaded (C clients) and one at a time (the latency an episode pays with nothing else running).
    variants = [(mode, args.concurrency, args.batch, args.episodes) for mode in ("coupled", "decoupled")]
    variants += [(mode, 1, 1, args.sequential) for mode in ("coupled", "decoupled") if args.sequential]
    for round_index in range(args.rounds):
        for mode, clients, batch, n in variants:
            order = ("memory", "redis") if round_index % 2 == 0 else ("redis", "memory")
            for arm in order:
                tag = f"a{round_index}-{arm}-{mode}-{clients}"
                r = measure(arm, mode, urls[arm], meter, n, clients, batch, tag, redis.url)
                r.round, r.clients = round_index + 1, clients
                runs.append(r)
                print(
                    f"  round {r.round} {mode:<9} x{clients:<3} {arm:<6} {r.per_s:6.1f} ep/s  "
                    f"p50 {r.p(0.5) * 1000:6.0f} ms  "
                    f"service {r.cpu_ms(SERVICE[arm]):5.2f} ms/ep  redis {r.cpu_ms(REDIS_CPU):5.2f} ms/ep  "
                    f"runtime {r.cpu_ms(RUNTIME_CPU):5.2f} ms/ep  machine "
                    f"{r.cpu_ms('whole machine'):5.1f} ms/ep  outside {r.outside_cores():.2f} cores  {r.failed} failed",
                    flush=True,
                )
    print("admission alone, memory vs Redis ...", flush=True)
    admission = {
        arm: admission_seconds(redis.url if arm == "redis" else None, args.admissions) for arm in ("memory", "redis")
    }
    rtt = ping_seconds(redis.url)
    for service in (shared, memory):
        stop(service)
        started.remove(service)
    stop(runtime)
    started.remove(runtime)
    redis.stop()
    started.remove(redis)
    return PartA(runs, idle, admission, rtt)


def admission_seconds(redis_url: str | None, n: int) -> float:
    """Seconds per admission: the real Producer admitting `n` prompts (staleness off) into a pipeline that
    holds them, its prompt queue, buffer and coordination in memory or in a fresh Redis prefix. Best of 3."""
    return min(asyncio.run(_admission_once(redis_url, n, attempt)) for attempt in range(3))


async def _admission_once(redis_url: str | None, n: int, attempt: int) -> float:
    from prorl_adapter.hooks import PluginSet
    from prorl_adapter.service.decoupled import Producer, ProducerConfig
    from prorl_adapter.service.storage.memory_buffer import MemoryBuffer
    from prorl_adapter.testing import SimulatedRunner
    from prorl_plugins.staleness import StalenessControl

    plugins = PluginSet.load(objects=[StalenessControl({"mode": "off"})], entry_points=False)
    # Its jobs never finish: what admission alone costs. With shared state a replica admits only what its
    # workers take: room for every prompt here.
    pipeline = SimulatedRunner(plugins, workers=2 * n)
    config = ProducerConfig(max_buffered=10 * n)
    closers: list[Any] = []
    if redis_url is None:
        producer = Producer(pipeline, MemoryBuffer(), config=config)
    else:
        from prorl_adapter.service.storage.redis_buffer import RedisBuffer
        from prorl_adapter.service.storage.redis_coordination import RedisCoordination
        from prorl_adapter.service.storage.redis_prompts import RedisPromptQueue

        prefix = f"bench-admission-{attempt}-{time.monotonic_ns()}"
        replica = f"bench-admission-{attempt}"
        buffer = RedisBuffer(redis_url, consumer=replica, prefix=f"{prefix}:buffer")
        prompts = RedisPromptQueue(redis_url, replica, prefix=f"{prefix}:prompts")
        coordination = RedisCoordination(redis_url, replica, prefix=prefix)
        closers = [buffer, prompts, coordination]
        producer = Producer(pipeline, buffer, prompts=prompts, config=config, coordination=coordination)
    await producer.enqueue(make_requests(n, f"adm{attempt}"))
    started = time.perf_counter()
    producer.start()
    while len(pipeline.jobs) < n:
        await asyncio.sleep(0.001)
        failed = [task for task in producer._tasks if task.done()]
        if failed or time.perf_counter() - started > 120:
            await producer.stop()
            raise BenchError(
                f"admission stopped after {len(pipeline.jobs)} of {n} ({failed and failed[0].exception()})"
            )
    seconds = time.perf_counter() - started
    await producer.stop()
    for closer in closers:
        await closer.close()
    return seconds / n


def ping_seconds(redis_url: str, n: int = 2000) -> float:
    """One round trip to Redis from a client like the service's (redis.asyncio), median of `n`."""
    import redis.asyncio as aioredis

    async def go() -> float:
        client = aioredis.Redis.from_url(redis_url)
        times = []
        try:
            for _ in range(n):
                started = time.perf_counter()
                await client.ping()
                times.append(time.perf_counter() - started)
        finally:
            await client.aclose()
        return statistics.median(times)

    return asyncio.run(go())


# -- (b) replicas and runtimes ---------------------------------------------------------------------------
@dataclass
class ScaleRun:
    regime: str
    replicas: int
    runtimes: int
    result: RunResult
    created: list[float]  # sandboxes created on each runtime during the run


def part_b(args: argparse.Namespace, work: Path, llm_url: str, started: list[Any]) -> list[ScaleRun]:
    redis = start_redis(work / "redis-b")
    started.append(redis)
    pools = ["--max-init-workers", str(args.bound_workers), "--max-run-workers", str(args.bound_workers)]
    pools += ["--max-eval-workers", str(args.bound_workers)]
    replicas: list[localstack.Service] = []
    runtimes: list[localstack.Service] = []

    def start_replica(i: int) -> None:
        replicas.append(
            localstack.start_rollout_service(
                [],
                [llm_url],
                "--buffer",
                redis.url,
                "--service-id",
                f"replica-{i}",
                *pools,
                log=work / f"replica-{i}.log",
            )
        )
        started.append(replicas[-1])

    starts = [0]

    def start_runtime(i: int) -> None:
        # Registered with replica 0 only: what one replica hears, every replica on the Redis uses.
        starts[0] += 1
        runtimes.append(
            localstack.start_sandbox_runtime(
                reachable_dir(work / f"runtime-b{i}-{starts[0]}"),
                "bwrap",
                *("--register", replicas[0].url, "--heartbeat-s", HEARTBEAT_S, "--max-sandboxes", "2048"),
                log=work / f"runtime-b{i}-{starts[0]}.log",
            )
        )
        started.append(runtimes[-1])

    def settle(n_replicas: int, n_runtimes: int) -> None:
        for replica in replicas:
            wait_until(lambda r=replica: alive_runtimes(r.url) == n_runtimes, 30, f"{n_runtimes} runtimes seen")
        wait_until(lambda: alive_replicas(replicas[0].url) == n_replicas, 30, f"{n_replicas} replicas alive")

    def remove(services: list[localstack.Service]) -> None:
        service = services.pop()
        stop(service)
        started.remove(service)

    start_replica(0)
    start_runtime(0)
    settle(1, 1)
    regimes = []
    if "cpu" in args.regimes:
        regimes.append(("CPU-bound", 0.0))
    if "latency" in args.regimes and args.llm_url is None:
        regimes.append((f"latency-bound ({args.latency_ms:g} ms LLM)", args.latency_ms))
    # The snake: 1x1, 1x2, 2x2, 2x1 (replicas x runtimes), then back the same way.
    path = [(1, 1), (1, 2), (2, 2), (2, 1)]
    path = path + path[::-1] if args.rounds > 1 else path
    results: list[ScaleRun] = []
    for step, (n_replicas, n_runtimes) in enumerate(path):
        while len(runtimes) < n_runtimes:
            start_runtime(len(runtimes))
        while len(replicas) < n_replicas:
            start_replica(len(replicas))
        while len(runtimes) > n_runtimes:
            remove(runtimes)
        while len(replicas) > n_replicas:
            remove(replicas)
        settle(n_replicas, n_runtimes)
        pids = [r.process.pid for r in replicas]
        per_replica = {f"replica-{i}": (lambda pid=pid: cpu_seconds([pid])) for i, pid in enumerate(pids)}
        meter = Meter(
            {
                "replicas": lambda pids=pids: cpu_seconds(pids),
                **per_replica,
                REDIS_CPU: lambda: cpu_seconds([redis.pid]),
                "runtimes": lambda rts=list(runtimes): sum(tree_cpu_seconds(r.process.pid) for r in rts),
                "benchmark client": time.process_time,
                LLM_CPU: lambda: cpu_seconds([args.llm_pid]) if args.llm_pid else 0.0,
                "whole machine": busy_cpu_seconds,
            }
        )
        for regime, delay_ms in regimes:
            if args.llm_url is None:
                set_llm_delay(llm_url, delay_ms)
            for mode in args.scale_modes:
                # A fresh replica's first episodes pay for imports, connections and caches: not measured.
                measure(
                    "warm",
                    mode,
                    [s.url for s in replicas],
                    meter,
                    4 * n_replicas,
                    4 * n_replicas,
                    2,
                    f"w{step}-{regime.split()[0]}-{mode}",
                )
                before = [sandboxes_created(r.url) for r in runtimes]
                tag = f"b{step}-{regime.split()[0]}-{mode}"
                r = measure(
                    f"{n_replicas}x{n_runtimes}",
                    mode,
                    [s.url for s in replicas],
                    meter,
                    args.scale_episodes,
                    args.scale_concurrency,
                    args.batch,
                    tag,
                )
                r.round = 1 if step < 4 else 2
                created = [sandboxes_created(rt.url) - b for rt, b in zip(runtimes, before, strict=True)]
                results.append(ScaleRun(regime, n_replicas, n_runtimes, r, created))
                print(
                    f"  {regime:<28} {mode:<9} {n_replicas} replica(s) x {n_runtimes} runtime(s): {r.per_s:6.1f} ep/s "
                    f"p50 {r.p(0.5) * 1000:6.0f} ms, replicas {r.cpu_ms('replicas'):5.2f} ms/ep, redis "
                    f"{r.cpu_ms(REDIS_CPU):5.2f} ms/ep, split {replica_split(r, n_replicas)}, sandboxes per runtime "
                    f"{'/'.join(f'{c:.0f}' for c in created)}, machine {r.cores():.2f} cores "
                    f"({r.outside_cores():.2f} outside), {r.failed} failed",
                    flush=True,
                )
    if args.llm_url is None:
        set_llm_delay(llm_url, 0)
    for service in [*replicas, *runtimes]:
        stop(service)
        started.remove(service)
    redis.stop()
    started.remove(redis)
    return results


def replica_split(r: RunResult, n_replicas: int) -> str:
    """Each replica's share of the replicas' CPU over the run: who did the work."""
    parts = [r.cpu.get(f"replica-{i}", 0.0) for i in range(n_replicas)]
    total = sum(parts) or 1.0
    return "/".join(f"{100 * p / total:.0f}%" for p in parts)


def reachable_dir(path: Path) -> Path:
    """A state dir whose ancestors a root server's sandbox uids can traverse (as the tests' `reachable`)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o711)
    return path


# -- the report -------------------------------------------------------------------------------------------
def fmt_ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "—"
    ms = seconds * 1000
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def ratio(b: float, a: float) -> str:
    return f"{b / a:.2f}x" if a and not math.isnan(a) and not math.isnan(b) else "—"


def agg(runs: list[RunResult], metric: Any) -> float:
    return mean([metric(r) for r in runs])


def variants_of(a: PartA) -> list[tuple[str, int]]:
    return list(dict.fromkeys((r.mode, r.clients) for r in a.runs))


def arms(a: PartA, mode: str, clients: int) -> tuple[list[RunResult], list[RunResult]]:
    runs = [r for r in a.runs if (r.mode, r.clients) == (mode, clients)]
    return [r for r in runs if r.arm == "memory"], [r for r in runs if r.arm == "redis"]


def variant_label(mode: str, clients: int) -> str:
    what = "POST /v1/jobs + GET result" if mode == "coupled" else "prompts + batches + ack"
    load = f"{clients} clients" if mode == "coupled" else f"{clients} prompts outstanding"
    return f"{mode} ({what}), {'one at a time' if clients == 1 else load}"


def table_a(a: PartA) -> str:
    lines = [
        "| Mode | Metric | memory:// | redis:// | redis ÷ memory |",
        "|---|---|---|---|---|",
    ]
    for mode, clients in variants_of(a):
        mem, red = arms(a, mode, clients)
        if not mem or not red:
            continue
        label = variant_label(mode, clients)
        rows: list[tuple[str, Any, Any, bool]] = []
        if clients > 1:
            rows.append(("**episodes/s**", lambda r: r.per_s, lambda v: f"**{v:.1f}**", True))
        rows += [
            ("latency p50", lambda r: r.p(0.5), fmt_ms, True),
            ("latency p99", lambda r: r.p(0.99), fmt_ms, True),
            ("**service CPU per episode**", lambda r: r.cpu_ms(SERVICE[r.arm]), lambda v: f"**{v:.2f} ms**", True),
            ("Redis CPU per episode", lambda r: r.cpu_ms(REDIS_CPU), lambda v: f"{v:.2f} ms", False),
            ("Redis commands per episode", lambda r: r.commands_per_episode(), lambda v: f"{v:.1f}", False),
            (
                "service + Redis CPU per episode",
                lambda r: r.cpu_ms(SERVICE[r.arm]) + (r.cpu_ms(REDIS_CPU) if r.arm == "redis" else 0.0),
                lambda v: f"{v:.2f} ms",
                True,
            ),
        ]
        if clients > 1:
            rows += [
                (
                    "runtime CPU per episode (server, bwrap, bash)",
                    lambda r: r.cpu_ms(RUNTIME_CPU),
                    lambda v: f"{v:.1f} ms",
                    True,
                ),
                ("whole machine CPU per episode", lambda r: r.cpu_ms("whole machine"), lambda v: f"{v:.1f} ms", True),
                (
                    "machine busy outside the benchmark (cores)",
                    lambda r: r.outside_cores(),
                    lambda v: f"{v:.2f}",
                    False,
                ),
            ]
        for index, (metric_name, metric, fmt, with_ratio) in enumerate(rows):
            x, y = agg(mem, metric), agg(red, metric)
            head = label if index == 0 else ""
            lines.append(f"| {head} | {metric_name} | {fmt(x)} | {fmt(y)} | {ratio(y, x) if with_ratio else '—'} |")
    mem_adm, red_adm = a.admission["memory"], a.admission["redis"]
    lines.append(
        "| admission alone (the Producer, no episodes) | one admission (under the lock: counts, pop) "
        f"| {mem_adm * 1e6:.0f} µs "
        f"| {red_adm * 1e3:.2f} ms (= {red_adm / a.admission_rtt:.1f} round trips of {a.admission_rtt * 1e6:.0f} µs) "
        f"| {ratio(red_adm, mem_adm)} |"
    )
    return "\n".join(lines)


def overhead_lines(a: PartA) -> list[str]:
    out = []
    idle_redis = a.idle.get(REDIS_CPU, 0.0)
    for mode, clients in variants_of(a):
        mem, red = arms(a, mode, clients)
        if not mem or not red:
            continue
        svc_mem = agg(mem, lambda r: r.cpu_ms(SERVICE["memory"]))
        svc_red = agg(red, lambda r: r.cpu_ms(SERVICE["redis"]))
        redis_cpu = agg(red, lambda r: r.cpu_ms(REDIS_CPU))
        redis_idle = 1000 * idle_redis * agg(red, lambda r: r.wall_s / max(r.episodes, 1))
        p50 = agg(red, lambda r: r.p(0.5)) - agg(mem, lambda r: r.p(0.5))
        line = (
            f"{variant_label(mode, clients)}: the shared state adds {svc_red - svc_mem:+.2f} ms of service CPU "
            f"({ratio(svc_red, svc_mem)}) and {redis_cpu:.2f} ms of Redis CPU per episode (of which about "
            f"{redis_idle:.2f} ms is Redis idling: its background rate over the run's time per episode), and "
            f"{p50 * 1000:+.1f} ms at the latency p50"
        )
        if clients > 1:
            whole = agg(mem, lambda r: r.cpu_ms("whole machine"))
            line += (
                f"; together {(svc_red - svc_mem + redis_cpu) / whole:.1%} of the whole machine's {whole:.0f} ms "
                "per episode with memory://; throughput "
                f"{ratio(agg(red, lambda r: r.per_s), agg(mem, lambda r: r.per_s))} of memory://"
            )
        out.append(line + ".")
    return out


def details_a(a: PartA) -> list[str]:
    out = []
    idle = ", ".join(
        f"{name} {rate * 1000:.1f} ms/s"
        for name, rate in a.idle.items()
        if name not in ("whole machine", REDIS_COMMANDS)
    )
    out.append(
        f"Idle CPU per second of wall time (nothing running; included in the per-episode figures): {idle}; Redis "
        f"ran {a.idle.get(REDIS_COMMANDS, 0):.0f} commands/s meanwhile (heartbeats, the replica's beat and "
        "watch, BLMOVE and pub/sub timeouts)."
    )
    for mode, clients in variants_of(a):
        _, red = arms(a, mode, clients)
        if red and clients > 1:
            out.append(f"Redis's commands per episode, {variant_label(mode, clients)}: {command_mix(red)}.")
    for r in a.runs:
        s = r.stages
        out.append(
            f"round {r.round}, {r.mode} x{r.clients}, {r.arm}: {r.episodes} episodes in {r.wall_s:.1f} s = "
            f"{r.per_s:.1f}/s, "
            f"p50 {fmt_ms(r.p(0.5))}, p99 {fmt_ms(r.p(0.99))}, {r.failed} failed; service side per episode: queued "
            f"{fmt_ms(s.get('queued_s', float('nan')))}, init {fmt_ms(s.get('init_s', float('nan')))}, run "
            f"{fmt_ms(s.get('run_s', float('nan')))} (LLM {fmt_ms(s.get('generate_s', float('nan')))}, tool "
            f"{fmt_ms(s.get('tools_s', float('nan')))}), eval {fmt_ms(s.get('eval_s', float('nan')))}; CPU over the "
            "run: "
            + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in r.cpu.items())
            + "."
            + (f" First error: {r.first_error}" if r.first_error else "")
        )
    return out


CONFIGS = [(1, 1), (1, 2), (2, 1), (2, 2)]  # (replicas, runtimes)


def cells_of(runs: list[ScaleRun], regime: str, mode: str) -> dict[tuple[int, int], list[ScaleRun]]:
    return {
        c: [s for s in runs if (s.regime, s.result.mode, s.replicas, s.runtimes) == (regime, mode, *c)] for c in CONFIGS
    }


def cell_value(cell: list[ScaleRun], metric: Any) -> float:
    return agg([s.result for s in cell], metric) if cell else float("nan")


def command_mix(runs: list[RunResult], top: int = 12) -> str:
    """The commands Redis ran per episode over `runs`, by Redis's own time in them (INFO commandstats; a
    script's inner commands count both in EVALSHA and as themselves)."""
    episodes = sum(r.episodes for r in runs) or 1
    calls: dict[str, int] = {}
    usec: dict[str, int] = {}
    for r in runs:
        for name, (c, u) in r.commands.items():
            calls[name] = calls.get(name, 0) + c
            usec[name] = usec.get(name, 0) + u
    ordered = sorted(calls, key=lambda name: -usec[name])[:top]
    return ", ".join(f"{name} {calls[name] / episodes:.1f} ({usec[name] / episodes:.0f} µs)" for name in ordered)


def best_rate(cell: list[ScaleRun]) -> float:
    """Episodes/s of the best pass: on a shared machine other tenants only ever slow a run down."""
    return max((s.result.per_s for s in cell), default=float("nan"))


def table_b_rows(cells: dict[tuple[int, int], list[ScaleRun]]) -> list[tuple[str, list[str]]]:
    base = best_rate(cells[(1, 1)])
    rows: list[tuple[str, list[str]]] = [("**episodes/s**, best pass (÷ 1x1)", []), ("latency p50 / p99", [])]
    rows += [
        ("replicas' CPU per episode (split)", []),
        ("Redis CPU per episode", []),
        ("machine busy, cores of 2 (outside the benchmark)", []),
    ]
    for c in CONFIGS:
        cell = cells[c]
        rate = best_rate(cell)
        rows[0][1].append(
            "—" if math.isnan(rate) else f"**{rate:.1f}**" + ("" if c == (1, 1) else f" ({ratio(rate, base)})")
        )
        rows[1][1].append(
            f"{fmt_ms(cell_value(cell, lambda r: r.p(0.5)))} / {fmt_ms(cell_value(cell, lambda r: r.p(0.99)))}"
        )
        rows[2][1].append(f"{cell_value(cell, lambda r: r.cpu_ms('replicas')):.2f} ms ({split_of(cell, c[0])})")
        rows[3][1].append(f"{cell_value(cell, lambda r: r.cpu_ms(REDIS_CPU)):.2f} ms")
        rows[4][1].append(
            f"{cell_value(cell, lambda r: r.cores()):.2f} ({cell_value(cell, lambda r: r.outside_cores()):.2f})"
        )
    return rows


def table_b(runs: list[ScaleRun], modes: list[str]) -> str:
    def name(replicas: int, runtimes: int) -> str:
        return f"{replicas} replica{'s' if replicas > 1 else ''} x {runtimes} runtime{'s' if runtimes > 1 else ''}"

    lines = [
        "| Regime | Mode | Metric | " + " | ".join(name(*c) for c in CONFIGS) + " |",
        "|" + "---|" * (3 + len(CONFIGS)),
    ]
    for regime in dict.fromkeys(s.regime for s in runs):
        for mode in modes:
            cells = cells_of(runs, regime, mode)
            if not any(cells.values()):
                continue
            for index, (metric_name, texts) in enumerate(table_b_rows(cells)):
                prefix = f"| {regime} | {mode} |" if index == 0 else "| | |"
                lines.append(f"{prefix} {metric_name} | " + " | ".join(texts) + " |")
    return "\n".join(lines)


def split_of(cell: list[ScaleRun], n_replicas: int) -> str:
    """The replicas' shares of their CPU, over every run of a cell."""
    parts = [sum(s.result.cpu.get(f"replica-{i}", 0.0) for s in cell) for i in range(n_replicas)]
    total = sum(parts) or 1.0
    return "/".join(f"{100 * p / total:.0f}%" for p in parts)


def details_b(runs: list[ScaleRun]) -> list[str]:
    out = []
    for s in runs:
        r = s.result
        out.append(
            f"{s.regime}, {r.mode}, {s.replicas} replica(s) x {s.runtimes} runtime(s), pass {r.round}: "
            f"{r.episodes} episodes in {r.wall_s:.1f} s = {r.per_s:.1f}/s, p50 {fmt_ms(r.p(0.5))}, p99 "
            f"{fmt_ms(r.p(0.99))}, {r.failed} failed; sandboxes created per runtime: "
            + "/".join(f"{c:.0f}" for c in s.created)
            + "; CPU: "
            + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in r.cpu.items())
            + "."
            + (f" First error: {r.first_error}" if r.first_error else "")
        )
    return out


def scaling_lines(runs: list[ScaleRun], modes: list[str]) -> list[str]:
    out = []
    for regime in dict.fromkeys(s.regime for s in runs):
        for mode in modes:
            cells = cells_of(runs, regime, mode)
            one, two_rt, two_rep, both = (best_rate(cells[c]) for c in CONFIGS)
            pair = cells[(2, 1)] + cells[(2, 2)]
            shares = [sum(s.result.cpu.get(f"replica-{i}", 0.0) for s in pair) for i in range(2)]
            second = shares[1] / (sum(shares) or 1.0)
            line = (
                f"{regime}, {mode} (best passes): a second replica gives {ratio(two_rep, one)} the throughput of one "
                "(1 runtime), "
                f"{ratio(both, two_rt)} (2 runtimes); a second runtime gives {ratio(two_rt, one)} (1 replica), "
                f"{ratio(both, two_rep)} (2 replicas). With two replicas the second did {second:.0%} of their work "
                "(CPU)"
            )
            if mode == "decoupled" and pair and second < 0.25:
                line += (
                    ": it hardly ran an episode. The replica the trainer talks to is woken by each POST /v1/prompts "
                    "and admits every upcoming prompt the admission rule allows into its own pipeline queue, "
                    "whatever its own workers can run; the other finds the shared queue empty when it looks"
                )
            out.append(line + ".")
    return out


HOW_TO_READ = """\
**How to read this.** Every figure of the Redis arm stands beside the memory arm measured in the same run on
the same machine, alternating (memory, redis, then redis, memory in the next round); the table shows the mean
over rounds (in (b), episodes/s is the best pass's). The LLM is a stand-in (the module docstring says what it
is), the same process for both arms, so the episode is short (~tens of ms of work) and coordination is as
large a share of it as it can be; with a real model and real tools an episode takes seconds to minutes, and
the same absolute overhead is a far smaller share. *Service CPU per episode* is user+sys CPU of the service's
process (every thread, schedstat) over the run divided by the episodes: the HTTP API, the three stage pools,
the LLM and sandbox clients, and with Redis its client (commands, Lua scripts, JSON of every status, request
and trajectory it writes and reads). *Redis CPU per episode* is the same for redis-server: the shared
coordinator's own time, which is serial (Redis runs commands one at a time) and so the figure that bounds how
many episodes per second one Redis can coordinate (1 s ÷ that figure, at full load); *Redis commands per
episode* counts what it ran (a Lua script counts once as EVALSHA and once per command inside it). The memory
arm's Redis figures are the idle Redis replica's background, a control. Idle CPU (heartbeats, the replica's
beat, BLMOVE timeouts) is included; the details give its rate. *Machine busy outside the benchmark* is the
whole machine's CPU less that of every process of the benchmark, in cores: other tenants of this shared
machine, whose load moves every absolute figure (and the latency most) but hardly the CPU per episode of a
process. *Admission alone* times the real Producer admitting prompts into a pipeline that holds them
(staleness off): with Redis it takes the shared admission lock (up to 32 admissions per hold) and reads the
counts under it for each, so that time is serialised over all replicas.

**What 2 cores can and cannot show.** The CPU-bound regime cannot show compute scaling: every process (the
replicas, Redis, the runtimes and their sandboxes, the stand-in, the benchmark) shares the same 2 cores, so a
second replica or runtime adds processes, not cores. What it does show is whether coordination serialises
work or costs more per episode when there are two (replicas' CPU per episode, Redis CPU per episode). The
latency-bound regime makes each replica's worker pools the limit instead of the CPU (each episode waits
for the stand-in's delay in one of a few run workers), so there a second replica must about double
throughput unless something shared serialises them; a second runtime must change nothing there.\
"""


def render_block(args: argparse.Namespace, a: PartA | None, b: list[ScaleRun], sim: str, machine_text: str) -> str:
    command = command_line(__file__, args.argv)
    parts = []
    if a is not None:
        overhead = "\n".join(f"- {line}" for line in overhead_lines(a))
        details = "\n".join(f"- {line}" for line in details_a(a))
        parts.append(
            f"""### (a) Per-episode cost of the shared state: one service, memory:// vs redis://

{table_a(a)}

{overhead}

Details:

{details}
"""
        )
    if b:
        scaling = "\n".join(f"- {line}" for line in scaling_lines(b, args.scale_modes))
        details = "\n".join(f"- {line}" for line in details_b(b))
        parts.append(
            f"""### (b) Replicas and runtimes on one Redis

{table_b(b, args.scale_modes)}

{scaling}

Details:

{details}
"""
        )
    if sim:
        parts.append(sim)
    mode = (
        f"(a) {args.episodes} episodes per run, {args.rounds} round(s) of each arm in each mode, closed loop of "
        f"{args.concurrency} clients (decoupled: {args.concurrency} prompts outstanding, batches of {args.batch}), "
        f"service pools --max-init-workers/--max-run-workers {args.workers}; (b) {args.scale_episodes} episodes per "
        f"run, {args.scale_concurrency} clients, --max-{{init,run,eval}}-workers {args.bound_workers} per replica, "
        f"modes {', '.join(args.scale_modes)}; one-turn `shell` episodes (`{COMMAND}`), runtimes with bwrap, "
        f"heartbeat {HEARTBEAT_S} s"
    )
    llm = f"an OpenAI-compatible server at {args.llm_url}" if args.llm_url else "the LLM stand-in (not a model)"
    body = "\n".join(parts)
    return f"""{BLOCK_START}
## Scale-out: the cost of shared state — {utc_now()}

- **Machine:** {machine_text}
- **Command:** `{command}`
- **Mode:** {mode}; LLM: {llm}

{body}
{HOW_TO_READ}
{BLOCK_END}
"""


# -- main -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, 1 round: a smoke run")
    parser.add_argument("--episodes", type=int, default=None, help="(a) episodes per run (default 150; --quick 40)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of each arm (default 2; --quick 1)")
    parser.add_argument("--concurrency", type=int, default=16, help="(a) clients / prompts outstanding")
    parser.add_argument("--batch", type=int, default=8, help="decoupled: trajectories per take")
    parser.add_argument("--workers", type=int, default=32, help="(a) the services' init and run workers")
    parser.add_argument(
        "--sequential", type=int, default=None, help="(a) episodes run one at a time, for latency (default 50; 0: none)"
    )
    parser.add_argument("--admissions", type=int, default=None, help="(a) prompts admitted alone (default 2000)")
    parser.add_argument("--scale-episodes", type=int, default=None, help="(b) episodes per run (default 64)")
    parser.add_argument("--scale-concurrency", type=int, default=16, help="(b) clients / prompts outstanding")
    parser.add_argument("--bound-workers", type=int, default=2, help="(b) each replica's workers per stage")
    parser.add_argument("--latency-ms", type=float, default=500.0, help="(b) the stand-in's delay when latency-bound")
    parser.add_argument("--regimes", default="cpu,latency", help="(b) which of cpu,latency")
    parser.add_argument("--scale-modes", default="coupled,decoupled", help="(b) which of coupled,decoupled")
    parser.add_argument("--parts", default="a,b,c", help="which parts to run: a,b,c")
    parser.add_argument("--llm-url", default=None, help="a running OpenAI-compatible server (vLLM) instead")
    parser.add_argument("--sim-steps", type=int, default=None, help="(c) trainer steps per simulated run")
    parser.add_argument("--out", type=Path, default=None, help="write the results into this markdown file")
    args = parser.parse_args(argv)
    args.argv = argv
    args.episodes = args.episodes or (40 if args.quick else 150)
    args.rounds = args.rounds or (1 if args.quick else 2)
    if args.sequential is None:
        args.sequential = 15 if args.quick else 50
    args.admissions = args.admissions or (300 if args.quick else 2000)
    args.scale_episodes = args.scale_episodes or (32 if args.quick else 64)
    args.regimes = [r for r in args.regimes.split(",") if r]
    args.scale_modes = [m for m in args.scale_modes.split(",") if m]
    args.parts = set(args.parts.split(","))
    args.llm_pid = None  # the stand-in's, once started
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_stand-in-llm"]:  # internal: the LLM stand-in's process
        stand_in_main(int(argv[1]), argv[2])
        return 0
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops what was started
    work = Path(tempfile.mkdtemp(prefix="bench-scale-out-"))
    work.chmod(0o711)  # a root runtime's sandbox uids must traverse to its state dir inside
    started: list[Any] = []
    a: PartA | None = None
    b: list[ScaleRun] = []
    try:
        llm_url = args.llm_url
        if llm_url is None:
            llm = start_stand_in(work / "stand-in.log")
            started.append(llm)
            llm_url = llm.url
            args.llm_pid = llm.process.pid
        machine_text = machine("redis-server " + redis_version(), bubblewrap=True)
        if "a" in args.parts:
            print("(a) memory:// vs redis:// ...", flush=True)
            a = part_a(args, work, llm_url, started)
        if "b" in args.parts:
            print("(b) replicas and runtimes on one Redis ...", flush=True)
            b = part_b(args, work, llm_url, started)
    except (BenchError, RuntimeError) as exc:
        print(f"bench_scale_out: {exc} (logs: {work})", file=sys.stderr)
        return 1
    finally:
        for service in reversed(started):
            if isinstance(service, Redis):
                service.stop()
            else:
                stop(service)
    sim = ""
    if "c" in args.parts:
        print("(c) the decoupled simulation with hundreds of workers ...", flush=True)
        sim = render_sim(run_sim(sim_inputs(a), steps=args.sim_steps, quick=args.quick))
    if a is not None:
        print()
        print(table_a(a))
        print()
        print("\n".join(overhead_lines(a)))
    if b:
        print()
        print(table_b(b, args.scale_modes))
        print()
        print("\n".join(scaling_lines(b, args.scale_modes)))
    if sim:
        print()
        print(sim)
    if args.out:
        replace_section(args.out, BLOCK_START, BLOCK_END, render_block(args, a, b, sim, machine_text))
        print(f"\nwrote {args.out}")
    print(f"(logs: {work})")
    return 0


def sim_inputs(a: PartA | None) -> SimInputs:
    """The simulation's coordination costs: the decoupled figures measured in (a), or its defaults."""
    if a is None:
        return SimInputs()
    loaded = max(c for m, c in variants_of(a) if m == "decoupled")
    _, red = arms(a, "decoupled", loaded)
    redis_cpu = agg(red, lambda r: r.cpu_ms(REDIS_CPU)) / 1000
    # The latency an episode pays for the shared state: one at a time (no queueing), else loaded.
    mem, red = arms(a, "decoupled", 1 if ("decoupled", 1) in variants_of(a) else loaded)
    latency = max(0.0, agg(red, lambda r: r.p(0.5)) - agg(mem, lambda r: r.p(0.5)))
    return SimInputs(
        redis_s=redis_cpu,
        lock_s=a.admission["redis"],
        latency_s=latency,
        measured=True,
    )


def redis_version() -> str:
    try:
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, check=True).stdout
        return next((w.split("=", 1)[1] for w in out.split() if w.startswith("v=")), "?")
    except (OSError, subprocess.CalledProcessError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
