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
another; a background health check brings it back. With none healthy, an episode waits a while before failing.
The log says each transition once: a server not answering yet is waited for (an info line, vLLM starts in a
minute or more; from the second notice, WAITING_LOG_S later, a warning naming --llm-url, as a mistyped URL never
answers), its first answer and each recovery are info lines, and only a server that had answered and stops is a
warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from server_kit.errors import DownstreamError, ProrlError

from ..models import LLMServerInfo, SamplingParams
from .llm_protocols import PROTOCOLS, MalformedAnswer, Protocol, Request, UnsupportedRequest, split_url

if TYPE_CHECKING:
    from ..hooks.plugin_set import PluginSet

log = logging.getLogger(__name__)

_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
# A server not answering yet is said to be waited for once this often at most (vLLM starts in a minute or more).
WAITING_LOG_S = 60.0


class LLMUnavailable(DownstreamError):
    """No healthy LLM server could serve the request."""

    answer_status = 503


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
    # Whether it has ever answered a health check: until then a failing one is a server still starting (vLLM
    # takes a minute or more), waited for, not one gone down. `waiting_logged_at`: when the wait was last logged,
    # `waiting_since`: when it began (the event loop's clock).
    answered: bool = False
    waiting_logged_at: float | None = None
    waiting_since: float | None = None

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
        request_timeout: float = 600.0,
        health_interval: float = 5.0,
        max_failovers: int = 3,
        unavailable_wait_s: float = 30.0,
        plugins: PluginSet | None = None,
    ) -> None:
        self._plugins = plugins  # told of every request (`prorl_llm_request`)
        self._servers: dict[str, LLMServer] = {}
        for url in urls:
            self.add(url)
        self._request_timeout = aiohttp.ClientTimeout(total=request_timeout)
        self._http: aiohttp.ClientSession | None = None
        self._health_interval = health_interval
        self._max_failovers = max_failovers
        self._unavailable_wait_s = unavailable_wait_s
        self._health_task: asyncio.Task[None] | None = None

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
        server = self._servers.pop(split_url(url)[1], None)
        if server is None:
            return False
        server.removed = True  # episodes pinned to it fail over on their next turn
        return True

    def replace(self, urls: list[str]) -> None:
        """Make `urls` the whole set, in one step of the event loop: concurrent callers cannot interleave."""
        wanted = {split_url(url)[1]: url for url in urls}
        for base in [b for b in self._servers if b not in wanted]:
            self.remove(base)
        for url in wanted.values():
            self.add(url)

    def servers(self) -> list[LLMServerInfo]:
        return [s.info() for s in self._servers.values()]

    def any_healthy(self) -> bool:
        """Whether an episode could generate now: at least one server configured and healthy."""
        return any(s.healthy for s in self._servers.values())

    # -- life cycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        # Idle connections are dropped before vLLM's own keep-alive (5 s) would close them under a request.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
        self._http = aiohttp.ClientSession(connector=connector, timeout=self._request_timeout)
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_forever())

    async def close(self) -> None:
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

    @staticmethod
    def _mark_healthy(server: LLMServer) -> None:
        """Log each transition once: the first answer of a server, and each recovery after it went down."""
        if not server.answered:
            protocol = server.protocol.name if server.protocol is not None else "?"
            log.info("LLM server %s answers (%s, model %s)", server.url, protocol, server.model or "-")
        elif not server.healthy:
            log.info("LLM server %s is healthy again", server.url)
        server.answered, server.healthy = True, True
        server.waiting_logged_at = server.waiting_since = None

    @staticmethod
    def _mark_unhealthy(server: LLMServer, reason: Exception) -> None:
        """A server that has answered before and fails is down: one warning per transition. One that never
        answered is still starting, or its URL is wrong: an info line first, then (every WAITING_LOG_S at most) a
        warning that names the flag to check, since a server that never answers would otherwise be only info."""
        if server.answered:
            if server.healthy:
                log.warning("LLM server %s is unhealthy: %s", server.url, reason)
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
        deadline = time.monotonic() + self._unavailable_wait_s
        delay = 0.25
        while not (healthy := [s for s in self._servers.values() if s.healthy]):
            # A server restarting, or one failed probe, must not fail every episode at once: wait a while.
            if time.monotonic() + delay > deadline:
                raise LLMUnavailable(
                    f"no healthy LLM server among {len(self._servers)} configured for {self._unavailable_wait_s:g} s"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 4.0)
            await self.check_health()
        chosen = min(healthy, key=lambda s: (s.in_flight, s.requests))
        if current is not None and chosen is not current:
            pin.failovers += 1
        pin.server = chosen
        return chosen

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, pin: Pin) -> Generation:
        """Sample one turn; retries once where it was, then fails over when the pinned server cannot answer."""
        attempts = 0
        while True:
            server = await self._choose(pin)
            try:
                return await self._complete(server, prompt_ids, sampling)
            except _ServerError as exc:
                attempts += 1
                server.failures += 1
                server.consecutive_failures += 1
                # One dropped connection is not a dead server; a refused one is (and a server restarting on its
                # port may accept a retry into its backlog and leave it waiting until it is up, or for good).
                if exc.down or server.consecutive_failures >= 2:
                    self._mark_unhealthy(server, exc)
                log.warning("LLM server %s failed (%s); retrying", server.url, exc)
                if attempts > self._max_failovers + 1:
                    raise LLMUnavailable(f"gave up after {attempts} attempts; last error: {exc}") from exc

    async def _complete(self, server: LLMServer, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        if server.protocol is None or (server.protocol.needs_model and server.model is None):
            await self._probe(server)
            if not server.healthy:
                raise _ServerError(f"{server.url} does not answer its health check")
        try:
            path, body = server.protocol.generate_request(prompt_ids, sampling, server.model)
        except UnsupportedRequest as exc:
            raise LLMRequestError(f"{server.url}: {exc}") from None
        server.in_flight += 1
        started, monotonic = time.perf_counter(), time.monotonic()
        choice, error = None, None
        try:
            async with self._http.post(server.base + path, json=body) as response:
                if response.status >= 500:
                    raise _ServerError(f"{response.status}: {(await response.text())[:300]}")
                if response.status >= 400:
                    raise LLMRequestError(f"{server.url} refused the request: {(await response.text())[:500]}")
                answer = await response.read()
            try:
                choice = server.protocol.parse(answer)
            except MalformedAnswer as exc:  # a malformed 200 is the server's failure, like a 5xx
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
        return Generation(
            token_ids=choice.token_ids,
            logprobs=choice.logprobs,
            text=choice.text,
            finish_reason=choice.finish_reason,
            server=server.url,
            seconds=time.perf_counter() - started,
        )
