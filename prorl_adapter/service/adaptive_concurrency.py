"""How many episodes the run stage holds at once: a fixed number (`--max-run-workers`), or, with
`--target-engine-batch T`, a limit sized from each LLM server's own engine load.

    every poll_s:  GET <server>/metrics  ->  requests running r, waiting w, of them waiting for capacity q
                   each server's share s  <-  the control law below
                   limit = clamp(sum of shares, min_run_workers, max_run_workers)  ->  RunLimiter

Why: the right number of episodes in flight is the one that keeps every engine's batch full without a queue in
front of it, and that depends on how much of an episode is tool time (a task's, and it changes as episodes grow
during training). A fixed worker count is a guess; the engine's own counters say whether it has too few requests
(its GPU idles while episodes wait in the run queue) or more than it runs (requests wait in its queue, and each
further episode only adds latency). They count every client's requests, other replicas' too.

The control law, per server, at each poll, with target T, gain g (0.5) and a share s that starts at T:
- r: `vllm:num_requests_running`; w: `vllm:num_requests_waiting`; q: those of w waiting for the engine's
  capacity (`vllm:num_requests_waiting_by_reason{reason="capacity"}`; w where vLLM gives no reasons). Requests
  vLLM defers (a structured-output grammar compiling, a LoRA budget, a KV transfer) are load that will run, but
  they wait whatever the batch: they count towards the target, never as a full engine.
- n: this service's own requests in flight to the server (the LLM pool's count). vLLM counts a request once its
  front end has handed it to the engine; until then (tokenising, a burst it has not taken in yet) only n sees it.
- queueing: q > 0 at `waiting_polls` (2) polls in a row (requests seen waiting once are often just between two
  engine steps), with r > 0. Then the engine is full, and r is all it runs now: its capacity C = r, remembered
  for `capacity_memory_s` (30 s) or until it runs more.
- `excess = max(r - T, 0) + (q if queueing else 0)`; if `excess > 0`: `s -= max(1, ceil(g * excess))` (shrink);
- otherwise, with the load L = max(r + w, n): if q = 0, L < A (the aim: T, or C where smaller), episodes wait in
  the run queue and the limit is below max_run_workers: `s += max(1, ceil(g * (A - L)))` (grow);
- otherwise s holds. s stays within [1, max_run_workers].
With a fraction f of an episode's time spent generating (r ~ f * s), growing moves s as s <- s + g (A - f s): the
error shrinks by a factor 1 - g f at each poll, without overshoot while g f < 1 (f <= 1 for the built-in agent
loop, which has one request in flight at a time), and settles at s ~ A / f; near it the minimum step of one may
move it by one either way. An engine that cannot batch T requests (max_num_seqs or its KV cache below T) is held
at the size it runs without a queue; once C is forgotten the share probes upwards again, and backs off as before.
Growth needs demand (episodes queued for run), so the share does not wind up while the service is idle, nor past
max_run_workers; shrinking needs none.

The limit gates the run workers (`RunLimiter`): a worker takes the next job off the run queue, waits for a slot
(first come, first served) before it starts the episode, and gives it back when the job leaves the stage.
Lowering the limit interrupts nothing: episodes already running go on, and no new one starts until fewer than the
limit hold slots. Raising it wakes waiting workers at once.

Fallback: a server the pool finds healthy whose /metrics does not answer usably (404, timeout, refused, no vLLM
gauges: SGLang, ProRL's /generate, another OpenAI-compatible server) keeps its last share for `fallback_after`
polls, then gets the fixed share: max_run_workers / healthy servers, what the fixed worker count gives it. It is
asked again every `retry_s`; the reason shows in /v1/status and is logged when the fallback begins and ends. A
server the pool marks unhealthy gets no new episodes and counts for nothing (its share is kept for its return);
with no healthy server at all the limit stays where it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from server_kit.errors import ProrlError

from ..models import EngineLoad, LLMServerInfo, RunConcurrencyState

log = logging.getLogger(__name__)

VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"  # reason="capacity" | "deferred" (vLLM 0.32)
_VLLM_PREFIX = "vllm:num_requests_"  # the lines kept before parsing: a whole vLLM /metrics takes ~10 ms to parse


@dataclass
class AdaptiveConfig:
    target_engine_batch: int = 0  # 0: off (the run stage holds max_run_workers episodes at most)
    poll_s: float = 0.5
    min_run_workers: int = 1
    gain: float = 0.5
    waiting_polls: int = 2  # polls in a row with requests waiting for capacity before they count
    fallback_after: int = 3  # failed polls in a row before a server gets the fixed share
    retry_s: float = 30.0  # how often a server in fallback is asked again
    capacity_memory_s: float = 30.0  # how long a full engine's batch caps what its share grows for
    scrape_timeout_s: float = 2.0

    @property
    def enabled(self) -> bool:
        return self.target_engine_batch > 0

    def check(self, max_run_workers: int) -> None:
        if not isinstance(self.target_engine_batch, int) or self.target_engine_batch < 0:
            raise ValueError(f"--target-engine-batch {self.target_engine_batch!r} must be an integer >= 0 (0: off)")
        if not self.enabled:
            return
        if not 0.01 <= self.poll_s <= 60:
            raise ValueError(f"--engine-poll-s {self.poll_s:g} must be in [0.01, 60]")
        if not isinstance(self.min_run_workers, int) or not 1 <= self.min_run_workers <= max_run_workers:
            raise ValueError(
                f"--min-run-workers {self.min_run_workers!r} must be an integer in [1, --max-run-workers "
                f"{max_run_workers}]"
            )
        if not 0 < self.gain <= 1:
            raise ValueError(f"the gain {self.gain:g} must be in (0, 1]")


class NoEngineMetrics(ProrlError, ValueError):
    """A /metrics answer without the engine gauges (not vLLM), or not Prometheus text at all."""


@dataclass(frozen=True)
class EngineReading:
    running: float
    waiting: float
    for_capacity: float  # of `waiting`, those waiting for the engine's capacity (not deferred)


def engine_load(text: str) -> EngineReading:
    """The requests of a vLLM /metrics text, each gauge summed over its label sets (engines of a data-parallel
    server, model names). Those waiting for capacity are the `reason="capacity"` ones where vLLM says why
    requests wait (its deferred ones wait whatever the batch); from an older vLLM, every waiting one."""
    kept = "\n".join(line for line in text.splitlines() if _VLLM_PREFIX in line)
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(kept + "\n"):
            for sample in family.samples:
                name = sample.name
                if name == VLLM_WAITING_BY_REASON and sample.labels.get("reason") != "capacity":
                    continue
                if name in (VLLM_RUNNING, VLLM_WAITING, VLLM_WAITING_BY_REASON):
                    totals[name] = totals.get(name, 0.0) + sample.value
    except ValueError as exc:
        raise NoEngineMetrics(f"unreadable metrics: {exc}") from None
    if VLLM_RUNNING not in totals:
        raise NoEngineMetrics(f"no {VLLM_RUNNING} (not a vLLM server?)")
    waiting = totals.get(VLLM_WAITING, 0.0)
    return EngineReading(totals[VLLM_RUNNING], waiting, totals.get(VLLM_WAITING_BY_REASON, waiting))


class RunLimiter:
    """A semaphore whose limit can change while slots are held: lowering it takes no slot back (holders finish;
    no new one is granted until fewer than the limit are held), raising it grants waiters at once, first come
    first served. A waiter cancelled after being granted gives its slot back, so none is lost."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self.held = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.on_change: Callable[[], None] | None = None  # told when a slot frees or the limit moves (InitGate)

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def waiting(self) -> int:
        return sum(not w.done() for w in self._waiters)

    def set_limit(self, limit: int) -> None:
        self._limit = limit
        self._grant()
        self._changed()

    async def acquire(self) -> None:
        if self.held < self._limit and not self._waiters:
            self.held += 1
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiters.append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted, then cancelled before it resumed
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(granted)
            raise

    def release(self) -> None:
        self.held -= 1
        self._grant()
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _grant(self) -> None:
        while self._waiters and self.held < self._limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.held += 1
                waiter.set_result(None)


