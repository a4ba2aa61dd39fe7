"""Token-in/token-out generation against LLM servers (vLLM, SGLang, ProRL's token protocol), balanced over
several of them. The wire formats are in llm_protocols.py.

Why /v1/completions with a token-id prompt rather than chat completions: the trainer must see exactly the
token ids the policy sampled. A chat endpoint re-renders and re-tokenizes the conversation every turn, and
a decoded-then-re-encoded response need not give back the same ids. Here the prompt goes out as ids and the
sampled ids and their logprobs come back (`return_token_ids`, `logprobs: 1`), so nothing is re-tokenized.

The same holds for SGLang's native /generate and ProRL's token-level /generate, which take and return ids.

Balancing: an episode is pinned to one server (its growing prompt stays in that server's prefix cache);
new episodes go to the healthy server with the fewest requests in flight. A server that fails a request is
marked unhealthy after two failures in a row (or a failed health check) and the episode fails over to
another; a background health check brings it back.
The log says each transition once: a server not answering yet is waited for (an info line, vLLM starts in a
minute or more; from the second notice, WAITING_LOG_S later, a warning naming --llm-url, as a mistyped URL never
answers), its first answer and each recovery are info lines, and only a server that had answered and stops is a
warning.

An outage: every configured server unhealthy (down, starting, restarting for a weight sync), none configured, or
an error-rate spike (SPIKE_FAILURES requests in a row, fleet-wide, failed for their servers: health checks can pass
while generation fails, as with an engine dead behind a live API server). `outage()` says which and since when,
and `on_outage` listeners hear each start and end (the decoupled producer pauses admission meanwhile). With no
server healthy a turn waits for one, up to --llm-outage-wait-s, before its episode fails (LLMUnavailable, marked as
the outage's: decoupled mode runs the prompt again without counting the run against max_attempts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from server_kit.errors import DownstreamError, ProrlError
from server_kit.in_flight import CallEnded, InFlight

from ..models import LLMOutage, LLMServerInfo, SamplingParams
from .llm_protocols import PROTOCOLS, MalformedAnswer, Protocol, Request, Sampled, UnsupportedRequest, split_url

if TYPE_CHECKING:
    from ..hooks.plugin_set import PluginSet

log = logging.getLogger(__name__)

_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
# A server that does not take a connection in this long is failed over. Nothing else bounds a generation request
# by default: a long turn of a long-context model may take many minutes, and the job's own time budget (which
# the pipeline enforces on the whole stage) is the limit its user chose. `call_timeout_s` adds one per call.
CONNECT_TIMEOUT_S = 30.0
# A server unhealthy this long (every health check failing meanwhile) has its requests in flight ended: they fail
# over. A node that vanished without a reset (a partition) would otherwise hold them until the job's budget ends,
# since no call has a limit of its own. Long enough that a server busy for a while (its health checks timing out
# under load) keeps the turns it is generating.
SILENT_SERVER_S = 60.0
# A pause waits while the server aborts its requests (vLLM: milliseconds) or they finish.
_CONTROL_TIMEOUT = aiohttp.ClientTimeout(total=60.0)
# A server not answering yet is said to be waited for once this often at most (vLLM starts in a minute or more).
WAITING_LOG_S = 60.0
# How long a turn waits for a healthy server when none is (--llm-outage-wait-s): a fleet restarting, or reloading
# weights, takes minutes.
OUTAGE_WAIT_S = 300.0
# An error-rate spike: this many requests in a row, fleet-wide, failed for their servers (5xx, a malformed answer, a
# timeout, a refused connection) with none answered in between. It lasts until a request is answered, or until
# SPIKE_HOLD_S after the last failure (then admitted episodes try again; the next failure starts it again).
SPIKE_FAILURES = 20
SPIKE_HOLD_S = 30.0


class LLMUnavailable(DownstreamError):
    """No healthy LLM server could serve the request. `outage`: the fleet was out when the request was given up
    (`LLMPool.outage`): not the episode's fault."""

    answer_status = 503

    def __init__(self, message: str, outage: bool = False) -> None:
        super().__init__(message)
        self.outage = outage


class LLMRequestError(DownstreamError):
    """The server answered, but with an error that retrying elsewhere would not fix (e.g. a bad prompt)."""


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    text: str | None  # None where the server's protocol returns ids only: the caller decodes them
    finish_reason: str | None
    server: str
    seconds: float
    aborted: bool = False  # stopped by the server before it ended (a weight update's pause, an operator's abort)


@dataclass
class Progress:
    """How many tokens of a streamed request have arrived (the barrier's `keep` mode reads it at a resume).
    `restarted` is called when the request is sent again (a retry, elsewhere): it starts over."""

    received: int = 0
    restarted: Callable[[], None] | None = None

    def restart(self) -> None:
        self.received = 0
        if self.restarted is not None:
            self.restarted()


@dataclass
class LLMServer:
    base: str  # its base URL: the pool's name for it
    named_protocol: str | None = None  # the protocol its URL names; else it is probed
    protocol: Protocol | None = None  # the protocol it speaks, once known
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    model: str | None = None  # the served model name, where its protocol needs it (OpenAI: /v1/models)
    removed: bool = False
    control_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # its pauses, resumes and aborts, in order
    # Whether it has ever answered a health check: until then a failing one is a server still starting (vLLM
    # takes a minute or more), waited for, not one gone down. `waiting_logged_at`: when the wait was last logged,
    # `waiting_since`: when it began (the event loop's clock).
    answered: bool = False
    waiting_logged_at: float | None = None
    waiting_since: float | None = None
    unhealthy_since: float | None = None  # time.monotonic() when it last went unhealthy; None while healthy
    calls: InFlight = field(default_factory=InFlight)  # its requests in flight (`_end_calls_to`)

    @property
    def url(self) -> str:
        return f"{self.named_protocol}+{self.base}" if self.named_protocol else self.base

    def info(self) -> LLMServerInfo:
        return LLMServerInfo(
            url=self.url,
            protocol=self.protocol.name if self.protocol is not None else None,
            healthy=self.healthy,
            in_flight=self.in_flight,
            requests=self.requests,
            failures=self.failures,
        )


@dataclass
class Pin:
    """An episode's server choice: kept while the server is healthy, so its prefix cache is reused."""

    server: LLMServer | None = None
    failovers: int = 0


class _ServerError(ProrlError):
    """The server could not answer (connection refused, reset, timed out, 5xx): another server might.
    `down`: it certainly serves nothing now (it refused the connection)."""

    def __init__(self, message: str, down: bool = False) -> None:
        super().__init__(message)
        self.down = down