class EngineSource(Protocol):
    """Where the controller finds the servers and their metrics: the LLM pool (its session), or a test's fake."""

    def servers(self) -> list[LLMServerInfo]: ...

    async def read(self, url: str, path: str, timeout: float) -> bytes: ...


Source = Literal["pending", "metrics", "fixed", "unhealthy"]


@dataclass
class _Server:
    share: int
    source: Source = "pending"  # not read yet
    running: float | None = None
    waiting: float | None = None
    for_capacity: float | None = None
    in_flight: int = 0  # this service's requests to it, as the pool counts them
    waiting_streak: int = 0  # polls in a row with requests waiting for capacity
    failures: int = 0
    note: str | None = None
    retry_at: float = 0.0  # in fallback: when it is asked again
    capacity: float | None = None  # the batch its engine ran while requests queued, remembered a while
    capacity_until: float = 0.0


@dataclass
class RunConcurrency:
    """The run stage's limit, and (adaptive) the controller that moves it; see the module's docstring."""

    config: AdaptiveConfig
    max_run_workers: int
    source: EngineSource  # the servers, and their /metrics
    queued: Callable[[], int] = lambda: 0  # episodes waiting in the run queue
    limiter: RunLimiter = field(init=False)
    _servers: dict[str, _Server] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        initial = self.max_run_workers
        if self.adaptive:  # a share of T for each server: the fewest episodes that could fill its batch
            initial = self._clamp(self.config.target_engine_batch * max(len(self.source.servers()), 1))
        self.limiter = RunLimiter(initial)

    @property
    def adaptive(self) -> bool:
        return self.config.enabled

    def _clamp(self, limit: int) -> int:
        return max(self.config.min_run_workers, min(limit, self.max_run_workers))

    async def poll_forever(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # the controller must outlive a bug of its own: the limit just stays
                log.exception("adaptive run concurrency: a poll failed unexpectedly")
            await asyncio.sleep(self.config.poll_s)

    async def poll(self) -> None:
        """Read every healthy server's engine load (at once), then move the shares and the limit."""
        infos = self.source.servers()
        now = time.monotonic()
        for gone in set(self._servers) - {info.url for info in infos}:
            del self._servers[gone]
        target = self.config.target_engine_batch
        servers = {info.url: self._servers.setdefault(info.url, _Server(target)) for info in infos}
        healthy = [info.url for info in infos if info.healthy]
        asked = [url for url in healthy if servers[url].retry_at <= now]
        loads = await asyncio.gather(*(self._read(url) for url in asked))
        observed = dict(zip(asked, loads, strict=True))
        fixed_share = math.ceil(self.max_run_workers / len(healthy)) if healthy else 0
        for info in infos:
            servers[info.url].in_flight = info.in_flight
            self._observe(info.url, servers[info.url], info.healthy, observed.get(info.url), fixed_share, now)
        if healthy:
            self.limiter.set_limit(self._clamp(sum(servers[url].share for url in healthy)))

    async def _read(self, url: str) -> EngineReading | str:
        try:
            body = await self.source.read(url, "/metrics", self.config.scrape_timeout_s)
            return engine_load(body.decode("utf-8", errors="replace"))
        except aiohttp.ClientResponseError as exc:
            return f"GET /metrics answered {exc.status}"
        except TimeoutError:
            return f"GET /metrics did not answer within {self.config.scrape_timeout_s:g} s"
        except (aiohttp.ClientError, NoEngineMetrics) as exc:
            return f"GET /metrics: {exc or type(exc).__name__}"
        except Exception as exc:
            log.exception("adaptive run concurrency: reading %s/metrics failed unexpectedly", url)
            return f"GET /metrics: {type(exc).__name__}: {exc}"

    def _observe(
        self, url: str, server: _Server, healthy: bool, load: EngineReading | str | None, fixed: int, now: float
    ) -> None:
        if not healthy:
            server.source, server.note = "unhealthy", "the pool marks it unhealthy: it counts for nothing"
            return
        if load is None:  # in fallback, not asked again yet
            server.source, server.share = "fixed", fixed
            return
        if isinstance(load, str):
            self._failed(url, server, load, fixed, now)
            return
        if server.source == "fixed":
            log.info("adaptive run concurrency: %s serves engine metrics again", url)
        server.source, server.note, server.failures = "metrics", None, 0
        server.running, server.waiting, server.for_capacity = load.running, load.waiting, load.for_capacity
        server.waiting_streak = server.waiting_streak + 1 if load.for_capacity > 0 else 0
        server.share = self.step(server, now)

    def _failed(self, url: str, server: _Server, reason: str, fixed: int, now: float) -> None:
        server.failures += 1
        server.running = server.waiting = server.for_capacity = None
        server.waiting_streak = 0
        if server.failures < self.config.fallback_after and server.source == "metrics":  # a blip, maybe
            server.note = f"{reason}; its last share holds (failure {server.failures} of {self.config.fallback_after})"
            return
        if server.source != "fixed":
            log.warning(
                "adaptive run concurrency: %s: %s; it gets the fixed share (%d episodes) and is asked again every %g s",
                url,
                reason,
                fixed,
                self.config.retry_s,
            )
        server.source, server.share = "fixed", fixed
        server.note = f"{reason}: the fixed share, max_run_workers / healthy servers"
        server.retry_at = now + self.config.retry_s

    def step(self, server: _Server, now: float) -> int:
        """One server's next share from its engine load (the control law of the module's docstring)."""
        target, gain = self.config.target_engine_batch, self.config.gain
        running, waiting, for_capacity = server.running, server.waiting, server.for_capacity
        # An engine that runs nothing is not full, whatever waits (a request larger than its whole KV cache).
        queueing = server.waiting_streak >= self.config.waiting_polls and running > 0
        if queueing:  # the engine is full: what it runs is all it can (max_num_seqs, or its KV cache)
            server.capacity, server.capacity_until = running, now + self.config.capacity_memory_s
        elif server.capacity is not None and (now >= server.capacity_until or running > server.capacity):
            server.capacity = None
        aim = target if server.capacity is None else min(target, server.capacity)
        excess = max(running - target, 0.0) + (for_capacity if queueing else 0.0)
        load = max(running + waiting, server.in_flight)
        share = server.share
        if excess > 0:
            share -= max(1, math.ceil(gain * excess))
        elif for_capacity == 0 and load < aim and self.queued() > 0 and self.limiter.limit < self.max_run_workers:
            share += max(1, math.ceil(gain * (aim - load)))
        return max(1, min(share, self.max_run_workers))

    def describe(self) -> RunConcurrencyState:
        return RunConcurrencyState(
            mode="adaptive" if self.adaptive else "fixed",
            limit=self.limiter.limit,
            held=self.limiter.held,
            target_engine_batch=self.config.target_engine_batch if self.adaptive else None,
            min=self.config.min_run_workers if self.adaptive else self.max_run_workers,
            max=self.max_run_workers,
            servers=[
                EngineLoad(
                    url=url,
                    source=s.source,
                    running=s.running,
                    waiting=s.waiting,
                    waiting_for_capacity=s.for_capacity,
                    share=s.share,
                    note=s.note,
                )
                for url, s in self._servers.items()
            ],
        )