class LLMPool:
    """The LLM servers of the service.

    Its HTTP client is aiohttp's rather than httpx's: measured in this project's rollout benchmark, one
    generation request cost 2 ms of client CPU with httpx (5-7 ms at 256 concurrent, as its pool scans every
    connection) against about 0.2 ms with aiohttp, and the agent loop makes one per turn.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        call_timeout_s: float | None = None,
        health_interval: float = 5.0,
        max_failovers: int = 3,
        outage_wait_s: float = OUTAGE_WAIT_S,
        plugins: PluginSet | None = None,
        stream: bool = False,
    ) -> None:
        self._plugins = plugins  # told of every request (`prorl_llm_request`)
        # Whether turns are read as streams where the protocol can: each request's tokens are counted as they
        # arrive (`Progress`), which the barrier's `keep` mode needs; it costs the service CPU per token.
        self.stream = stream
        self._servers: dict[str, LLMServer] = {}
        for url in urls:
            self.add(url)
        self._request_timeout = aiohttp.ClientTimeout(total=call_timeout_s, sock_connect=CONNECT_TIMEOUT_S)
        self._http: aiohttp.ClientSession | None = None
        self._health_interval = health_interval
        self._max_failovers = max_failovers
        self._outage_wait_s = outage_wait_s
        self._health_task: asyncio.Task[None] | None = None
        self._rechecking: asyncio.Future[None] | None = None  # the health round waiting turns share
        # The outage (`outage()`), as last told to the listeners; the turns waiting for a server now, and in total.
        self._outage: LLMOutage | None = None
        self._outage_listeners: list[Callable[[LLMOutage | None], None]] = []
        self._waiting = 0
        self.outage_waits = 0
        # The fleet's run of requests failed for their servers (an error-rate spike past SPIKE_FAILURES), until when
        # it counts as one (SPIKE_HOLD_S after its last failure), and the timer that notices that end.
        self._failing_in_a_row = 0
        self._spike_until = 0.0
        self._spike_end: asyncio.TimerHandle | None = None

    # -- membership -------------------------------------------------------------------------------------
    def add(self, url: str) -> LLMServer:
        """The server at `url`'s base URL, added if new. One base URL is one server: a URL that names a protocol
        sets it (`sglang+http://h` after `http://h`), a plain one keeps what is known."""
        named, base = split_url(url)
        server = self._servers.get(base)
        if server is None:
            server = self._servers[base] = LLMServer(base, named)
        elif named is not None and named != server.named_protocol:
            server.named_protocol, server.protocol, server.model = named, None, None  # probed again, as named
        return server

    def remove(self, url: str) -> bool:
        removed = self._drop(url)
        self._follow_outage()  # the last healthy one gone
        return removed

    def _drop(self, url: str) -> bool:
        server = self._servers.pop(split_url(url)[1], None)
        if server is None:
            return False
        server.removed = True  # episodes pinned to it fail over on their next turn
        return True

    def replace(self, urls: list[str]) -> None:
        """Make `urls` the whole set, in one step of the event loop: concurrent callers cannot interleave. An
        outage is followed at the health check that comes next (the new servers count as healthy until then), or
        at once where the set is now empty."""
        wanted = {split_url(url)[1]: url for url in urls}
        for base in [b for b in self._servers if b not in wanted]:
            self._drop(base)
        for url in wanted.values():
            self.add(url)
        if not self._servers:
            self._follow_outage()

    def servers(self) -> list[LLMServerInfo]:
        return [s.info() for s in self._servers.values()]

    def any_healthy(self) -> bool:
        """Whether an episode could generate now: at least one server configured and healthy."""
        return any(s.healthy for s in self._servers.values())

    # -- outages ----------------------------------------------------------------------------------------
    def outage(self) -> LLMOutage | None:
        """Why no episode can generate now, since when, and how many turns wait for a server; None while one can."""
        outage = self._follow_outage()
        return None if outage is None else outage.model_copy(update={"waiting": self._waiting})

    def on_outage(self, listener: Callable[[LLMOutage | None], None]) -> None:
        """Call `listener` at each start of an outage (with it) and at each end (with None), at once, on the
        event loop: a health check that finds a server again ends it."""
        self._outage_listeners.append(listener)

    def _outage_reason(self) -> str | None:
        if not self._servers:
            return "no LLM server is configured (--llm-url, PUT /v1/llm-servers)"
        if not any(s.healthy for s in self._servers.values()):
            if not any(s.answered for s in self._servers.values()):
                return f"none of the {len(self._servers)} LLM servers has answered yet (starting, or a wrong URL)"
            return f"none of the {len(self._servers)} LLM servers is healthy"
        if self._failing_in_a_row >= SPIKE_FAILURES and time.monotonic() < self._spike_until:
            return f"error-rate spike: the last {self._failing_in_a_row} requests to the LLM servers all failed"
        return None

    def _follow_outage(self) -> LLMOutage | None:
        """The outage now, looked at afresh; each start is logged as a warning (an info line while no server has
        ever answered) and each end as an info line, and both are told to the listeners (a listener's failure is
        logged, never raised)."""
        reason, was = self._outage_reason(), self._outage
        if (reason is None) == (was is None):
            if was is not None:
                was.reason = reason  # the same outage, for another reason now (a spike, then every server down)
            return was
        if reason is not None:
            self._outage = LLMOutage(reason=reason, since=time.time())
            # Servers still starting (none has ever answered: vLLM takes a minute or more) are waited for, not down.
            level = logging.WARNING if any(s.answered for s in self._servers.values()) else logging.INFO
            log.log(
                level,
                "LLM outage: %s; turns wait up to %g s for a server (--llm-outage-wait-s)",
                reason,
                self._outage_wait_s,
            )
        else:
            self._outage = None
            log.info("LLM outage over after %.0f s", time.time() - was.since)
        for listener in list(self._outage_listeners):
            try:
                listener(self._outage)
            except Exception:
                log.exception("a listener of LLM outages failed")
        return self._outage

    def _server_failed(self) -> None:
        """A request failed for its server: the fleet's run of failures grows (a spike once past SPIKE_FAILURES)."""
        self._failing_in_a_row += 1
        if self._failing_in_a_row >= SPIKE_FAILURES:
            self._spike_until = time.monotonic() + SPIKE_HOLD_S
            if self._spike_end is not None:
                self._spike_end.cancel()
            # Its end is noticed then even with no request left to notice it (admission paused, episodes failed).
            self._spike_end = asyncio.get_running_loop().call_later(SPIKE_HOLD_S, self._spike_over)
        self._follow_outage()

    def _spike_over(self) -> None:
        self._spike_end, self._spike_until = None, 0.0
        self._follow_outage()

    def _server_answered(self) -> None:
        """A request was answered: whatever run of failures there was has ended."""
        if self._failing_in_a_row:
            self._failing_in_a_row = 0
            self._follow_outage()

    # -- life cycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        # Idle connections are dropped before vLLM's own keep-alive (5 s) would close them under a request.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
        self._http = aiohttp.ClientSession(connector=connector, timeout=self._request_timeout)
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_forever())

    async def close(self) -> None:
        if self._spike_end is not None:
            self._spike_end.cancel()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._http is not None:
            await self._http.close()

    async def _health_forever(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval)
            await self.check_health()

    async def check_health(self) -> None:
        await asyncio.gather(*(self._probe(s) for s in list(self._servers.values())))
        self._follow_outage()  # with no server at all, no probe looked
        now = time.monotonic()
        for server in self._servers.values():
            if server.calls and server.unhealthy_since is not None and now - server.unhealthy_since >= SILENT_SERVER_S:
                self._end_calls_to(server)

    @staticmethod
    def _end_calls_to(server: LLMServer) -> None:
        log.warning(
            "LLM server %s has failed its health checks for %g s: its %d requests in flight end and fail over",
            server.url,
            SILENT_SERVER_S,
            len(server.calls),
        )
        server.calls.end_all(f"no answer while it failed its health checks for {SILENT_SERVER_S:g} s")

    async def _recheck(self) -> None:
        """A health round that every turn waiting for a server shares: one at a time, whoever asks, and not
        cancelled when one of them is."""
        if self._rechecking is None or self._rechecking.done():
            self._rechecking = asyncio.ensure_future(self.check_health())
        await asyncio.shield(self._rechecking)

    async def check(self, url: str) -> LLMServerInfo:
        """Probe one server now (one just added), not the whole pool."""
        server = self.add(url)
        await self._probe(server)
        return server.info()

    async def _probe(self, server: LLMServer) -> None:
        try:
            if server.protocol is None:
                server.protocol, server.model = await self._detect(server)
            else:
                server.model = await self._health(server, server.protocol)
            self._mark_healthy(server)
            server.consecutive_failures = 0
        except (TimeoutError, aiohttp.ClientError, MalformedAnswer) as exc:  # any other answer: not serving
            self._mark_unhealthy(server, exc)
        except Exception as exc:  # a probe must never end the health checks (or fail the API call that asked)
            log.exception("LLM server %s: its health check failed unexpectedly", server.url)
            self._mark_unhealthy(server, exc)
        self._follow_outage()  # a server back ends an outage; the last one down starts one

    @staticmethod
    def _mark_healthy(server: LLMServer) -> None:
        """Log each transition once: the first answer of a server, and each recovery after it went down."""
        if not server.answered:
            protocol = server.protocol.name if server.protocol is not None else "?"
            log.info("LLM server %s answers (%s, model %s)", server.url, protocol, server.model or "-")
        elif not server.healthy:
            log.info("LLM server %s is healthy again", server.url)
        server.answered, server.healthy = True, True
        server.waiting_logged_at = server.waiting_since = server.unhealthy_since = None

    @staticmethod
    def _mark_unhealthy(server: LLMServer, reason: Exception) -> None:
        """A server that has answered before and fails is down: one warning per transition. One that never
        answered is still starting, or its URL is wrong: an info line first, then (every WAITING_LOG_S at most) a
        warning that names the flag to check, since a server that never answers would otherwise be only info."""
        if server.answered:
            if server.healthy:
                # A timeout's own text is empty: its type says what happened.
                log.warning("LLM server %s is unhealthy: %s", server.url, str(reason) or type(reason).__name__)
        else:
            now = asyncio.get_running_loop().time()
            if server.waiting_since is None:
                server.waiting_since = now
            if server.waiting_logged_at is None:
                log.info("waiting for LLM server %s to answer (not yet: %s)", server.url, reason)
                server.waiting_logged_at = now
            elif now - server.waiting_logged_at >= WAITING_LOG_S:
                log.warning(
                    "LLM server %s has not answered for %.0f s (%s): check its URL (--llm-url, or the one given to "
                    "PUT /v1/llm-servers) and that the server is running",
                    server.url,
                    now - server.waiting_since,
                    reason,
                )
                server.waiting_logged_at = now
        if server.unhealthy_since is None:
            server.unhealthy_since = time.monotonic()
        server.healthy = False

    async def _fetch(self, server: LLMServer, request: Request) -> bytes:
        method, path, body = request
        async with self._http.request(method, server.base + path, json=body, timeout=_PROBE_TIMEOUT) as response:
            response.raise_for_status()
            return await response.read()

    async def _health(self, server: LLMServer, protocol: Protocol) -> str | None:
        return protocol.read_health(await self._fetch(server, protocol.health_request()))

    async def _detect(self, server: LLMServer) -> tuple[Protocol, str | None]:
        """The protocol a server speaks, and the model its answer named: the one its URL names, else the first
        (in PROTOCOLS' order) whose detection request it answers as that protocol would."""
        if server.named_protocol is not None:
            protocol = PROTOCOLS[server.named_protocol]
            return protocol, await self._health(server, protocol)
        tried: list[str] = []
        for protocol in PROTOCOLS.values():
            for request in protocol.detect_requests():
                try:
                    return protocol, protocol.read_detect(await self._fetch(server, request))
                except (TimeoutError, aiohttp.ClientError, MalformedAnswer) as exc:
                    tried.append(f"{request[0]} {request[1]}: {exc}")
        raise MalformedAnswer(f"speaks none of {', '.join(PROTOCOLS)} ({'; '.join(tried)})")

    async def read(self, url: str, path: str, timeout: float) -> bytes:
        """GET `path` of the server at `url` over the pool's session (its /metrics, say): the body of a 2xx answer;
        aiohttp.ClientResponseError for another status, TimeoutError past `timeout` seconds."""
        wait = aiohttp.ClientTimeout(total=timeout)
        async with self._http.get(split_url(url)[1] + path, timeout=wait) as response:
            response.raise_for_status()
            return await response.read()

    # -- generation -------------------------------------------------------------------------------------
    async def _choose(self, pin: Pin) -> LLMServer:
        current = pin.server
        if current is not None and current.healthy and not current.removed:
            return current
        deadline = time.monotonic() + self._outage_wait_s
        delay = 0.25
        waiting = False
        try:
            while not (healthy := [s for s in self._servers.values() if s.healthy]):
                # An outage (servers restarting, reloading weights, or one failed probe) must not fail every episode
                # at once: the turn waits for a server, up to --llm-outage-wait-s. The wait counts against the job's
                # time budget, unlike a weight update's pause (pipeline._within_budget): that pause is the trainer's
                # own, ended by its resume, while an outage has no known end, and the budget is what bounds how long
                # an episode holds its sandbox and run slot. A budget that runs out meanwhile fails the job as the
                # outage's (`timeout`, JobError.outage), not the episode's.
                if not waiting:
                    waiting = True
                    self._waiting += 1
                    self.outage_waits += 1
                if time.monotonic() + delay > deadline:
                    raise LLMUnavailable(
                        f"no healthy LLM server among {len(self._servers)} configured for {self._outage_wait_s:g} s "
                        "(--llm-outage-wait-s)",
                        outage=True,
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 4.0)
                await self._recheck()
        finally:
            if waiting:
                self._waiting -= 1
        chosen = min(healthy, key=lambda s: (s.in_flight, s.requests))
        if current is not None and chosen is not current:
            pin.failovers += 1
        pin.server = chosen
        return chosen

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, pin: Pin, progress: Progress | None = None
    ) -> Generation:
        """Sample one turn; retries once where it was, then fails over when the pinned server cannot answer.
        Where it is streamed, `progress` counts its tokens as they arrive."""
        attempts = 0
        while True:
            server = await self._choose(pin)
            try:
                return await self._complete(server, prompt_ids, sampling, progress or Progress())
            except _ServerError as exc:
                attempts += 1
                server.failures += 1
                server.consecutive_failures += 1
                # One dropped connection is not a dead server; a refused one is (and a server restarting on its
                # port may accept a retry into its backlog and leave it waiting until it is up, or for good).
                if exc.down or server.consecutive_failures >= 2:
                    self._mark_unhealthy(server, exc)
                self._server_failed()
                log.warning("LLM server %s failed (%s); retrying", server.url, exc)
                if attempts > self._max_failovers + 1:
                    outage = self.outage() is not None  # the fleet failing, not this episode's request
                    raise LLMUnavailable(f"gave up after {attempts} attempts; last error: {exc}", outage) from exc

    async def _complete(
        self, server: LLMServer, prompt_ids: list[int], sampling: SamplingParams, progress: Progress
    ) -> Generation:
        if server.protocol is None or (server.protocol.needs_model and server.model is None):
            await self._probe(server)
            if not server.healthy:
                raise _ServerError(f"{server.url} does not answer its health check")
        streamed = self.stream and server.protocol.streams
        ask = server.protocol.stream_request if streamed else server.protocol.generate_request
        try:
            path, body = ask(prompt_ids, sampling, server.model)
        except UnsupportedRequest as exc:
            raise LLMRequestError(f"{server.url}: {exc}") from None
        server.in_flight += 1
        started, monotonic = time.perf_counter(), time.monotonic()
        choice, error = None, None
        try:
            try:  # a server taken for gone has it ended (`_end_calls_to`), the episode waiting for it not
                choice = await server.calls.run(self._exchange(server, path, body, streamed, progress))
            except CallEnded as exc:
                raise _ServerError(str(exc)) from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise _ServerError(error, down=isinstance(exc, aiohttp.ClientConnectorError)) from exc
        except (_ServerError, LLMRequestError) as exc:
            error = str(exc)
            raise
        finally:
            server.in_flight -= 1
            if self._plugins is not None:
                self._plugins.notify(
                    "prorl_llm_request",
                    server=server.url,
                    started=monotonic,
                    seconds=time.perf_counter() - started,
                    prompt_tokens=len(prompt_ids),
                    response_tokens=len(choice.token_ids) if choice is not None else 0,
                    error=None if choice is not None else (error or "no answer (the request was cancelled)"),
                )
        server.requests += 1  # answered ones: `failures` counts the others
        server.consecutive_failures = 0
        self._server_answered()
        return Generation(
            token_ids=choice.token_ids,
            logprobs=choice.logprobs,
            text=choice.text,
            finish_reason=choice.finish_reason,
            server=server.url,
            seconds=time.perf_counter() - started,
            aborted=choice.aborted,
        )

    async def _exchange(self, server: LLMServer, path: str, body: dict, streamed: bool, progress: Progress) -> Sampled:
        """One generation request and its answer, read whole or as a stream."""
        async with self._http.post(server.base + path, json=body) as response:
            if response.status >= 500:
                raise _ServerError(f"{response.status}: {(await response.text())[:300]}")
            if response.status >= 400:
                raise LLMRequestError(f"{server.url} refused the request: {(await response.text())[:500]}")
            try:
                if streamed:
                    progress.restart()  # a retry starts over
                    return await _read_stream(server.protocol, response, progress)
                return server.protocol.parse(await response.read())
            except MalformedAnswer as exc:  # a malformed 200 is the server's failure, like a 5xx
                raise _ServerError(str(exc)) from None

    # -- weight updates (weight_barrier.py) -----------------------------------------------------------------
    def _serving(self) -> list[LLMServer]:
        """The servers a request could be in flight at: those whose protocol is known (others never answered)."""
        return [s for s in self._servers.values() if s.protocol is not None]

    def check_pausable(self, mode: str) -> None:
        """UnsupportedRequest, naming the server, where one cannot pause in `mode`. `keep` also needs the turns
        streamed: which of a frozen request's tokens came before the pause is known only by counting them."""
        for server in self._serving():
            try:
                server.protocol.pause_request(mode)
            except UnsupportedRequest as exc:
                raise UnsupportedRequest(f"LLM server {server.url}: {exc}") from None
            if mode == "keep" and not (self.stream and server.protocol.streams):
                raise UnsupportedRequest(
                    f"LLM server {server.url}: mode 'keep' needs each turn's tokens counted as they arrive: start "
                    "the service with --llm-stream (vLLM servers only)"
                )

    async def pause_servers(self, mode: str) -> None:
        """Pause every server in `mode` (abort: its requests in flight aborted; keep: frozen). A server that
        cannot be paused fails the call (LLMRequestError, naming it), once every server's call has ended, except one
        that is down: it generates nothing."""
        results = await asyncio.gather(
            *(self._control(s, s.protocol.pause_request(mode), "pause") for s in self._serving()),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def resume_servers(self) -> None:
        """Resume every server that can be paused; failures are logged, not raised (a server down resumes when it
        restarts)."""
        await self._to_all(lambda protocol: protocol.resume_request(), "resume")

    async def abort_all(self) -> None:
        """Abort whatever is in flight at every server that can abort (see weight_barrier.ABORT_AGAIN_S); failures
        are logged."""
        await self._to_all(lambda protocol: protocol.abort_request(), "abort")

    async def _to_all(self, request: Callable[[Protocol], Request], what: str) -> None:
        calls = []
        for server in self._serving():
            with contextlib.suppress(UnsupportedRequest):  # a protocol that cannot pause was never paused
                calls.append(self._control(server, request(server.protocol), what))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, Exception):
                log.warning("%s", result)

    async def _control(self, server: LLMServer, request: Request, what: str) -> None:
        """One pause, resume or abort, in the order they were asked at this server (`control_lock`): a resume never
        overtakes the pause before it."""
        method, path, body = request
        async with server.control_lock:
            await self._send_control(server, method, path, body, what)

    async def _send_control(self, server: LLMServer, method: str, path: str, body: dict | None, what: str) -> None:
        try:
            async with self._http.request(method, server.base + path, json=body, timeout=_CONTROL_TIMEOUT) as answer:
                if answer.status == 404:
                    raise LLMRequestError(
                        f"LLM server {server.url} does not serve {path.split('?')[0]} to {what} generation (vLLM "
                        "serves it with VLLM_SERVER_DEV_MODE=1; scripts/serve-vllm.sh sets it)"
                    )
                if answer.status >= 400:
                    raise LLMRequestError(f"LLM server {server.url} refused to {what}: {(await answer.text())[:300]}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            if not server.healthy:
                return  # down: it generates nothing, and a restart comes back unpaused
            raise LLMRequestError(f"LLM server {server.url} did not {what}: {type(exc).__name__}: {exc}") from exc


async def _read_stream(protocol: Protocol, response: aiohttp.ClientResponse, progress: Progress) -> Sampled:
    """A turn read as server-sent events, joined; `progress` counts its tokens as they arrive. Its text is left to
    the caller to decode from the ids (the events' texts need not add up to the whole's: a stop token's, say). The
    events are split here rather than by aiohttp's line reader, whose 64 KiB line limit the first event (it carries
    the prompt's ids) can pass."""
    ids: list[int] = []
    logprobs: list[float] = []
    finish: str | None = None
    aborted = False
    pending = b""
    async for data in response.content.iter_any():
        pending = (pending + data).replace(b"\r\n", b"\n")  # either line ending, as server-sent events allow
        *events, pending = pending.split(b"\n\n")
        for event in events:
            for line in event.splitlines():
                if not line.startswith(b"data:"):
                    continue
                part = protocol.parse_event(line[5:].strip())
                if part is None:
                    return Sampled(ids, logprobs, None, finish, aborted)
                ids += part.token_ids
                logprobs += part.logprobs
                finish = part.finish_reason or finish
                aborted = aborted or part.aborted
                progress.received = len(ids)
    raise MalformedAnswer("malformed answer: the stream ended without its [DONE] event")
